"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.
"""

from __future__ import annotations

from dllm_align.config.components import Component, register

# --------------------------------------------------------------------------- generation backends
# A backend's traits, read without loading it (dllm_align.generate.backend):
#   serves: how a new model reaches it: "load" (it loads the folder it is given), "reload" (a running server
#           is told to load new weights) or "fixed" (it serves one model and cannot change it);
#   reads:  the keys of the generate section that decide its tokens ("rule": every key the decoding rule
#           reads, as the in-process samplers do); only these are recorded beside its outputs;
#   loads_here: it loads the weights in this process, at model.dtype (recorded then, not otherwise).
register(Component(
    kind="backend", name="in_process", target="dllm_align.generate.in_process:InProcessGenerator.load",
    summary="the model loaded in this process, decoded by the samplers of dllm_align.generate",
    traits={"serves": "load", "reads": "rule", "loads_here": True},
))
