"""Components by kind and name: the one registration pattern for every kind of extension (model families,
likelihoods, objectives, generation backends, decoding rules, verifiers).

A component is *declared*, not imported: a :class:`Component` names its kind, its name, the object that
implements it (``target``, ``"package.module:attribute"``, imported on first :meth:`Component.load`), its own
settings (a pydantic model: defaults, ranges and descriptions; a recipe sets them under
``<section>.<name>``, e.g. ``train.ipo.tau``), the keys of its section it has no use for (``ignores``: refused
when set away from their defaults while it is selected) and its checks against the rest of the recipe
(``check(recipe) -> list of problems``). Declarations import nothing heavy, so ``recipes check`` validates
every component name and setting without importing torch; the implementation loads when a command first uses
it.

Where declarations live:

- the built-in ones in one torch-free ``components.py`` per package that implements a kind
  (:data:`BUILTIN_CATALOGS`); this module imports them by name on the first lookup, because they sit above
  ``config/`` in the pipeline and register themselves here;
- a user's in a module named in the environment variable ``DLLM_ALIGN_PLUGINS`` (comma-separated importable
  module names), imported on the first lookup like the built-in catalogs.

A built-in component may keep settings that recipes already write flat (``traits={"flat": True}``: the uniform
likelihood's ``reference.time_power``): the schema then makes them fields of the section (:func:`flat_fields`).

``register`` refuses a name its section already uses (a field or another component), so a component's settings
key never shadows a recipe key.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict

from dllm_align.core.errors import UserError
from dllm_align.core.usercode import load_module


class NoSettings(BaseModel):
    """The settings of a component that has none of its own."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ComponentSettings(BaseModel):
    """Base of a component's own settings: unknown keys and non-finite floats are refused, as in every section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Kind:
    """A kind of component: the recipe section its settings live in and the key that selects one (None:
    selected by something other than a recipe key, e.g. a family by the checkpoint's config.json)."""

    name: str
    section: str
    selector: Optional[str]
    doc: str
    # what a component's ``check`` receives: the whole recipe ("recipe", returning problem lines) or only its
    # section ("section", returning (key, message) pairs: a decoding rule, whose settings reach the samplers
    # without the recipe)
    check_on: str = "recipe"
    # a command flag may select the component for one run instead of the selector (label --rule): the section
    # cannot tell which one's settings are unused, so the command asks once it knows (online.verifiers.get_rule)
    selected_at_run: bool = False


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("family", "model", None, "model families (chosen by the checkpoint's config.json)"),
        Kind("likelihood", "reference", "likelihood", "noise processes and their ELBOs (the model family's, or "
             "reference.likelihood: another the family accepts)"),
        Kind("objective", "train", "objective", "training objectives (train.objective)"),
        Kind("backend", "generate", "backend", "generation backends (generate.backend)"),
        Kind("rule", "generate", "sampler", "decoding rules of the in-process generator (generate.sampler)",
             check_on="section"),
        Kind("verifier", "online", "rule", "verifiers of label / online (online.rule, --rule)", selected_at_run=True),
    )
}


@dataclass(frozen=True)
class Component:
    """One component's declaration (see the module docstring)."""

    kind: str
    name: str
    target: str
    settings: type[BaseModel] = NoSettings
    ignores: tuple[str, ...] = ()
    check: Optional[Callable[[Any], list[str]]] = None
    summary: str = ""
    # free-form facts other layers read without loading the target (e.g. a backend's ``serves``)
    traits: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        """The implementing object (imported now, cached by Python's module cache)."""
        module, _, attr = self.target.partition(":")
        where = f"{KINDS[self.kind].section}.{self.name}"
        obj = load_module(module, f"{where}: the {self.kind} {self.name!r}")
        try:
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
        except AttributeError as e:
            raise UserError(f"{where}: the {self.kind} {self.name!r} cannot be loaded from {self.target} ({e})") from None
        return obj

    def has_settings(self) -> bool:
        return bool(self.settings.model_fields)


# The torch-free declaration modules of the built-in components, imported on the first lookup.
BUILTIN_CATALOGS = (
    "dllm_align.models.components",
    "dllm_align.objective.components",
    "dllm_align.generate.components",
    "dllm_align.online.components",
)
PLUGINS_ENV = "DLLM_ALIGN_PLUGINS"

_REGISTRY: dict[str, dict[str, Component]] = {k: {} for k in KINDS}
_loaded: set[str] = set()
# field names of each section, filled by the schema (a component's name must not shadow one)
_SECTION_FIELDS: dict[str, frozenset[str]] = {}


def note_section_fields(section: str, names) -> None:
    _SECTION_FIELDS[section] = frozenset(names)


