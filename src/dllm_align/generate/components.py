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


# --------------------------------------------------------------------------- decoding rules
# A rule (``generate.sampler``) is a ``generate.rules.DecodingRule`` in its own module. Its ``ignores`` are the
# shared ``generate`` keys it never reads (refused when set away from their defaults); its ``check`` receives
# the ``generate`` section (the samplers' settings carry no recipe) and returns (key, message) problems. Both
# run when the recipe names the rule and again once ``sampler: auto`` is resolved to the model family's rule
# (``config.schema.rule_problems``). Its ``decodes`` trait names the likelihoods (noise processes) of the models it
# can decode: a model of another is refused by name before any prompt is decoded (``generate.rules.settings_for``).


def block_shapes(generate) -> list[tuple[str, str]]:
    """The semi-autoregressive blocks: gen_length in whole blocks, steps dealt evenly over them."""
    g, b, s = generate.gen_length, generate.block_length, generate.steps
    if g % b:
        return [("gen_length", f"{g} is not a multiple of block_length ({b}): the rule decodes whole blocks")]
    if s % (g // b):
        return [("steps", f"{s} is not a multiple of the number of blocks ({g // b}, gen_length / block_length)")]
    return []


register(Component(
    "rule", "llada", "dllm_align.generate.sampler:RULE", ignores=("top_p", "top_k"), check=block_shapes,
    traits={"decodes": ("masked",)},
    summary="LLaDA's semi-autoregressive block sampler (low-confidence or random remasking, cfg, fast mode)"))
register(Component(
    "rule", "dream", "dllm_align.generate.dream:RULE", ignores=("cache", "threshold", "cfg"),
    traits={"decodes": ("masked",)},
    summary="Dream's diffusion_generate over one canvas (alg, alg_temp, top_p, top_k, eps)"))
register(Component(
    "rule", "block", "dllm_align.generate.block:RULE", ignores=("cfg",), check=block_shapes,
    summary="block diffusion's rule (SDAR, LLaDA2): block by block with a cache of the finished blocks",
    traits={"fast_cache": "prefix", "decodes": ("block",)}))
register(Component(
    "rule", "diffusion_gemma", "dllm_align.generate.gemma:RULE",
    # temperature: the published sampler anneals its own (t_max 0.8 -> t_min 0.4) over canvases of random tokens,
    # so its tokens depend on the seed at any setting; 0 (the default) means that schedule, any other is refused
    ignores=("cache", "threshold", "cfg", "top_p", "top_k", "remasking", "alg", "alg_temp", "temperature"),
    traits={"decodes": ("uniform",)},
    summary="DiffusionGemma's published generate (reads gen_length and steps; its own temperature schedule)"))
