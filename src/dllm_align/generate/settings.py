"""Sampler settings (validated, with the paper's defaults and the fast mode's), the per-block transfer schedule,
per-row seeds, completion records and statistics, and prompt encoding with the chat template.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence


from dllm_align.core.errors import UserError


REMASKING = ("low_confidence", "random")
SAMPLERS = ("auto", "llada", "dream", "block")  # auto: the model family's published rule
CACHES = ("none", "prefix", "dual")
FAST_CACHE = "dual"
FAST_THRESHOLD = 0.9  # Fast-dLLM's default confidence threshold


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SamplerSettings:
    """What decides the tokens. Defaults are the paper's (SPEC.md §7)."""

    gen_length: int = 512
    block_length: int = 32
    steps: int = 512
    remasking: str = "low_confidence"
    temperature: float = 0.0
    cfg: float = 0.0
    cache: str = "none"
    threshold: Optional[float] = None
    seed: int = 0
    # Which rule decodes: "llada" (this module), "dream" (dllm_align.generate.dream), or "auto":
    # the model family's own. The fields below belong to the Dream rule (published defaults).
    sampler: str = "auto"
    alg: str = "origin"
    alg_temp: float = 0.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    eps: float = 1e-3

    @classmethod
    def from_section(cls, section) -> "SamplerSettings":
        """From a recipe's ``generate`` section."""
        return cls(
            gen_length=section.gen_length,
            block_length=section.block_length,
            steps=section.steps,
            remasking=section.remasking,
            temperature=float(section.temperature),
            cfg=float(section.cfg),
            cache=section.cache,
            threshold=section.threshold,
            seed=section.seed,
            sampler=section.sampler,
            alg=section.alg,
            alg_temp=float(section.alg_temp),
            top_p=section.top_p,
            top_k=section.top_k,
            eps=float(section.eps),
        )

    def for_model(self, mp) -> "SamplerSettings":
        """These settings with ``sampler: auto`` resolved to the model family's rule."""
        if self.sampler != "auto":
            return self
        from dataclasses import replace

        return replace(self, sampler=mp.family.sampler)

    def problems(self) -> list[str]:
        out = []
        for name in ("gen_length", "block_length", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                out.append(f"{name} must be a positive integer (got {v!r})")
        if out:
            return out
        out += self._rule_problems()
        if self.sampler == "dream":
            pass  # one canvas: block_length is not used
        elif self.gen_length % self.block_length:
            out.append(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length})")
        elif self.steps % self.num_blocks:
            out.append(f"steps ({self.steps}) must be a multiple of the number of blocks ({self.num_blocks})")
        if self.remasking not in REMASKING:
            out.append(f"remasking must be one of {', '.join(REMASKING)} (got {self.remasking!r})")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            out.append(f"temperature must be >= 0 (got {self.temperature})")
        if not (self.cfg >= 0 and math.isfinite(self.cfg)):
            out.append(f"cfg must be >= 0 (got {self.cfg})")
        if self.cache not in CACHES:
            out.append(f"cache must be one of {', '.join(CACHES)} (got {self.cache!r})")
        if self.threshold is not None and not (0 < self.threshold <= 1):
            out.append(f"threshold must be in (0, 1] (got {self.threshold})")
        return out

    def _rule_problems(self) -> list[str]:
        from dllm_align.generate.dream import ALGS

        out = []
        if self.sampler not in SAMPLERS:
            out.append(f"sampler must be one of {', '.join(SAMPLERS)} (got {self.sampler!r})")
        if self.alg not in ALGS:
            out.append(f"alg must be one of {', '.join(ALGS)} (got {self.alg!r})")
        if not (self.alg_temp >= 0 and math.isfinite(self.alg_temp)):
            out.append(f"alg_temp must be >= 0 (got {self.alg_temp})")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            out.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            out.append(f"top_k must be a positive integer (got {self.top_k!r})")
        if not (0 < self.eps < 1):
            out.append(f"eps must be in (0, 1) (got {self.eps})")
        if self.sampler == "dream":
            if self.cache != "none" or self.threshold is not None:
                out.append("the Dream rule decodes one canvas: cache and threshold apply to the LLaDA sampler "
                           "(generate.sampler: llada)")
            if self.cfg > 0:
                out.append("cfg applies to the LLaDA sampler only (the Dream rule has no guidance)")
        elif self.sampler == "llada" and (self.top_p is not None or self.top_k is not None):
            out.append("top_p / top_k belong to the Dream and block rules (generate.sampler: dream or block)")
        elif self.sampler == "block" and self.cfg > 0:
            out.append("cfg applies to the LLaDA sampler only (the block rule has no guidance)")
        return out

    def check(self) -> None:
        probs = self.problems()
        if probs:
            raise UserError("invalid generation settings: " + "; ".join(probs))

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def exact(self) -> bool:
        return self.cache == "none" and self.threshold is None

    def to_dict(self) -> dict:
        return asdict(self)


def transfer_schedule(n: int, s: int) -> list[int]:
    """Tokens committed at each of the s steps of a block with n masked tokens (SPEC.md §7)."""
    return [n // s + (1 if i < n % s else 0) for i in range(s)]


def row_seed(seed: int, key: str | int) -> int:
    """A prompt's own seed: a hash of the run seed and the prompt id (63 bits)."""
    digest = hashlib.sha256(f"dllm-align/generate/{seed}/{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- results
@dataclass
class Completion:
    """One prompt's result. ``raw`` is the whole generated span (mask ids where never decoded)."""

    ids: list[int]
    text: str
    raw: list[int]
    stopped: bool  # a stop token ended the text (else it ran to gen_length)
    forwards: int  # model calls this row took part in

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"


@dataclass
class SamplerStats:
    """Work done, for throughput figures: positions counts every query position of every forward."""

    forwards: int = 0
    positions: int = 0
    decoded: int = 0  # generated positions committed
    prompts: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, other: "SamplerStats") -> None:
        self.forwards += other.forwards
        self.positions += other.positions
        self.decoded += other.decoded
        self.prompts += other.prompts
        self.seconds += other.seconds


# --------------------------------------------------------------------------- prompts
def encode_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Prompt ids: the chat template with the generation prompt added (SPEC.md §2).

    Rendered to text and encoded without extra special tokens, exactly as
    :mod:`dllm_align.data.tokenize` encodes training prompts, so a prompt decodes
    from the very tokens it was trained behind.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' has no chat template",
            hint="use an instruct model's tokenizer (model.tokenizer in the recipe)",
        )
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first, so memory trouble shows at once).

    Deterministic: ties keep input order. The same batches are formed whatever
    the number of processes, which keeps multi-process output bit-identical.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]



