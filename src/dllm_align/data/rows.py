"""Preference rows: the normalised row types, their ids, and problem reports.

The user-facing description of the layouts is docs/data.md. The other modules of this package read
sources (`read`), parse layouts (`layouts`), load rows (`load`), convert and write (`convert`), handle
class imbalance (`imbalance`: the paper's study, docs/design.md#class-weights) and describe data sets
(`stats`).

Sources
    A local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file (``.gz`` for the
    text formats), a folder written by ``datasets.save_to_disk``, a folder of data
    files (``{split}.jsonl``, ``data/{split}-*.parquet``, ...), a folder holding
    ``chosen.*`` and ``rejected.*`` files that share ids (the layout of the shared
    kto-mix-14k test rows), or a hub dataset id (``trl-lib/kto-mix-14k``) read with
    ``datasets.load_dataset``. :func:`load_prompts` also reads plain ``.txt`` files,
    one prompt per line.

Layouts (detected per source with ``format="auto"``, reported on stderr)
    * unpaired (KTO): ``prompt``, ``completion``, ``label``;
    * paired: ``prompt``, ``chosen``, ``rejected``;
    * prompts only: ``prompt`` (or a ``messages`` conversation) - for generation.
    Prompts are strings or chat-message lists; completions are strings or
    message lists whose last message is the assistant reply. When the list also
    holds the conversation before the reply (UltraFeedback's ``chosen`` /
    ``rejected``), that conversation is the prompt, and it must agree with the
    ``prompt`` column.

Normalised rows
    :class:`Row` (unpaired), :class:`PairRow`, :class:`PromptRow`. The prompt is
    always a list of ``{"role", "content"}`` messages (a string prompt becomes one
    user message) and a completion is a string. A row's ``id`` is its own ``id``
    column (paired rows: ``id`` or ``prompt_id``), else a content hash, so the same
    row gets the same id whatever the file order (the ELBO mask seed derives from
    it). Unpairing a pair ``P`` gives rows ``P:chosen`` and ``P:rejected`` with
    ``pair_id = P``.

Validation
    Every bad row is reported with its file and line (or row index) and the
    reason. By default any problem stops the load with a :class:`UserError`
    listing them; ``skip_invalid=True`` skips those rows and lists them as a
    warning. Nothing is dropped silently.
"""


from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Literal, Optional, Sequence

from dllm_align.core import console
from dllm_align.core.errors import UserError


Messages = list[dict[str, str]]
Format = Literal["auto", "unpaired", "paired"]

# Problems listed in full before "... and N more".
MAX_LISTED = 20
# Records looked at to detect a source's layout.
DETECT_ROWS = 200
# KTO paper (Ethayarajh et al. 2024, section 4.2): keep
# lambda_D * n_D / (lambda_U * n_U) within this range.
KTO_RATIO_RANGE = (1.0, 4.0 / 3.0)

TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


# --------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    """One unpaired (KTO) example: prompt messages, completion text, desirable or not."""

    id: str
    prompt: Messages
    completion: str
    label: bool
    pair_id: Optional[str] = None

    def to_dict(self) -> dict:
        d = {"id": self.id, "prompt": self.prompt, "completion": self.completion, "label": self.label}
        if self.pair_id is not None:
            d["pair_id"] = self.pair_id
        return d


@dataclass(frozen=True)
class PairRow:
    """One preference pair: a prompt with a chosen and a rejected completion."""

    id: str
    prompt: Messages
    chosen: str
    rejected: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PromptRow:
    """One prompt for generation or evaluation."""

    id: str
    messages: Messages


@dataclass
class Problem:
    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass
class Record:
    """One raw row of a source: its location and either its columns or why it could not be read."""

    where: str
    data: Optional[dict] = None
    problem: Optional[str] = None


@dataclass
class Table:
    """The records of one file (or dataset split) of a source."""

    name: str
    records: list[Record]
    textual: bool = False  # CSV: every value is a string (labels "true", messages as JSON text)
    implied_label: Optional[bool] = None  # chosen.* / rejected.* of a pair of files
    role: Optional[str] = None  # "chosen" / "rejected" for a pair of files


class BadValue(Exception):
    """A row-level problem (becomes a Problem with the row's location)."""


# --------------------------------------------------------------------------- ids
def content_hash(obj: Any, n: int = 16) -> str:
    """A stable short hash of JSON-able content (row ids for files without an id column)."""
    blob = json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:n]


def explicit_id(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadValue(f"id must be a string or an integer, got {show_value(value)}")
    s = str(value).strip()
    return s or None


def show_value(value: Any, n: int = 40) -> str:
    try:
        s = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."




def _where_key(where: str) -> tuple:
    m = re.match(r"^(.*?)(?::| row )(\d+)$", where)
    return (m.group(1), int(m.group(2))) if m else (where, -1)


def report_problems(problems: Sequence[Problem], what: str, skip_invalid: bool, consequence: str = "") -> None:
    """Stop with every problem listed (UserError, exit 2), or warn and list them when skipping.

    The first line names the count and the first problem, so it reads alone.
    """
    if not problems:
        return
    problems = sorted(problems, key=lambda p: _where_key(p.where))
    n = len(problems)
    listed = [str(p) for p in problems[:MAX_LISTED]]
    if n > MAX_LISTED:
        listed.append(f"... and {n - MAX_LISTED} more")
    plural = "s" if n > 1 else ""
    if skip_invalid:
        console.warn(f"skipped {n} invalid row{plural} of {what}:")
        for line in listed:
            console.info(f"  {line}")
        return
    head = f"{n} invalid row{plural} in {what}{consequence}: {problems[0]}"
    body = "" if n == 1 else "\n  " + "\n  ".join(listed)
    raise UserError(head + body, hint="fix the rows, or pass --skip-invalid to skip them (each one is listed)")



# --------------------------------------------------------------------------- paired -> unpaired, imbalance
def unpair(pairs: Iterable[PairRow]) -> list[Row]:
    """Each pair -> a desirable row ``ID:chosen`` and an undesirable row ``ID:rejected``, pair id ``ID``.

    The paper's conversion of UltraFeedback-Binary (section "Datasets"): chosen
    responses are desirable, rejected responses undesirable, same prompt.
    """
    rows = []
    for p in pairs:
        rows.append(Row(f"{p.id}:chosen", p.prompt, p.chosen, True, p.id))
        rows.append(Row(f"{p.id}:rejected", p.prompt, p.rejected, False, p.id))
    return rows



