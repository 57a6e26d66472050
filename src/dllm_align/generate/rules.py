"""Decoding rules by name: what the in-process samplers dispatch on.

A family names its published rule (``Family.sampler``: "llada", "dream", "block", "diffusion_gemma");
``generate.sampler`` picks one by name or leaves it to the family ("auto"). A rule is a component of kind
``rule`` (``dllm_align.config.components``): declared torch-free with the ``generate`` keys it ignores and its
check (the built-in ones in :mod:`dllm_align.generate.components`), its :class:`DecodingRule` living in its own
module (LLaDA's in :mod:`dllm_align.generate.sampler`, Dream's in :mod:`dllm_align.generate.dream`, the block
rule in :mod:`dllm_align.generate.block`, DiffusionGemma's in :mod:`dllm_align.generate.gemma`), imported when
first used (:func:`rule_for`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from dllm_align.config import components
from dllm_align.config.schema import FAST_CACHE, noise_problem, rule_problems
from dllm_align.core.errors import UserError
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats

# lazy imports: dllm_align.models: it loads torch, and the rules are declared and checked by `recipes check`, which stays
# torch-free; only fast_cache reads a model's family

# (mp, prompts, settings, seeds, stats, t0, stop_early) -> one Completion per prompt, in order
DecodeBatch = Callable[
    [object, Sequence[Sequence[int]], SamplerSettings, Sequence[int], Optional[SamplerStats], float, bool], list[Completion]
]


@dataclass(frozen=True)
class DecodingRule:
    """One decoding rule: its name (the value of ``generate.sampler`` / ``Family.sampler``), the function
    that decodes one left-padded batch, and what it needs of the model (raises ``UserError``; None: nothing)."""

    name: str
    decode_batch: DecodeBatch
    check_model: Optional[Callable[[object, SamplerSettings], None]] = None


def whole_sequence_model(mp, settings: SamplerSettings) -> None:
    """The LLaDA and Dream rules decode one canvas of whole-sequence diffusion: a block-diffusion model is
    refused by name, pointing at its family's own rule (``block``, LLaDA2.1's ``llada21``: what ``sampler: auto``
    picks)."""
    b = getattr(mp, "block_size", None)
    if b is not None:
        raise UserError(f"generate.sampler: {settings.sampler}: {mp.family.name} is a block-diffusion model (blocks of {b}); "
                        f"the {settings.sampler} rule decodes whole-sequence diffusion",
                        hint=f"set generate.sampler: {mp.family.sampler} (or auto, the family's own rule)")


def fast_cache(model, sampler: str) -> str:
    """The key/value cache fast decoding fills in (``generate --fast``) for this model section and
    ``generate.sampler``: the rule's own (its ``fast_cache`` trait: the block rule's is ``prefix``, it has no cache
    of the positions after the block), else ``dual`` (the LLaDA sampler's). Read from the model's config.json
    alone, before any weights load; a model that cannot be read gets ``dual`` here and its own error when it
    loads."""
    name = resolved_rule(model, sampler)
    return rule_fast_cache(name) if name != "auto" else FAST_CACHE


def auto_rule(recipe) -> Optional[str]:
    """The decoding rule the recipe's ``sampler: auto`` stands for (its model family's), when its backend decodes
    with the rules (``reads: rule``); else None. ``config.recipe.load_recipe`` checks the rule with it, so that
    the rule's errors name the flags that set the keys."""
    comp = components.find("backend", recipe.generate.backend)
    if recipe.generate.sampler != "auto" or comp is None or "reads" not in comp.traits or comp.traits["reads"] != "rule":
        return None
    return family_rule(recipe.model)


def family_rule(model) -> Optional[str]:
    """The decoding rule of this model section's family, read from the model's config.json alone, before any
    weights load; None for a model that cannot be read (loading it names what is wrong)."""
    from dllm_align.models.families import family_for_config, get_family, with_folder_evidence
    from dllm_align.models.load import BUILTIN_SPECS, resolve_config_file

    try:
        if model.name_or_path in BUILTIN_SPECS:
            return get_family(BUILTIN_SPECS[model.name_or_path].family).sampler
        path = Path(resolve_config_file(model.name_or_path, model.revision))
        cfg = with_folder_evidence(json.loads(path.read_text(encoding="utf-8")), path.parent)
        return family_for_config(cfg).sampler
    except Exception:  # noqa: BLE001 - loading the model names what is wrong with it
        return None


def rule_reads(name: str, key: str) -> bool:
    """Whether decoding rule ``name`` reads the shared ``generate`` key ``key`` (it is not among its ``ignores``):
    fast mode fills in ``threshold`` only for a rule that reads it (LLaDA2.1's has thresholds of its own)."""
    comp = components.find("rule", name)
    return comp is None or key not in comp.ignores


def resolved_rule(model, sampler: str) -> str:
    """``generate.sampler`` with ``auto`` resolved to the family's rule from the model's config.json alone (no
    weights load); ``auto`` itself when the config cannot be read here (loading the model then says why)."""
    if sampler != "auto":
        return sampler
    return family_rule(model) or "auto"


def rule_fast_cache(name: str) -> str:
    """The fast mode's cache for decoding rule ``name`` (the declaration's ``fast_cache`` trait, else dual)."""
    comp = components.find("rule", name)
    return comp.traits["fast_cache"] if comp is not None and "fast_cache" in comp.traits else FAST_CACHE


def rule_for(name: str) -> DecodingRule:
    """The decoding rule registered as ``name`` (its module imported now)."""
    rule = components.load("rule", name, key="generate.sampler")
    if not isinstance(rule, DecodingRule) or rule.name != name:
        raise UserError(f"generate.sampler: the rule {name!r} loads {rule!r}, not a DecodingRule named {name!r}")
    return rule


def refuse_other_noise(mp, name: str) -> None:
    """A rule decodes the noise processes its declaration names (``decodes``): a model trained with another (a
    masked-diffusion rule on DiffusionGemma's uniform noise, whose vocabulary has no mask token) is refused by
    name here, before its first forward, instead of failing inside the rule. Asked after the rule's own
    ``check_model``, whose message for a block-diffusion model names its block size."""
    problem = noise_problem(name, mp.family.name, mp.family.likelihood)
    if problem is not None:
        raise UserError(f"generate.sampler: {problem}",
                        hint=f"set generate.sampler: {mp.family.sampler} (or auto, the family's own rule)")


def settings_for(mp, settings: SamplerSettings) -> SamplerSettings:
    """``settings`` for this model: ``sampler: auto`` resolved to its family's rule and checked for it as a
    recipe naming that rule is (:func:`dllm_align.config.schema.rule_problems`), then the rule's needs of the model
    (the block rule: a block-diffusion model, decoded in its own block length). Callers that write anything check
    with it first, so a refusal leaves nothing behind."""
    settings = SamplerSettings.from_section(settings)
    if settings.sampler == "auto":
        name = mp.family.sampler
        problems = rule_problems(settings, name)
        if problems:
            key, message = problems[0]
            raise UserError(f"generate.{key}: {message}",
                            hint=f"generate.sampler is auto: {mp.family.name} models decode with the {name} rule")
        settings = settings.for_model(mp)
    rule = rule_for(settings.sampler)
    if rule.check_model is not None:
        rule.check_model(mp, settings)
    refuse_other_noise(mp, settings.sampler)
    return settings
