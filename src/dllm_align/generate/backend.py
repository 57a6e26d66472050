"""Generation backends: what turns tokenised prompts into completions, chosen by ``generate.backend``.

Every command that samples (``generate``, ``label`` / ``online``, ``evaluate``'s generation tasks) gets its
:class:`Generator` from :func:`make_generator` and never loads a model for sampling itself. A backend is a
component of kind ``backend`` (:mod:`dllm_align.config.components`): a declaration names its factory
(``target``, imported on first use), its own settings (``generate.<name>.<key>`` in a recipe) and its traits,
which say without loading it

- ``serves``: how a new model reaches it: ``load`` (the factory loads the folder it is given, as the in-process
  backend does), ``reload`` (the factory tells a running server to load the folder's weights) or ``fixed``
  (it serves one model and cannot change it: ``online``, which samples each round's new policy, refuses it);
- ``reads``: the keys of the ``generate`` section that decide its tokens (``"rule"``: every key the decoding
  rule reads); records and resume checks hold these and nothing else;
- ``loads_here``: it loads the weights in this process, at ``model.dtype`` (then the dtype is recorded);
- ``records`` (optional): the keys of its own settings that decide its tokens (the others, say a server's
  address, are left out of records, so a rerun against the same server elsewhere resumes).

``in_process`` (:mod:`dllm_align.generate.in_process`, the samplers of this package on a model loaded here) is
declared in :mod:`dllm_align.generate.components`. Torch-free: ``recipes check`` and every command's first
checks read the declarations only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

from pydantic import BaseModel

from dllm_align.config import components as registry
from dllm_align.core.errors import UserError
from dllm_align.generate.settings import RUN_KEYS, Completion, SamplerSettings, SamplerStats

KEY = "generate.backend"
# How a new model reaches a backend (its ``serves`` trait), and whether each round's new folder can.
SERVES = {
    "load": "loads the folder it is given",
    "reload": "tells its server to load the folder's weights",
    "fixed": "serves one model and cannot change it",
}


class Generator(Protocol):
    """A generation backend.

    ``generate`` returns one :class:`~dllm_align.generate.settings.Completion` per prompt, in input order
    (``text``: the completion before the first stop token; ``ids``: its token ids; ``raw``: the whole generated
    span). A prompt's result is a pure function of its ids, the settings and its seed; ``on_batch(indices,
    completions)`` is called as each batch finishes."""

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the prompts are encoded with (chat template included)."""

    @property
    def max_positions(self) -> Optional[int]:
        """How many positions the model has (prompt + gen_length beyond it is refused); None: unknown."""

    def settings_for(self, settings: SamplerSettings) -> SamplerSettings:
        """``settings`` as this backend will decode them (``sampler: auto`` resolved), refused (``UserError``)
        when the model cannot be decoded so; called (by :func:`make_generator`) before anything is written."""

    def serving(self) -> Optional[dict]:
        """The model it serves, for records: ``{"folder": ..., "fingerprint": ...}`` (either None where
        unknown), or None when it cannot tell."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        settings: SamplerSettings,
        seeds: Optional[Sequence[int]] = None,
        *,
        batch_size: int = 8,
        stop_early: bool = True,
        stats: Optional[SamplerStats] = None,
        on_batch: Optional[Callable[[list[int], list[Completion]], None]] = None,
    ) -> list[Completion]:
        ...


GENERATOR_METHODS = ("tokenizer", "max_positions", "settings_for", "serving", "generate")

# A backend's factory: (generate section, the backend's own settings, *, model, device, name_or_path,
# predictor) -> Generator. ``model``: the recipe's model section (None where the caller names only
# ``name_or_path``); ``name_or_path``: the checkpoint to serve instead of the model section's; ``predictor``: a
# model the caller holds already (the harness scores with it), which a backend that does not run the model in
# this process ignores.
BackendFactory = Callable[..., Generator]


def backend_component(name: Any) -> registry.Component:
    """The declaration of backend ``name``; a ``UserError`` naming ``generate.backend`` otherwise."""
    return registry.get("backend", name, key=KEY)


def backend_factory(name: str) -> BackendFactory:
    """The factory of backend ``name`` (its module imported now)."""
    return backend_component(name).load()


def _trait(comp: registry.Component, key: str) -> Any:
    return comp.traits[key] if key in comp.traits else None


def serves(name: str, own: Optional[BaseModel] = None) -> Optional[str]:
    """How a new model reaches backend ``name`` (a key of :data:`SERVES`; None when it does not say). A backend
    whose answer depends on its own settings (a client of several engines) declares a function of them, asked
    with ``own`` (None when the caller has none: then it does not say)."""
    how = _trait(backend_component(name), "serves")
    return how(own) if callable(how) else how


def loads_here(name: str) -> bool:
    """Whether backend ``name`` loads the weights in this process (so ``model.dtype`` applies to it)."""
    return bool(_trait(backend_component(name), "loads_here"))


def check_serves_each_round(name: str, what: str = "online", own: Optional[BaseModel] = None) -> None:
    """Refuse a backend that cannot be handed a freshly trained folder (``online`` samples each round's policy:
    a backend that keeps serving another model would measure the wrong one); ``own``: its settings."""
    how = serves(name, own)
    if how in ("load", "reload"):
        return
    reason = SERVES[how] if how in SERVES else f"declares no way to serve a new model (traits['serves'] is {how!r})"
    raise UserError(
        f"{KEY}: the backend {name!r} {reason}; {what} samples each round's freshly trained policy",
        hint="use a backend that can load each round's folder (e.g. in_process), or one told to reload its weights",
    )


def recorded_settings(settings: SamplerSettings) -> dict:
    """The generation settings a record holds for ``settings.backend``: the keys that decide its tokens
    (its ``reads`` trait; every key of the rule for ``"rule"``) and its own settings, nothing it does not use."""
    comp = backend_component(settings.backend)
    reads = _trait(comp, "reads")
    full = settings.to_dict()
    if reads is None or reads == "rule":
        return _own_recorded(comp, full, settings, "python")
    out = {k: full[k] for k in reads if k in full}
    if comp.has_settings():
        out[comp.name] = settings.own_settings(comp.name).model_dump()
    return _own_recorded(comp, out, settings, "python")


def _own_recorded(comp: registry.Component, out: dict, section, mode: str) -> dict:
    """``out`` with the backend's own settings cut to its ``records`` trait (the own keys that decide tokens:
    a server's address or its timeouts do not, and a run resumes against the same server on another port)."""
    keep = _trait(comp, "records")
    if keep is None or not comp.has_settings():
        return out
    own = section.own_settings(comp.name).model_dump(mode=mode)
    return {**out, comp.name: {k: own[k] for k in keep}}


