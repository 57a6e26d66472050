"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from dllm_align.config.components import Component, ComponentSettings, register

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
# (``config.schema.rule_problems``).


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
    summary="LLaDA's semi-autoregressive block sampler (low-confidence or random remasking, cfg, fast mode)"))
register(Component(
    "rule", "dream", "dllm_align.generate.dream:RULE", ignores=("cache", "threshold", "cfg"),
    summary="Dream's diffusion_generate over one canvas (alg, alg_temp, top_p, top_k, eps)"))
register(Component(
    "rule", "block", "dllm_align.generate.block:RULE", ignores=("cfg",), check=block_shapes,
    summary="block diffusion's rule (SDAR, LLaDA2): block by block with a cache of the finished blocks",
    traits={"fast_cache": "prefix"}))
register(Component(
    "rule", "diffusion_gemma", "dllm_align.generate.gemma:RULE",
    ignores=("cache", "threshold", "cfg", "top_p", "top_k", "remasking", "alg", "alg_temp"),
    summary="DiffusionGemma's published generate (reads gen_length and steps; its own temperature schedule)"))


class Llada21Settings(ComponentSettings):
    """LLaDA2.1's joint-threshold decoding (``generate.llada21.<key>``; the model card's modes, the published bound
    on post-edit rounds)."""

    mode: Literal["quality", "speed"] = Field(
        "quality", description="The model card's modes: quality (mask-to-token threshold 0.7, editing threshold 0.5) "
        "or speed (0.5, 0.0); threshold / edit_threshold set here override the mode's.")
    threshold: Optional[float] = Field(
        None, ge=0, le=1, description="Mask to token: unmask every masked position of the block whose confidence "
        "exceeds this (at least the most confident one per round); null: the mode's.")
    edit_threshold: Optional[float] = Field(
        None, ge=0, le=1, description="Token to token: replace a decoded (non-prompt) token of the block whose new "
        "draw differs and whose confidence exceeds this; null: the mode's.")
    max_post_steps: int = Field(
        16, ge=0, le=1024, description="Editing rounds once the block has no mask left (published default 16; the "
        "block also ends at the first round that edits nothing).")


register(Component(
    "rule", "llada21", "dllm_align.generate.llada21:RULE", settings=Llada21Settings,
    # its thresholds are its own (generate.llada21.*); the published generate never reads steps
    ignores=("cfg", "remasking", "threshold", "steps", "alg", "alg_temp", "eps"),
    summary="LLaDA2.1's published decoding: mask-to-token and token-to-token editing thresholds, block by block",
    traits={"fast_cache": "prefix"}))
