"""dllm-align: ELBO-KTO alignment of masked diffusion language models.

One package per stage of the pipeline, each importing only the stages before it (its docstring says which;
``tests/test_layout.py`` holds the code to that):

    core -> config -> data -> models -> objective -> training -> generate / judge -> evaluate -> workflows -> cli

``core`` (errors, console, atomic files), ``config`` (recipes), ``data`` (reading, conversion, imbalance,
tokenising, batching), ``models`` (loading, the mask-predictor interface, precision, families), ``objective``
(the ELBO estimator and the losses), ``training`` (reference precompute and cache, the loop, checkpoints,
memory model, doctor), ``generate`` (samplers), ``judge`` (pairwise judging and its statistics), ``evaluate``
(lm-evaluation-harness), ``workflows`` (the demo, the pipeline, ablations) and ``cli`` (the thin Typer layer).

The package is importable without torch; heavy modules are imported by the
commands that need them so that ``dllm-align --help`` answers fast.
"""

__version__ = "0.1.0"
