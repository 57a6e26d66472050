"""The Monte Carlo ELBO of any model: the likelihoods by name, and the entry points every
command calls (:func:`elbo_draws`, :func:`elbo`).

A model's family names its likelihood (``Family.likelihood``); :data:`LIKELIHOODS` maps that name (declared in
``objective/components.py``) to the component (``objective.likelihood``) that draws the noise and computes the
per-draw terms: ``"masked"``, whole-sequence absorbing-mask diffusion (``objective.masked``), ``"block"``, block
diffusion (``objective.block``), and ``"uniform"``, uniform-noise block diffusion (``objective.uniform``:
DiffusionGemma); ``"hybrid"``, a bound for masked-plus-replaced corruption over blocks (``objective.hybrid``), which
a recipe selects with ``reference.likelihood`` where the family accepts it (LLaDA2.1). A new noise process is one
module and one declaration.

The draws are pure functions of (seed, example id, draw index, L) (``objective.draws``), so policy and
reference share them (common random numbers: the VRPO variance reduction the paper relies on); the names
callers import from here (``DrawConfig``, ``draw_masks``, ``make_noisy_batch``, ``exact_elbo``) live in
``objective.draws`` and ``objective.masked``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Sequence

import torch

from dllm_align.config import components as registry
from dllm_align.core.errors import UserError
from dllm_align.objective.draws import (  # noqa: F401  (the draws' names, where callers import them)
    DrawConfig,
    NoisyBatch,
    draw_masks,
    example_key,
    make_noisy_batch,
    splitmix64,
)
from dllm_align.objective.likelihood import Likelihood
from dllm_align.objective.masked import exact_elbo  # noqa: F401

# Every likelihood by the name a family gives (``Family.likelihood``), each loaded on first use.
LIKELIHOODS: Mapping[str, Likelihood] = registry.Loaded("likelihood")


def get_likelihood(name: str) -> Likelihood:
    """The likelihood declared as ``name``; an unknown name is one error naming the known ones."""
    return registry.load("likelihood", name, key="the model family's likelihood")


def likelihood_for(family, choice: Optional[str]) -> str:
    """The name of the likelihood a run on a model of ``family`` uses: ``choice`` (``reference.likelihood``) where the
    family accepts it (``Family.likelihood_options``), else the family's own; another name is refused by name."""
    if choice is None or choice == family.likelihood:
        return family.likelihood
    if choice not in family.likelihood_options:
        takes = " or ".join((family.likelihood, *family.likelihood_options))
        raise UserError(f"reference.likelihood: {choice!r} does not fit {family.name} models (they take {takes})",
                        hint="leave reference.likelihood out: the family's own likelihood is the default")
    return choice


def likelihood_of(mp, cfg: Optional[DrawConfig] = None) -> Likelihood:
    """The likelihood of a model (``mp.likelihood``: its family's, by name), or the one the draws are for
    (``cfg.likelihood``: the recipe's ``reference.likelihood``, which the run has checked its family accepts)."""
    chosen = None if cfg is None else cfg.likelihood
    return get_likelihood(chosen or mp.likelihood)


def elbo_draws(
    mp,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    completion_mask: torch.Tensor,
    ids: Sequence[str],
    cfg: DrawConfig,
    max_rows_per_forward: Optional[int] = None,
    draws: Optional[Sequence[int]] = None,
    pack_length: Optional[int] = None,
) -> torch.Tensor:
    """Per-draw ELBO values [B, K] (fp32, differentiable through ``mp``) from the model's likelihood, or the
    recipe's choice that ``cfg`` carries (:func:`likelihood_of`; ``Likelihood.draw_terms``).

    The value of draw k of row b is that draw's ELBO term (masked and block diffusion: the draw's weight
    times its sum of log p(y_i | noisy sequence) over the masked positions); the mean over draws is the row's
    ELBO estimate. Policy and reference make the
    same call and get the same draws. Rows are run in forward calls of about ``max_rows_per_forward`` rows of
    T tokens (default: all); ``draws`` selects a subset of the K draw indices (default all), used to split an
    example's draws across forward calls; ``pack_length`` (``data.padding: packed``) packs the noisy
    sequences into rows of that many tokens, each sequence seeing exactly what it sees alone (right-padded
    rows with an ``attention_mask``).
    """
    return likelihood_of(mp, cfg).draw_terms(
        mp, input_ids, attention_mask, completion_mask, ids, cfg,
        max_rows_per_forward=max_rows_per_forward, draws=draws, pack_length=pack_length,
    )


def elbo(
    mp, batch: dict, cfg: DrawConfig, max_rows_per_forward: Optional[int] = None, pack_length: Optional[int] = None
) -> torch.Tensor:
    """B_hat [B]: the mean of the K draws for each row of a collated batch."""
    return elbo_draws(
        mp,
        batch["input_ids"],
        batch.get("attention_mask"),
        batch["completion_mask"],
        batch["ids"],
        cfg,
        max_rows_per_forward,
        pack_length=pack_length,
    ).mean(dim=1)
