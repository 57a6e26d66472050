"""The ``dllm-align`` command line: one module per command (group), each a thin layer that parses flags,
loads the recipe and calls the library. The library never imports this package.
"""
