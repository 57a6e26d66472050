"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.

Likelihoods (the noise processes and their ELBOs; a model's family names its likelihood) and objectives
(``train.objective``). An objective's ``ignores`` lists the shared ``train`` keys that have no effect on it, so
that setting one away from its default is refused by name instead of silently doing nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dllm_align.config.components import Component, ComponentSettings, register


def _needs_pairs(recipe) -> list[str]:
    # a pairwise objective's units are (chosen, rejected) pairs: unpaired rows can make none
    if recipe.data.format == "unpaired":
        return [f"train.objective {recipe.train.objective!r} needs paired data, but data.format is 'unpaired'"]
    return []


# --------------------------------------------------------------------------- likelihoods
class UniformSettings(ComponentSettings):
    """The uniform-noise likelihood's own settings; recipes write them flat (``reference.time_power``)."""

    time_power: int = Field(2, ge=1, le=8, description="Uniform-noise likelihood (DiffusionGemma): t = u**time_power per canvas, "
                            "weighted by dt/du (1: t uniform, whose estimator has infinite variance).")
    parameterization: Literal["denoiser", "loo"] = Field(
        "denoiser", description="Uniform noise: the softmax enters the bound as it is ('denoiser') or converted to the "
        "leave-one-out posterior ('loo', finite only for a network that is a denoiser).")
    self_conditioning: Literal["none", "detached"] = Field(
        "none", description="Uniform noise: 'none' (zero self-conditioning signal, one pass) or 'detached' (a no-grad "
        "first pass's logits condition the scored pass).")
    surrogate: Literal["elbo", "flat_ce"] = Field(
        "elbo", description="Uniform noise: 'elbo' (the continuous-time bound) or 'flat_ce' (the published SFT loss: "
        "unweighted cross-entropy over the noisy canvas; a surrogate, not a bound).")


class BlockSettings(ComponentSettings):
    """The block likelihood's own settings; recipes write them flat (``reference.replace_share``)."""

    replace_share: float = Field(
        0.0, ge=0, lt=1, description="Block diffusion, SFT only: the share of the completion tokens a draw leaves "
        "unmasked that are replaced by a uniformly drawn token and scored like the masked ones (restore the clean "
        "token): LLaDA2.1's mask-plus-replacement corruption, a training surrogate, not a bound (docs/llada21.md).")


def _replace_needs_sft(recipe) -> list[str]:
    # replaced tokens make the per-draw sum a surrogate: fine for SFT's loss, not for margins compared with a
    # cached reference (whose fingerprint does not record it); the packed layout rebuilds the noisy rows from the
    # clean ones and would drop the replacements
    if recipe.reference.replace_share == 0:
        return []
    if recipe.train.objective != "sft":
        return [f"reference.replace_share: only train.objective 'sft' trains with replaced tokens, "
                f"not {recipe.train.objective!r} (set it to 0)"]
    if recipe.data.padding == "packed":
        return ["reference.replace_share: not with data.padding 'packed' (use 'none' or 'paper')"]
    return []


class HybridSettings(ComponentSettings):
    """The masked-plus-replaced likelihood's own settings (``reference.hybrid.<key>``)."""

    mask_share: float = Field(
        0.5, ge=0, lt=1, description="Masked-plus-replaced bound: the share of corrupted positions that hold the mask; "
        "the rest hold a uniformly drawn real token (LLaDA2.1's report publishes no rate; 0.5 weighs its two "
        "corruptions alike; docs/design.md#a-bound-for-masked-and-replaced-tokens). Below 1: at 1 it is the block ELBO.")


# the absorbing-mask likelihoods have no use for them: set on a masked or block model, refused by name
_UNIFORM_KEYS = tuple(UniformSettings.model_fields)
_BLOCK_KEYS = tuple(BlockSettings.model_fields)

register(Component("likelihood", "masked", "dllm_align.objective.masked:MASKED", ignores=_UNIFORM_KEYS + _BLOCK_KEYS,
                   summary="whole-sequence absorbing-mask diffusion (LLaDA, Dream)"))
register(Component("likelihood", "block", "dllm_align.objective.block:BLOCK", ignores=_UNIFORM_KEYS,
                   settings=BlockSettings, traits={"flat": True}, check=_replace_needs_sft,
                   summary="block diffusion over the family's blocks (SDAR, LLaDA2.x)"))
register(Component("likelihood", "uniform", "dllm_align.objective.uniform:UNIFORM", settings=UniformSettings,
                   ignores=_BLOCK_KEYS, traits={"flat": True},
                   summary="uniform-noise diffusion over canvases (DiffusionGemma)"))
# Selected by reference.likelihood on a family that lists it (Family.likelihood_options); its time draw is its own
# (t = u^2), so the absorbing-mask draws' estimator has no use here.
register(Component("likelihood", "hybrid", "dllm_align.objective.hybrid:HYBRID", settings=HybridSettings,
                   ignores=_UNIFORM_KEYS + _BLOCK_KEYS + ("estimator",),
                   summary="masked-plus-replaced corruption over the family's blocks, a bound (LLaDA2.1, by choice)"))

# --------------------------------------------------------------------------- objectives
register(Component("objective", "elbo_kto", "dllm_align.objective.elbo_kto:ElboKto",
                   ignores=("sft_rows",), summary="ELBO-KTO (the paper): unpaired rows against a reference point"))
register(Component("objective", "sft", "dllm_align.objective.sft:Sft",
                   ignores=("beta", "baseline"), summary="masked-diffusion SFT: the negative ELBO per token"))
register(Component("objective", "vrpo", "dllm_align.objective.vrpo:Vrpo",
                   ignores=("baseline", "sft_rows"), check=_needs_pairs,
                   summary="VRPO (LLaDA 1.5): DPO over ELBOs of (chosen, rejected) pairs"))
