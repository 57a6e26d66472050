"""Sampler settings (validated, with the paper's defaults and the fast mode's), the per-block transfer schedule,
per-row seeds, completion records and statistics, and prompt encoding with the chat template.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from pydantic import ConfigDict, ValidationError

from dllm_align.config.schema import GenerateSection
from dllm_align.config import components
from dllm_align.core.errors import UserError

# Keys of the generate section that say how a run is organised, not which tokens a prompt gets.
RUN_KEYS = frozenset({"backend", "batch_size", "split", "limit"})
# Keys a named rule never reads (not recorded for it: a record names what decided the tokens).
UNUSED_BY_RULE = {"block": frozenset({"remasking"})}


def unused_by_rule(sampler: str) -> frozenset:
    """The keys decoding rule ``sampler`` never reads: those it leaves to their defaults (its declaration's
    ``ignores``, DiffusionGemma's temperature among them) and :data:`UNUSED_BY_RULE`; none for ``auto``."""
    comp = components.find("rule", sampler) if sampler != "auto" else None
    return UNUSED_BY_RULE.get(sampler, frozenset()) | frozenset(comp.ignores if comp is not None else ())


# --------------------------------------------------------------------------- settings
class SamplerSettings(GenerateSection):
    """The recipe's ``generate`` section as the samplers read it: the same fields, defaults and checks
    (:class:`dllm_align.config.schema.GenerateSection`), frozen, plus the quantities a sampler derives from them.

    Built from keywords (``SamplerSettings(gen_length=64, ...)``, refused in one line naming every problem) or
    from a section (:meth:`from_section`)."""

    model_config = ConfigDict(frozen=True)

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise UserError("invalid generation settings: " + "; ".join(_problems(e))) from None

    @classmethod
    def from_section(cls, section: GenerateSection) -> "SamplerSettings":
        """From a recipe's ``generate`` section (already checked: the values are taken as they are)."""
        return section if isinstance(section, cls) else cls(**section.model_dump())

    def replace(self, **changes) -> "SamplerSettings":
        """These settings with ``changes``, checked again."""
        return type(self)(**{**self.model_dump(), **changes})

    def for_model(self, mp) -> "SamplerSettings":
        """These settings with ``sampler: auto`` resolved to the model family's rule (and checked for that rule)."""
        return self if self.sampler != "auto" else self.replace(sampler=mp.family.sampler)

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
        """The settings that decide the tokens (what a run records beside its outputs); with ``sampler: auto``
        every key, since the rule is the model's."""
        return self.model_dump(exclude=RUN_KEYS | unused_by_rule(self.sampler))


def _problems(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        msg = str(e["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in e["loc"])
        got = f" (got {e['input']!r})" if loc else ""
        out.append(f"{loc}: {msg}{got}" if loc else msg)
    return out


def transfer_schedule(n: int, s: int) -> list[int]:
    """Tokens committed at each of the s steps of a block with n masked tokens (docs/design.md#the-llada-rule)."""
    return [n // s + (1 if i < n % s else 0) for i in range(s)]


def row_seed(seed: int, key: str | int) -> int:
    """A prompt's own seed: a hash of the run seed and the prompt id (63 bits)."""
    digest = hashlib.sha256(f"dllm-align/generate/{seed}/{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- models
def model_fingerprint(name: str) -> Optional[str]:
    """The sha256 of a model folder's checksums.json (what dllm-align writes into checkpoints and
    final/), so a retrained model behind the same path is told apart; None elsewhere."""
    p = Path(name) / "checksums.json"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    except OSError:
        return None


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
    """Prompt ids: the chat template with the generation prompt added (docs/design.md#tokens-padding-and-packing).

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



