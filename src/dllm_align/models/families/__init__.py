"""The model-family layer: one module per family, one registry, one lookup.

``family_for_config`` picks the family of a checkpoint from everything its config.json says: the
``dllm_align_family`` field that dllm-align writes into every folder it saves; else the class names
(``architectures`` and the classes ``auto_map`` points at); else the ``model_type``, with ``dllm_align_family`` or each
family's signature fields settling a type two families share (LLaDA-MoE's hub config says
``model_type: llada``, like LLaDA-8B's; the hub's LLaDA2.1 says ``llada2_moe``, like LLaDA2.0's, and
``with_folder_evidence`` reads what its folder ships to say so). A config that two families claim is one error naming what
was read. ``family_of`` does the same for a loaded model. Checkpoints no family claims get the LLaDA
manners (no logit shift, LLaDA's sampler), which is what a transformers model with a bidirectional
config and a mask token behaves like.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from dllm_align.config import components as registry
from dllm_align.core.errors import UserError
from dllm_align.models.families.base import Family

# The declared families (``dllm_align.models.components``, plugins), each record loaded on first use.
FAMILIES: Mapping[str, Family] = registry.Loaded("family")
# The manners of a checkpoint no family claims.
DEFAULT_FAMILY = "llada"
# Older folders written by dllm-align name the built-in models' family "tiny": LLaDA's manners.
_ALIASES = {"tiny": "llada"}


def get_family(name: str) -> Family:
    name = _ALIASES.get(name, name)
    if registry.find("family", name) is None:
        raise UserError(f"unknown model family '{name}'", hint=f"known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _as_dict(cfg: dict | Any) -> dict:
    if isinstance(cfg, dict):
        return cfg
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if callable(to_dict) else {k: v for k, v in vars(cfg).items()} if hasattr(cfg, "__dict__") else {}


def _class_names(cfg: dict) -> set[str]:
    names = {str(a) for a in (cfg.get("architectures") or []) if isinstance(a, str)}
    auto_map = cfg.get("auto_map") or {}
    if isinstance(auto_map, dict):
        for ref in auto_map.values():
            refs = ref if isinstance(ref, (list, tuple)) else [ref]
            names |= {str(r).rsplit(".", 1)[-1] for r in refs if r}
    return names


def matching_families(cfg: dict | Any) -> list[Family]:
    """The families that claim a checkpoint's config, strongest evidence first (class names, then the
    model_type narrowed by each family's signature fields); empty when none does."""
    cfg = _as_dict(cfg)
    names = _class_names(cfg)
    by_class = [f for f in FAMILIES.values() if names & set(f.architectures)]
    if by_class:
        return by_class
    by_type = [f for f in FAMILIES.values() if cfg.get("model_type") in f.model_types]
    if len(by_type) > 1:
        # a type two families share (LLaDA2.0 and the hub's LLaDA2.1): the one dllm_align_family names, if it is one
        named = [f for f in by_type if f.name == cfg.get("dllm_align_family")]
        if named:
            return named
        signed = [f for f in by_type if f.signature and all(k in cfg for k in f.signature)]
        # no signature either: the family whose own name for itself this is (a family's first model_type)
        return signed or [f for f in by_type if f.model_types[0] == cfg.get("model_type")] or by_type
    return by_type


def _what_was_read(cfg: dict) -> str:
    keys = [k for fam in FAMILIES.values() for k in fam.signature if k in cfg]
    return (f"model_type {cfg.get('model_type')!r}, architectures {cfg.get('architectures')!r}, "
            f"auto_map classes {sorted(_class_names(cfg) - set(cfg.get('architectures') or []))!r}"
            + (f", fields {sorted(set(keys))!r}" if keys else ""))


def detect_family(cfg: dict | Any) -> Optional[Family]:
    """The one family that claims this config, None when none does; two is an error naming what was read."""
    cfg = _as_dict(cfg)
    found = matching_families(cfg)
    if len(found) > 1:
        raise UserError(
            f"config.json matches more than one model family ({', '.join(f.name for f in found)}): {_what_was_read(cfg)}",
            hint=f'add "dllm_align_family": "<{"|".join(f.name for f in found)}>" to config.json to say which',
        )
    return found[0] if found else None


def family_for_config(cfg: dict | Any) -> Family:
    """The family of a config (a config.json dict or a transformers config); LLaDA's manners when none claims it."""
    d = _as_dict(cfg)
    name: Optional[str] = d.get("dllm_align_family")
    if name:
        return get_family(name)
    return detect_family(d) or FAMILIES[DEFAULT_FAMILY]


def family_of(model) -> Family:
    return family_for_config(getattr(model, "config", None) or {})


def with_folder_evidence(cfg: dict, folder: Path | str) -> dict:
    """``cfg`` (a folder's config.json) with ``dllm_align_family`` set, in memory, when the folder itself says which
    family it is and the config.json alone does not (``Family.folder_claim``: the hub's LLaDA2.1, whose config.json
    is LLaDA2.0's, by its shipped modeling file). A config that names its family already is returned as it is."""
    if not isinstance(cfg, dict) or cfg.get("dllm_align_family"):
        return cfg
    for fam in FAMILIES.values():
        if fam.folder_claim is not None and cfg.get("model_type") in fam.model_types and fam.folder_claim(Path(folder), cfg):
            return {**cfg, "dllm_align_family": fam.name}
    return cfg


def native_family(cfg: dict) -> Optional[Family]:
    """The family whose native loader reads this config.json (None: let transformers load it)."""
    fam = detect_family(cfg)
    return fam if fam is not None and fam.load_native is not None else None


def describe_config(cfg: dict) -> str:
    """What a config.json says about its family, for error messages."""
    return _what_was_read(_as_dict(cfg))


__all__ = ["Family", "FAMILIES", "describe_config", "detect_family", "family_for_config", "family_of", "get_family",
           "matching_families", "native_family", "with_folder_evidence"]
