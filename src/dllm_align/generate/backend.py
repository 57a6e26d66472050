"""Generation backends: what turns tokenised prompts into completions, chosen by ``generate.backend``.

Every command that samples (``generate``, ``label`` / ``online``, ``evaluate``'s generation tasks) gets its
:class:`Generator` from :func:`make_generator` and never loads a model for sampling itself. A backend is a
factory registered under a name: ``in_process`` (:mod:`dllm_align.generate.in_process`, the samplers of this
package on a model loaded here) is the built-in one. A new backend (a served engine, say) is one module with a
class that has the :class:`Generator` methods, registered in :data:`BACKENDS` (or with
:func:`register_backend`), and selected by a recipe's ``generate.backend``.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Optional, Protocol, Sequence

from dllm_align.core.errors import UserError
from dllm_align.generate.in_process import InProcessGenerator
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats


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
        when the model cannot be decoded so; called before anything is written."""

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


# A backend's factory: (model section or None, *, device, name_or_path, predictor) -> Generator. ``predictor``
# is a model the caller holds already (the harness scores with it); a backend that does not run the model
# in this process ignores it.
BackendFactory = Callable[..., Generator]

BACKENDS: dict[str, BackendFactory] = {
    "in_process": InProcessGenerator.load,
}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory`` selectable as ``generate.backend: <name>``."""
    BACKENDS[name] = factory


def backend_factory(name: str) -> BackendFactory:
    """The factory registered as ``name``; a ``UserError`` naming the key otherwise (check it before writing)."""
    try:
        return BACKENDS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(BACKENDS), n=1)
        raise UserError(
            f"generate.backend: no generation backend named {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            hint="backends: " + ", ".join(sorted(BACKENDS)),
        ) from None


def make_generator(backend: str, model=None, *, device=None, name_or_path: Optional[str] = None, predictor=None) -> Generator:
    """The one place a generator is made: ``backend`` (``generate.backend``) over the recipe's ``model`` section
    (``name_or_path``: another checkpoint) on ``device``; ``predictor``: a model the caller already holds."""
    return backend_factory(backend)(model, device=device, name_or_path=name_or_path, predictor=predictor)
