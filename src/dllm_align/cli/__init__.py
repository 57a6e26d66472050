"""The ``dllm-align`` command line: one module per command (group), each a thin layer that parses flags,
loads the recipe and calls the library. The library never imports this package.

Each command module imports only typer, the standard library, cli.app and the recipe schema at module
level, the rest inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""
