"""The in-process generation backend: the model loaded in this process (or one the caller already holds),
decoded by the samplers of this package (:mod:`dllm_align.generate.sampler`, rules by name)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dllm_align.generate.rules import settings_for
from dllm_align.generate.sampler import generate
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats, model_fingerprint
from dllm_align.models.load import load_from_section


class InProcessGenerator:
    """A :class:`dllm_align.generate.backend.Generator` over a loaded ``MaskPredictor``."""

    name = "in_process"

    def __init__(self, mp, folder: Optional[str] = None) -> None:
        self.mp = mp
        self.folder = folder

    @classmethod
    def load(cls, generate=None, settings=None, *, model=None, device=None, name_or_path: Optional[str] = None,
             predictor=None) -> "InProcessGenerator":
        """The recipe's model (``model``: its ``model`` section; ``name_or_path`` another checkpoint) loaded on
        ``device``, or ``predictor`` when the caller holds the model already (it is not loaded twice). It reads
        the ``generate`` section per call (``generate``) and has no settings of its own."""
        if predictor is None:
            predictor = load_from_section(model, device=device or "cpu", name_or_path=name_or_path)
            predictor.model.eval()
        folder = name_or_path if name_or_path is not None else (model.name_or_path if model is not None else None)
        return cls(predictor, folder)

    @property
    def tokenizer(self) -> Any:
        return self.mp.tokenizer

    @property
    def max_positions(self) -> Optional[int]:
        # a composite config (DiffusionGemma's: text and vision) keeps the positions in its text config
        config = self.mp.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)

    def settings_for(self, settings: SamplerSettings) -> SamplerSettings:
        return settings_for(self.mp, settings)

    def serving(self) -> Optional[dict]:
        """The folder it loaded and the sha256 of that folder's checksums.json (None where it has none)."""
        if self.folder is None:
            return None
        return {"folder": str(self.folder), "fingerprint": model_fingerprint(str(self.folder))}

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
        return generate(self.mp, prompts, settings, seeds=seeds, batch_size=batch_size, stop_early=stop_early,
                        stats=stats, on_batch=on_batch)