def run_record(generate) -> dict:
    """The ``generate`` section as a run's record holds it (what a rerun is compared against): every key for a
    backend that reads the rule's keys; else the keys it reads, the keys that organise the run, its own settings."""
    comp = backend_component(generate.backend)
    reads = _trait(comp, "reads")
    full = generate.model_dump(mode="json")
    if reads is None or reads == "rule":
        return _own_recorded(comp, full, generate, "json")
    keep = set(reads) | RUN_KEYS | ({comp.name} if comp.has_settings() else set())
    out = {k: v for k, v in full.items() if k in keep}
    if comp.has_settings() and comp.name not in out:
        out[comp.name] = generate.own_settings(comp.name).model_dump(mode="json")
    return _own_recorded(comp, out, generate, "json")


def make_generator(generate, model=None, *, device=None, name_or_path: Optional[str] = None, predictor=None) -> Generator:
    """The one place a generator is made: the backend ``generate.backend`` names, given the ``generate`` section
    and its own settings (``generate.<backend>``), over the recipe's ``model`` section (``name_or_path``:
    another checkpoint) on ``device``; ``predictor``: a model the caller already holds. The section's settings
    are checked against the model it serves (``settings_for``) before it is returned: every caller gets the
    same refusal before anything is written."""
    comp = backend_component(generate.backend)
    own: BaseModel = generate.own_settings(comp.name)
    gen = comp.load()(generate, own, model=model, device=device, name_or_path=name_or_path, predictor=predictor)
    missing = [m for m in GENERATOR_METHODS if not hasattr(type(gen), m) and not hasattr(gen, m)]
    if missing:
        raise UserError(f"{KEY}: the backend {comp.name!r} ({comp.target}) made a generator without "
                        f"{', '.join(missing)}", hint="a backend's generator has the methods of generate.backend.Generator")
    gen.settings_for(SamplerSettings.from_section(generate))
    return gen


__all__ = ["BackendFactory", "Generator", "KEY", "SERVES", "backend_component", "backend_factory",
           "check_serves_each_round", "loads_here", "make_generator", "recorded_settings", "run_record", "serves"]
