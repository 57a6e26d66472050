"""The model-family layer: one module per family, one registry, one lookup.

``family_for_config`` picks the family of a checkpoint from its config.json
(the ``dllm_align_family`` field that dllm-align writes into every folder it
saves, else the ``model_type``); ``family_of`` does the same for a loaded
model. Unknown checkpoints get the LLaDA manners (no logit shift, LLaDA's
sampler), which is what a transformers model with a bidirectional config and
a mask token behaves like.
"""

from __future__ import annotations

from typing import Any, Optional

from dllm_align.models.families.base import Family
from dllm_align.models.families.dream import DREAM
from dllm_align.models.families.llada import LLADA
from dllm_align.models.families.llada_moe import LLADA_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLADA, DREAM, LLADA_MOE)}
# Older folders written by dllm-align name the built-in models' family "tiny": LLaDA's manners.
_ALIASES = {"tiny": "llada"}


def get_family(name: str) -> Family:
    name = _ALIASES.get(name, name)
    if name not in FAMILIES:
        from dllm_align.core.errors import UserError

        raise UserError(f"unknown model family '{name}'", hint=f"known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_for_config(cfg: dict | Any) -> Family:
    """The family of a config (a config.json dict or a transformers config)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    name: Optional[str] = get("dllm_align_family", None)
    if name:
        return get_family(name)
    mt = get("model_type", None)
    for fam in FAMILIES.values():
        if mt in fam.model_types:
            return fam
    return LLADA


def family_of(model) -> Family:
    return family_for_config(getattr(model, "config", None) or {})


def native_family(cfg: dict) -> Optional[Family]:
    """The family whose native loader reads this config.json (None: let transformers load it)."""
    for fam in FAMILIES.values():
        if cfg.get("model_type") in fam.model_types and fam.load_native is not None:
            return fam
    return None


__all__ = ["Family", "FAMILIES", "family_for_config", "family_of", "get_family", "native_family"]
