"""dllm-align: ELBO-KTO alignment of masked diffusion language models.

The package is importable without torch; heavy modules are imported by the
commands that need them so that ``dllm-align --help`` answers fast.
"""

__version__ = "0.1.0"
