"""Decoding rules by name: the registry the in-process samplers dispatch on.

A family names its published rule (``Family.sampler``: "llada", "dream", "block"); ``generate.sampler``
picks one by name or leaves it to the family ("auto"). Each rule module registers a :class:`DecodingRule`
with :func:`register_rule` (LLaDA's in :mod:`dllm_align.generate.sampler`, Dream's in
:mod:`dllm_align.generate.dream`, the block rule in :mod:`dllm_align.generate.block`); the settings a
rule has no use for are refused by the recipe schema (``GenerateSection``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dllm_align.core.errors import UserError
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats

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


RULES: dict[str, DecodingRule] = {}


def register_rule(rule: DecodingRule) -> DecodingRule:
    RULES[rule.name] = rule
    return rule


def whole_sequence_model(mp, settings: SamplerSettings) -> None:
    """The LLaDA and Dream rules decode one canvas of whole-sequence diffusion: a block-diffusion model is
    refused by name (its own rule is ``block``, which ``sampler: auto`` picks)."""
    b = getattr(mp, "block_size", None)
    if b is not None:
        raise UserError(f"generate.sampler: {settings.sampler}: {mp.family.name} is a block-diffusion model (blocks of {b}); "
                        f"the {settings.sampler} rule decodes whole-sequence diffusion",
                        hint="set generate.sampler: block (or auto, the family's own rule)")


def fast_cache(model, sampler: str) -> str:
    """The key/value cache fast decoding fills in (``generate --fast``) for this model section and
    ``generate.sampler``: the block rule's is ``prefix`` (it has no cache of the positions after the block),
    the LLaDA sampler's ``dual``. Read from the model's config.json alone, before any weights load; a model
    that cannot be read gets ``dual`` here and its own error when it loads."""
    import json
    from pathlib import Path

    from dllm_align.config.schema import FAST_CACHE

    name = sampler
    if name == "auto":
        try:
            from dllm_align.models.families import family_for_config, get_family
            from dllm_align.models.load import BUILTIN_SPECS, resolve_config_file

            if model.name_or_path in BUILTIN_SPECS:
                name = get_family(BUILTIN_SPECS[model.name_or_path].family).sampler
            else:
                cfg = json.loads(Path(resolve_config_file(model.name_or_path, model.revision)).read_text(encoding="utf-8"))
                name = family_for_config(cfg).sampler
        except Exception:  # noqa: BLE001 - loading the model names what is wrong with it
            name = "auto"
    return "prefix" if name == "block" else FAST_CACHE


def rule_for(name: str) -> DecodingRule:
    try:
        return RULES[name]
    except KeyError:
        raise UserError(f"generate.sampler: no decoding rule named {name!r}", hint="rules: " + ", ".join(sorted(RULES))) from None


def settings_for(mp, settings: SamplerSettings) -> SamplerSettings:
    """``settings`` for this model: ``sampler: auto`` resolved to its family's rule, then checked, the rule's
    needs of the model included (the block rule: a block-diffusion model, decoded in its own block length).
    Callers that write anything check with it first, so a refusal leaves nothing behind."""
    settings = SamplerSettings.from_section(settings).for_model(mp)
    rule = rule_for(settings.sampler)
    if rule.check_model is not None:
        rule.check_model(mp, settings)
    return settings