def _load_catalogs() -> None:
    mods = list(BUILTIN_CATALOGS) + [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    for mod in mods:
        if mod in _loaded:
            continue
        _loaded.add(mod)
        builtin = mod in BUILTIN_CATALOGS
        try:
            # a plugin is the user's code, named in their own environment (not by a recipe someone may hand them):
            # imported under usercode's bounds (prints, exits, hangs, exceptions contained), without a notice
            load_module(mod, "a built-in catalog" if builtin else PLUGINS_ENV)
        except BaseException:
            _loaded.discard(mod)
            raise


def register(component: Component) -> Component:
    """Declare ``component``; the same declaration again is a no-op, another under a taken name an error."""
    if component.kind not in KINDS:
        raise ValueError(f"unknown kind of component {component.kind!r} (kinds: {', '.join(KINDS)})")
    section = KINDS[component.kind].section
    if component.name in _SECTION_FIELDS.get(section, ()):
        raise ValueError(f"a {component.kind} cannot be named {component.name!r}: {section}.{component.name} is a recipe key")
    for kind, table in _REGISTRY.items():
        other = table.get(component.name)
        if other is None or KINDS[kind].section != section:
            continue
        if other == component:
            return component
        raise ValueError(f"{section}.{component.name}: a {kind} named {component.name!r} is registered already "
                         f"({other.target})")
    _REGISTRY[component.kind][component.name] = component
    return component


def redeclare(component: Component) -> Component:
    """Put ``component`` in place of the declaration of its kind and name (in the same place of the listing order,
    which lookups that walk a kind follow): a process's extra facts about a built-in one (a larger built-in model)."""
    _load_catalogs()
    if component.name not in _REGISTRY[component.kind]:
        raise ValueError(f"no {component.kind} named {component.name!r} is declared to redeclare")
    _REGISTRY[component.kind][component.name] = component
    return component


def unregister(kind: str, name: str) -> None:
    """Remove a declaration (tests that add a toy component take it away again)."""
    _REGISTRY[kind].pop(name, None)


def components(kind: str) -> dict[str, Component]:
    """Every declared component of ``kind``, by name (built-in catalogs and plugins loaded)."""
    _load_catalogs()
    return dict(_REGISTRY[kind])


def names(kind: str) -> list[str]:
    return sorted(components(kind))


def find(kind: str, name: str) -> Optional[Component]:
    _load_catalogs()
    return _REGISTRY[kind].get(name)


def unknown_message(kind: str, name: Any, *, key: Optional[str] = None) -> str:
    """One line for a name no component of ``kind`` has: the key, the name (shortened), a close match, the known."""
    known = names(kind)
    shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:60] + "...'"
    close = difflib.get_close_matches(str(name), known, n=1) if isinstance(name, str) and len(name) < 200 else []
    where = key or f"{KINDS[kind].section}.{KINDS[kind].selector or kind}"
    return (f"{where}: no {kind} named {shown}" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; known: {', '.join(known)}")


def get(kind: str, name: str, *, key: Optional[str] = None) -> Component:
    """The declaration of ``name``; a ``UserError`` naming the key and the known names otherwise."""
    found = find(kind, name) if isinstance(name, str) else None
    if found is None:
        raise UserError(unknown_message(kind, name, key=key))
    return found


def load(kind: str, name: str, *, key: Optional[str] = None) -> Any:
    """The implementation of component ``name`` of ``kind`` (its module imported now)."""
    return get(kind, name, key=key).load()


def flat_fields(section: str, catalog: str) -> dict[str, tuple]:
    """The settings of the built-in components of ``section`` declared ``traits={"flat": True}``, as pydantic
    field definitions for the section itself: settings that keep the flat spelling recipes already use
    (``reference.time_power``, the uniform likelihood's) instead of ``<section>.<name>.<key>``. Built-in
    catalogs only, and only ``catalog`` (the one declaring them) is imported: the schema reads this when it is
    imported, before any plugin may be, and another catalog may import the schema."""
    if catalog not in BUILTIN_CATALOGS:
        raise ValueError(f"{catalog!r} is not a built-in catalog")
    if catalog not in _loaded:
        _loaded.add(catalog)
        load_module(catalog, "a built-in catalog")
    out: dict[str, tuple] = {}
    for kind, table in _REGISTRY.items():
        for comp in table.values():
            if KINDS[kind].section == section and comp.traits.get("flat"):
                out.update({k: (f.annotation, f) for k, f in comp.settings.model_fields.items()})
    return out


class Loaded(Mapping):
    """The implementations of every declared component of one kind, by name, in declaration order: a live,
    read-only view (a component registered later appears; each loads on first access), for the lookups that
    walk every component of a kind (which family claims a config.json)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __getitem__(self, name: str) -> Any:
        comp = find(self.kind, name) if isinstance(name, str) else None
        if comp is None:
            raise KeyError(name)
        return comp.load()

    def __iter__(self):
        return iter(components(self.kind))

    def __len__(self) -> int:
        return len(components(self.kind))

    def __repr__(self) -> str:
        return f"Loaded({self.kind!r}: {', '.join(components(self.kind))})"


def section_components(section: str) -> list[Component]:
    """Every component whose settings live in ``section`` (for the schema's validation of ``<section>.<name>``)."""
    _load_catalogs()
    return [c for kind, table in _REGISTRY.items() if KINDS[kind].section == section for c in table.values()]


__all__ = ["BUILTIN_CATALOGS", "Component", "ComponentSettings", "KINDS", "Kind", "Loaded", "NoSettings", "PLUGINS_ENV",
           "components", "find", "flat_fields", "get", "load", "names", "note_section_fields", "redeclare", "register", "section_components",
           "unknown_message", "unregister"]
