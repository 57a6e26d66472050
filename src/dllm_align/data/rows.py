"""Preference data: reading, layouts, validation, paired -> unpaired, class-imbalance tools.

Implements SPEC.md section 2 (data) and the class-imbalance study of the paper
(section "KTO under class imbalance": subsample one class, set
lambda_D * n_D = lambda_U * n_U).

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

import csv
import gzip
import hashlib
import io
import json
import math
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Sequence
from urllib.parse import urlparse

from dllm_align.core import console
from dllm_align.core.errors import UserError

Messages = list[dict[str, str]]
Format = Literal["auto", "unpaired", "paired"]

# Problems listed in full before "... and N more".
MAX_LISTED = 20
# Records looked at to detect a source's layout.
_DETECT_ROWS = 200
# KTO paper (Ethayarajh et al. 2024, section 4.2): keep
# lambda_D * n_D / (lambda_U * n_U) within this range.
KTO_RATIO_RANGE = (1.0, 4.0 / 3.0)

_TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


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


class _Bad(Exception):
    """A row-level problem (becomes a Problem with the row's location)."""


# --------------------------------------------------------------------------- ids
def content_hash(obj: Any, n: int = 16) -> str:
    """A stable short hash of JSON-able content (row ids for files without an id column)."""
    blob = json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:n]


def _explicit_id(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Bad(f"id must be a string or an integer, got {_show(value)}")
    s = str(value).strip()
    return s or None


def _show(value: Any, n: int = 40) -> str:
    try:
        s = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


# --------------------------------------------------------------------------- reading sources
def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _open_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise UserError(f"{path}: not a readable gzip file ({e})") from None
    return data


def _kind(path: Path) -> Optional[str]:
    """The data format of a file from its name (``x.jsonl.gz`` -> jsonl), or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
        if suffixes and suffixes[-1] in _TEXT_SUFFIXES:
            return suffixes[-1][1:]
        return None
    if suffixes and suffixes[-1] in _DATA_SUFFIXES + (".txt",):
        return suffixes[-1][1:]
    return None


def _decode(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Bad(f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None


def _read_jsonl_bytes(data: bytes, name: str) -> list[Record]:
    records = []
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{name}:{i}"
        try:
            text = _decode(raw)
            if i == 1:
                text = text.lstrip("\ufeff")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise _Bad(f"malformed JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise _Bad("JSON nested too deeply") from None
            if not isinstance(obj, dict):
                raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
            if "\\ud" in text.lower() and _lone_surrogate(obj):
                raise _Bad("a lone UTF-16 surrogate escape (such as \\ud800) is not text")
            records.append(Record(where, obj))
        except _Bad as e:
            records.append(Record(where, problem=str(e)))
    return records


_ROW_KEYS = {"prompt", "completion", "label", "chosen", "rejected", "messages"}


def _read_json(path: Path) -> list[Record]:
    data = _open_bytes(path)
    looks_like_lines = data.lstrip()[:1] == b"{"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if looks_like_lines:  # JSON lines: report the bad bytes per line
            return _read_jsonl_bytes(data, str(path))
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if looks_like_lines and e.msg == "Extra data":
            # Many ".json" files (the hub's included) are really JSON lines.
            return _read_jsonl_bytes(data, str(path))
        raise UserError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply") from None
    if isinstance(obj, dict):
        lists = {k: v for k, v in obj.items() if isinstance(v, list)}
        columnar = (
            lists
            and len(lists) == len(obj)
            and len({len(v) for v in lists.values()}) == 1
            and not all(isinstance(x, dict) for v in lists.values() for x in v[:1])
        )
        if columnar:  # {"prompt": [...], "completion": [...], ...}
            cols = list(lists)
            obj = [dict(zip(cols, vals)) for vals in zip(*lists.values())]
        elif _ROW_KEYS & set(obj):  # a single row
            obj = [obj]
        elif len(lists) == 1:  # {"data": [...]} or {"train": [...]}
            obj = next(iter(lists.values()))
        else:
            raise UserError(
                f"{path}: expected a list of rows (or JSON lines), got an object with keys {', '.join(list(obj)[:6])}"
            )
    if not isinstance(obj, list):
        raise UserError(f"{path}: expected a list of rows (or JSON lines), got {type(obj).__name__}")
    records = []
    check = "\\ud" in text.lower()
    for i, item in enumerate(obj):
        where = f"{path} row {i}"
        if isinstance(item, dict) and check and _lone_surrogate(item):
            records.append(Record(where, problem="a lone UTF-16 surrogate escape (such as \\ud800) is not text"))
        elif isinstance(item, dict):
            records.append(Record(where, item))
        else:
            records.append(Record(where, problem=f"expected an object, got {type(item).__name__}"))
    return records


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:160]})") from None
    return [Record(f"{path} row {i}", r) for i, r in enumerate(rows)]


def _read_csv(path: Path) -> list[Record]:
    # surrogateescape keeps reading past bad bytes so they are reported per row.
    text = _open_bytes(path).decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    records = []
    start = 2  # line 1 is the header
    try:
        for row in reader:
            where = f"{path}:{start}"
            start = reader.line_num + 1
            if None in row:
                records.append(Record(where, problem="more fields than the header has columns"))
                continue
            bad = [k for k, v in row.items() if isinstance(v, str) and _has_surrogates(v)]
            if bad or any(_has_surrogates(k) for k in row if k):
                records.append(Record(where, problem=f"not UTF-8 text (in column {bad[0] if bad else '?'})"))
                continue
            records.append(Record(where, {k: v for k, v in row.items() if v is not None}))
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    return records


def _has_surrogates(s: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in s)


def _read_txt(path: Path) -> list[Record]:
    records = []
    for i, raw in enumerate(_open_bytes(path).split(b"\n"), start=1):
        where = f"{path}:{i}"
        try:
            text = _decode(raw.rstrip(b"\r"))
        except _Bad as e:
            records.append(Record(where, problem=str(e)))
            continue
        if i == 1:
            text = text.lstrip("\ufeff")
        if text.strip():
            records.append(Record(where, {"prompt": text}))
    return records


def _lone_surrogate(obj: Any) -> bool:
    """True when a parsed JSON value holds a lone UTF-16 surrogate (``"\\ud800"``): valid JSON,
    but not text, and it would fail much later when written or tokenised."""
    if isinstance(obj, str):
        return any("\ud800" <= ch <= "\udfff" for ch in obj)
    if isinstance(obj, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_lone_surrogate(v) for v in obj)
    return False


def _read_file(path: Path, kind: str, allow_txt: bool) -> Table:
    from dllm_align.core.io import note_input

    note_input(path, "input data")
    if kind == "txt" and not allow_txt:
        raise UserError(
            f"{path}: a plain text file holds prompts only; training data needs .jsonl, .json, .parquet or .csv"
        )
    if kind == "jsonl":
        return Table(str(path), _read_jsonl_bytes(_open_bytes(path), str(path)))
    if kind == "json":
        return Table(str(path), _read_json(path))
    if kind == "parquet":
        return Table(str(path), _read_parquet(path))
    if kind == "csv":
        return Table(str(path), _read_csv(path), textual=True)
    return Table(str(path), _read_txt(path))


def _dataset_rows(ds, name: str) -> Table:
    rows = ds.to_list()
    return Table(name, [Record(f"{name} row {i}", r) for i, r in enumerate(rows)])


def _pick_split(dsd, split: Optional[str], name: str):
    splits = list(dsd.keys())
    if split is None:
        if len(splits) == 1:
            return dsd[splits[0]], splits[0]
        raise UserError(f"{name} has several splits ({', '.join(splits)}); choose one", hint="pass --split NAME")
    if split not in dsd:
        raise UserError(f"{name} has no split '{split}'", hint=f"splits: {', '.join(splits)}")
    return dsd[split], split


def _read_saved(path: Path, split: Optional[str]) -> Table:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"{path}: not a readable saved dataset ({str(e).splitlines()[0][:160]})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, split, str(path))
        return _dataset_rows(ds, f"{path}[{split}]")
    return _dataset_rows(ds, str(path))


def _files_for_split(folder: Path, split: str) -> list[Path]:
    found = []
    for base in (folder, folder / "data"):
        if not base.is_dir():
            continue
        for p in sorted(base.iterdir()):
            if not p.is_file() or _kind(p) not in ("jsonl", "json", "parquet", "csv"):
                continue
            stem = p.name.split(".")[0]
            if stem == split or stem.startswith((f"{split}-", f"{split}_")):
                found.append(p)
        if found:
            break
    return found


def _read_folder(folder: Path, split: Optional[str], allow_txt: bool) -> list[Table]:
    if any((folder / f).is_file() for f in ("dataset_dict.json", "state.json", "dataset_info.json")):
        return [_read_saved(folder, split)]
    data_files = sorted(p for p in folder.iterdir() if p.is_file() and _kind(p) in ("jsonl", "json", "parquet", "csv"))
    by_stem: dict[str, list[Path]] = {}
    for p in data_files:
        by_stem.setdefault(p.name.split(".")[0], []).append(p)
    if "chosen" in by_stem and "rejected" in by_stem:
        if len(by_stem["chosen"]) > 1 or len(by_stem["rejected"]) > 1:
            raise UserError(f"{folder}: several chosen.* or rejected.* files; keep one of each")
        tables = []
        for role, lab in (("chosen", True), ("rejected", False)):
            p = by_stem[role][0]
            t = _read_file(p, _kind(p), allow_txt=False)
            t.implied_label, t.role = lab, role
            tables.append(t)
        return tables
    if split:
        files = _files_for_split(folder, split)
        if files:
            return [_read_file(p, _kind(p), allow_txt) for p in files]
    if len(data_files) == 1:
        return [_read_file(data_files[0], _kind(data_files[0]), allow_txt)]
    if not data_files:
        raise UserError(f"{folder}: no data files (.jsonl, .json, .parquet, .csv) and not a saved dataset")
    raise UserError(
        f"{folder}: several data files ({', '.join(p.name for p in data_files[:6])}); which split?",
        hint="pass the file itself, or --split NAME to read NAME.jsonl / NAME-*.parquet",
    )


def _looks_like_hub_id(source: str) -> bool:
    if _kind(Path(source)) is not None or source.startswith((".", "/", "~")):
        return False
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source) is not None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint, so an offline machine fails at once rather than after retries."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # the probe would bypass the proxy; let the real request decide
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    u = urlparse(endpoint)
    host = u.hostname or "huggingface.co"
    port = u.port or (443 if u.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _read_hub(name: str, split: Optional[str]) -> Table:
    offline = _env_on("HF_DATASETS_OFFLINE") or _env_on("HF_HUB_OFFLINE")
    if not offline and not _hub_reachable():
        raise UserError(
            f"cannot reach the Hugging Face Hub to load dataset '{name}'",
            hint="check your network; with a cached copy set HF_DATASETS_OFFLINE=1; or pass a local file",
        )
    import datasets

    datasets.utils.logging.set_verbosity_error()
    if not console.progress_enabled():
        datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(name, split=split)
    except ValueError as e:
        msg = str(e).splitlines()[0]
        if "split" in msg.lower():
            raise UserError(f"dataset '{name}' has no split '{split}' ({msg[:200]})", hint="pass --split NAME") from None
        raise UserError(f"could not load dataset '{name}': {msg[:200]}") from None
    except Exception as e:  # ConnectionError, DatasetNotFoundError, hub HTTP errors
        reason = type(e).__name__
        if offline:
            raise UserError(
                f"dataset '{name}' is not in the local cache and HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set",
                hint="unset it to download, or pass a local file",
            ) from None
        if reason in ("DatasetNotFoundError", "RepositoryNotFoundError", "FileNotFoundError"):
            raise UserError(f"no dataset '{name}' on the Hugging Face Hub (or it is gated or private)") from None
        raise UserError(f"could not load dataset '{name}' from the Hugging Face Hub ({reason})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, split, name)
    return _dataset_rows(ds, f"{name}[{split}]")


BUILTIN_DATA = ("builtin:toy-sort",)


def _read_builtin(name: str, split: Optional[str]) -> Table:
    """Data sets built from code (no files, no network): the demo's toy sorting task."""
    if name not in BUILTIN_DATA:
        raise UserError(f"unknown built-in data set '{name}'", hint=f"built-in data sets: {', '.join(BUILTIN_DATA)}")
    from dllm_align.data import toy

    split = split or "train"
    prompts = toy.splits()
    if split not in prompts:
        raise UserError(f"{name}: no split '{split}'", hint="splits: train, test")
    rows = toy.paired_rows(prompts[split], split)
    return Table(f"{name}[{split}]", [Record(f"{name}[{split}] row {i}", r) for i, r in enumerate(rows)])


def read_tables(source: str | Path, split: Optional[str] = None, *, allow_txt: bool = False) -> list[Table]:
    """Read a source (file, folder or hub dataset) into raw tables of records."""
    s = str(source)
    if s.startswith("builtin:"):
        return [_read_builtin(s, split)]
    p = Path(s).expanduser()
    if p.is_file():
        kind = _kind(p)
        if kind is None:
            raise UserError(
                f"{p}: unknown file type '{''.join(p.suffixes) or '(none)'}'",
                hint="use .jsonl, .json, .parquet or .csv" + (" (or .txt for prompts)" if allow_txt else ""),
            )
        return [_read_file(p, kind, allow_txt)]
    if p.is_dir():
        return _read_folder(p, split, allow_txt)
    if _looks_like_hub_id(s):
        return [_read_hub(s, split)]
    raise UserError(f"data not found: {s}", hint="a local file or folder, or a hub dataset id such as trl-lib/kto-mix-14k")


# --------------------------------------------------------------------------- normalising values
def _text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what}: not UTF-8 text") from None
    if isinstance(value, str):
        if _has_surrogates(value):
            raise _Bad(f"{what}: not UTF-8 text")
        return value
    if isinstance(value, list) and all(isinstance(x, dict) and x.get("type") == "text" for x in value):
        # OpenAI-style content parts; only text parts are meaningful here.
        return "".join(_text(x.get("text"), what) for x in value)
    raise _Bad(f"{what} must be text, got {type(value).__name__}")


def _maybe_json_list(value: Any, textual: bool) -> Any:
    # CSV cells hold message lists as JSON text.
    if textual and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
        if isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed):
            return parsed
    return value


def _messages(value: Any, what: str, textual: bool = False) -> tuple[Messages, bool]:
    """Normalise a prompt or conversation; returns (messages, was_a_string)."""
    value = _maybe_json_list(value, textual)
    if isinstance(value, (str, bytes)):
        text = _text(value, what)
        if not text.strip():
            raise _Bad(f"empty {what}")
        return [{"role": "user", "content": text}], True
    if isinstance(value, (list, tuple)):
        if not value:
            raise _Bad(f"empty {what} (no messages)")
        out = []
        for j, m in enumerate(value):
            if not isinstance(m, dict):
                raise _Bad(f"{what}[{j}] must be a message object with 'role' and 'content', got {type(m).__name__}")
            if "role" not in m or "content" not in m:
                missing = "role" if "role" not in m else "content"
                raise _Bad(f"{what}[{j}] has no '{missing}'")
            role = m["role"]
            if not isinstance(role, str) or not role.strip():
                raise _Bad(f"{what}[{j}].role must be a non-empty string, got {_show(role)}")
            content = "" if m["content"] is None else _text(m["content"], f"{what}[{j}].content")
            out.append({"role": role.strip(), "content": content})
        if not any(m["content"].strip() for m in out):
            raise _Bad(f"empty {what} (every message is blank)")
        return out, False
    if value is None:
        raise _Bad(f"empty {what} (null)")
    raise _Bad(f"{what} must be a string or a list of chat messages, got {type(value).__name__}")


def _same_messages(a: Messages, b: Messages) -> bool:
    return len(a) == len(b) and all(
        x["role"] == y["role"] and x["content"].strip() == y["content"].strip() for x, y in zip(a, b)
    )


def _reply(
    value: Any, column: str, prompt: Optional[Messages], prompt_was_str: bool, textual: bool
) -> tuple[str, Optional[Messages]]:
    """A completion (string or message list) -> (reply text, conversation before it or None).

    A message list must end with the assistant's reply. Anything before it is the
    prompt conversation (UltraFeedback's full ``chosen``/``rejected``); it must agree
    with the ``prompt`` column: the same messages, or, for a string prompt, a
    conversation whose last user message is that string.
    """
    value = _maybe_json_list(value, textual)
    if isinstance(value, (str, bytes)) or value is None:
        text = _text(value, column) if value is not None else ""
        if not text.strip():
            raise _Bad(f"empty {column}")
        return text, None
    msgs, _ = _messages(value, column, textual)
    last = msgs[-1]
    if last["role"] != "assistant":
        raise _Bad(f"{column}: the message list has no assistant reply (last message is from '{last['role']}')")
    if not last["content"].strip():
        raise _Bad(f"empty {column} (the assistant reply is blank)")
    before = msgs[:-1]
    if not before:
        return last["content"], None
    if prompt is not None:
        agrees = _same_messages(before, prompt) or (
            prompt_was_str
            and before[-1]["role"] == "user"
            and before[-1]["content"].strip() == prompt[0]["content"].strip()
        )
        if not agrees:
            raise _Bad(f"{column}: the conversation before the reply does not match the prompt column")
    return last["content"], before


def _label(value: Any, textual: bool) -> bool:
    if isinstance(value, bool):
        return value
    if textual and isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise _Bad(f"label must be true or false, got {_show(value)}")


def _prompt_of(data: dict, textual: bool) -> tuple[Optional[Messages], bool]:
    if "prompt" not in data:
        return None, False
    return _messages(data["prompt"], "prompt", textual)


def _check_prompt_turn(prompt: Messages) -> None:
    if prompt[-1]["role"] == "assistant":
        raise _Bad("prompt ends with an assistant message; the completion must answer a user turn")


# --------------------------------------------------------------------------- layouts
def _columns(table: Table) -> set[str]:
    cols: set[str] = set()
    for r in table.records[:_DETECT_ROWS]:
        if r.data is not None:
            cols |= set(r.data)
    return cols


def detect_layout(columns: Iterable[str]) -> Optional[str]:
    """'paired', 'unpaired', 'prompts' or None from a set of column names."""
    c = set(columns)
    if {"chosen", "rejected"} <= c:
        return "paired"
    if "completion" in c:
        return "unpaired"
    if "prompt" in c or "messages" in c:
        return "prompts"
    return None


_REQUIRED = {"paired": ("chosen", "rejected"), "unpaired": ("completion",)}


def _note_layout(tables: list[Table], layouts: list[str], quiet: bool) -> None:
    """Say which layout was read (after validation, so an error stays the first line of output)."""
    if quiet:
        return
    for t, lay in zip(tables, layouts):
        cols = _columns(t)
        shown = ", ".join(c for c in ("prompt", "completion", "label", "chosen", "rejected", "messages", "id", "prompt_id") if c in cols)
        console.info(f"{t.name}: {lay} layout ({shown}), {len(t.records):,} rows")


def _layout(table: Table, fmt: str) -> str:
    cols = _columns(table)
    if not cols:
        if not table.records:
            raise UserError(f"{table.name}: no rows")
        return fmt if fmt != "auto" else "unpaired"
    found = detect_layout(cols)
    if fmt == "auto":
        if found is None:
            raise UserError(
                f"{table.name}: cannot tell the layout from the columns ({', '.join(sorted(cols)[:10])})",
                hint="expected prompt/completion/label (unpaired) or prompt/chosen/rejected (paired)",
            )
        return found
    missing = [c for c in _REQUIRED.get(fmt, ()) if c not in cols]
    if missing:
        raise UserError(
            f"{table.name}: --format {fmt} needs column '{missing[0]}', found {', '.join(sorted(cols)[:10])}",
            hint=f"the columns look {found}: use --format auto" if found else None,
        )
    return fmt


def _parse_unpaired(table: Table, label: Optional[bool], problems: list[Problem], counters: dict) -> list[tuple]:
    out = []
    for rec in table.records:
        if rec.problem:
            problems.append(Problem(rec.where, rec.problem))
            continue
        d = rec.data
        try:
            prompt, was_str = _prompt_of(d, table.textual)
            if "completion" not in d:
                raise _Bad("missing column 'completion'")
            text, before = _reply(d["completion"], "completion", prompt, was_str, table.textual)
            if before is not None:
                prompt = before
            if prompt is None:
                raise _Bad("missing column 'prompt'")
            _check_prompt_turn(prompt)
            if table.implied_label is not None and "label" not in d:
                lab = table.implied_label
            elif "label" in d:
                lab = _label(d["label"], table.textual)
                if label is not None:
                    counters["own_label"] = counters.get("own_label", 0) + 1
            elif label is not None:
                lab = label
            else:
                raise _Bad("missing column 'label' (for a file of one class pass --label true or --label false)")
            rid = _explicit_id(d.get("id"))
            pair_id = _explicit_id(d.get("pair_id"))
            out.append((rec.where, Row(rid or "", prompt, text, lab, pair_id), rid))
        except _Bad as e:
            problems.append(Problem(rec.where, str(e)))
    return out


def _parse_paired(table: Table, problems: list[Problem]) -> list[tuple]:
    out = []
    for rec in table.records:
        if rec.problem:
            problems.append(Problem(rec.where, rec.problem))
            continue
        d = rec.data
        try:
            prompt, was_str = _prompt_of(d, table.textual)
            for col in ("chosen", "rejected"):
                if col not in d:
                    raise _Bad(f"missing column '{col}'")
            chosen, before_c = _reply(d["chosen"], "chosen", prompt, was_str, table.textual)
            rejected, before_r = _reply(d["rejected"], "rejected", prompt, was_str, table.textual)
            if prompt is None:
                if before_c is None or before_r is None:
                    raise _Bad("missing column 'prompt'")
                if not _same_messages(before_c, before_r):
                    raise _Bad("chosen and rejected conversations differ before the reply")
            prompt = before_c or before_r or prompt
            _check_prompt_turn(prompt)
            rid = _explicit_id(d.get("id"))
            # A prompt_id names the prompt, not the pair: several pairs may share it,
            # so it is a soft id (suffixed on repeats) rather than a row id.
            soft = None if rid is not None else _explicit_id(d.get("prompt_id"))
            out.append((rec.where, PairRow(rid or soft or "", prompt, chosen, rejected), rid))
        except _Bad as e:
            problems.append(Problem(rec.where, str(e)))
    return out


def _assign_ids(parsed: list[tuple], problems: list[Problem], hash_of, counters: dict) -> list:
    """Give each row its explicit id, else its soft id (a pair's ``prompt_id``), else a content hash.

    A repeated explicit id is a problem. Rows without one that collide (exact
    copies of a row, pairs sharing a prompt_id) keep the first id and get ``-2``,
    ``-3`` suffixes in file order; the caller warns with the count. Hash ids
    depend on content only, so they are the same whatever the row order.
    """
    seen: dict[str, str] = {}
    out = []
    for where, row, rid in parsed:
        if rid is not None:
            if rid in seen:
                problems.append(Problem(where, f"duplicate id '{rid}' (first at {seen[rid]})"))
                continue
            seen[rid] = where
            out.append(row)
            continue
        base = row.id or hash_of(row)
        new, k = base, 1
        while new in seen:
            k += 1
            new = f"{base}-{k}"
        if k > 1:
            key = "dup_prompt_id" if row.id else "dup_content"
            counters[key] = counters.get(key, 0) + 1
        seen[new] = where
        out.append(_with_id(row, new))
    return out


def _with_id(row, new_id: str):
    from dataclasses import replace

    return replace(row, id=new_id)


def _row_hash(r: Row) -> str:
    return content_hash({"prompt": r.prompt, "completion": r.completion, "label": r.label})


def _pair_hash(p: PairRow) -> str:
    return content_hash({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected})


def _prompt_hash(messages: Messages) -> str:
    return content_hash({"prompt": messages})


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


def _source_name(tables: list[Table], source) -> str:
    return tables[0].name if len(tables) == 1 else str(source)


def _finish_counters(counters: dict, label: Optional[bool]) -> None:
    if counters.get("own_label"):
        console.warn(f"{counters['own_label']:,} rows have their own label column; --label {str(label).lower()} applies only to rows without one")
    if counters.get("dup_prompt_id"):
        console.warn(f"{counters['dup_prompt_id']:,} pairs repeat an earlier pair's prompt_id (kept, ids suffixed -2, -3, ...)")
    if counters.get("dup_content"):
        console.warn(f"{counters['dup_content']:,} rows are exact copies of earlier rows (kept, ids suffixed -2, -3, ...)")


# --------------------------------------------------------------------------- public loaders
def _parse_tables(tables, format: str, label, problems: list, counters: dict, prompts_only: str):
    """Parse every table of a source by its layout: (paired rows, unpaired rows, layouts)."""
    parsed_pairs: list[tuple] = []
    parsed_rows: list[tuple] = []
    layouts = []
    for t in tables:
        lay = _layout(t, format)
        layouts.append(lay)
        if lay == "paired":
            parsed_pairs += _parse_paired(t, problems)
        elif lay == "unpaired":
            parsed_rows += _parse_unpaired(t, label, problems, counters)
        else:
            raise UserError(f"{t.name}: {prompts_only}")
    return parsed_pairs, parsed_rows, layouts


def load_unpaired(
    source: str | Path,
    split: Optional[str] = None,
    format: Format = "auto",
    label: Optional[bool] = None,
    skip_invalid: bool = False,
    *,
    quiet: bool = False,
) -> list[Row]:
    """Read any supported source as unpaired (KTO) rows; paired data is unpaired (chosen -> true).

    ``label`` gives the class of rows that have no ``label`` column (a file of
    one class). A folder of ``chosen.*`` + ``rejected.*`` files is read with labels
    true / false and ids ``ID:chosen`` / ``ID:rejected`` (pair id ``ID`` when the
    other file has the same id and prompt).
    """
    tables = read_tables(source, split)
    if tables[0].role is not None:
        return _unpaired_from_pair_files(tables, skip_invalid, quiet)
    problems: list[Problem] = []
    counters: dict = {}
    parsed_pairs, parsed_rows, layouts = _parse_tables(
        tables, format, label, problems, counters, "holds prompts only (no completion or chosen/rejected columns); training needs completions"
    )
    # Ids are assigned over all files of a source at once (shards may hold copies of each other's rows).
    rows = unpair(_assign_ids(parsed_pairs, problems, _pair_hash, counters))
    rows += _assign_ids(parsed_rows, problems, _row_hash, counters)
    report_problems(problems, _source_name(tables, source), skip_invalid)
    _note_layout(tables, layouts, quiet)
    _finish_counters(counters, label)
    if parsed_pairs and parsed_rows:
        _check_unique([r.id for r in rows], str(source))
    if not rows:
        raise UserError(f"{source}: no valid rows")
    return rows


def _check_unique(ids: list[str], what: str) -> None:
    seen = set()
    for i in ids:
        if i in seen:
            raise UserError(f"{what}: id '{i}' occurs twice, once from paired and once from unpaired rows")
        seen.add(i)


def _pair_file_rows(tables: list[Table], problems: list[Problem]) -> dict[str, list[tuple[str, Row]]]:
    counters: dict = {}
    out = {}
    for t in tables:
        if _columns(t) and "completion" not in _columns(t):
            raise UserError(f"{t.name}: a {t.role} file needs a 'completion' column")
        parsed = _parse_unpaired(t, None, problems, counters)
        good = []
        seen: dict[str, str] = {}
        for where, row, rid in parsed:
            if rid is None:
                problems.append(Problem(where, f"missing column 'id' (needed to match {t.role} rows with their partners)"))
                continue
            if rid in seen:
                problems.append(Problem(where, f"duplicate id '{rid}' (first at {seen[rid]})"))
                continue
            seen[rid] = where
            good.append((where, row))
        out[t.role] = good
    return out


def _unpaired_from_pair_files(tables: list[Table], skip_invalid: bool, quiet: bool) -> list[Row]:
    problems: list[Problem] = []
    by_role = _pair_file_rows(tables, problems)
    report_problems(problems, f"{Path(tables[0].name).parent}", skip_invalid)
    rejected = {r.id: r for _, r in by_role["rejected"]}
    rows = []
    n_pairs = 0
    used: set[str] = set()
    # Interleaved like unpair(): a chosen row, then its rejected partner, so that
    # taking the first N rows (data.limit) keeps both classes.
    for _, c in by_role["chosen"]:
        o = rejected.get(c.id)
        paired = o is not None and _same_messages(o.prompt, c.prompt)
        rows.append(Row(f"{c.id}:chosen", c.prompt, c.completion, True, c.id if paired else None))
        if o is not None:
            n_pairs += paired
            used.add(c.id)
            rows.append(Row(f"{o.id}:rejected", o.prompt, o.completion, False, o.id if paired else None))
    for _, r in by_role["rejected"]:
        if r.id not in used:
            rows.append(Row(f"{r.id}:rejected", r.prompt, r.completion, False, None))
    if not quiet:
        console.info(
            f"{Path(tables[0].name).parent}: chosen + rejected files, {len(by_role['chosen']):,} + "
            f"{len(by_role['rejected']):,} rows ({n_pairs:,} pairs share an id and prompt)"
        )
    return rows


def _pairs_from_pair_files(tables: list[Table], skip_invalid: bool, quiet: bool) -> list[PairRow]:
    problems: list[Problem] = []
    by_role = _pair_file_rows(tables, problems)
    rej = {r.id: (w, r) for w, r in by_role["rejected"]}
    chosen_ids = {r.id for _, r in by_role["chosen"]}
    pairs = []
    for where, c in by_role["chosen"]:
        if c.id not in rej:
            problems.append(Problem(where, f"id '{c.id}' has no rejected partner"))
            continue
        rw, r = rej[c.id]
        if not _same_messages(c.prompt, r.prompt):
            problems.append(Problem(where, f"id '{c.id}': prompt differs from the rejected row's ({rw})"))
            continue
        pairs.append(PairRow(c.id, c.prompt, c.completion, r.completion))
    for where, r in by_role["rejected"]:
        if r.id not in chosen_ids:
            problems.append(Problem(where, f"id '{r.id}' has no chosen partner"))
    report_problems(problems, f"{Path(tables[0].name).parent}", skip_invalid)
    if not quiet:
        console.info(f"{Path(tables[0].name).parent}: chosen + rejected files joined on id, {len(pairs):,} pairs")
    return pairs


def load_paired(
    source: str | Path,
    split: Optional[str] = None,
    format: Format = "auto",
    skip_invalid: bool = False,
    *,
    quiet: bool = False,
) -> list[PairRow]:
    """Read preference pairs (for VRPO).

    Paired layouts are read directly; a folder of ``chosen.*`` + ``rejected.*``
    files is joined on id; unpaired rows are re-paired by their ``pair_id`` (the
    output of ``dllm-align convert``): each pair id needs one desirable and one
    undesirable row with the same prompt.
    """
    tables = read_tables(source, split)
    if tables[0].role is not None:
        return _pairs_from_pair_files(tables, skip_invalid, quiet)
    problems: list[Problem] = []
    counters: dict = {}
    parsed_pairs, parsed_rows, layouts = _parse_tables(
        tables, format, None, problems, counters, "holds prompts only; pairs need chosen and rejected completions"
    )
    pairs = _assign_ids(parsed_pairs, problems, _pair_hash, counters)
    if parsed_rows:
        pairs += _repair(parsed_rows, _source_name(tables, source), problems)
    report_problems(problems, _source_name(tables, source), skip_invalid)
    _note_layout(tables, layouts, quiet)
    _finish_counters(counters, None)
    if parsed_pairs and parsed_rows:
        _check_unique([p.id for p in pairs], str(source))
    if not pairs:
        raise UserError(f"{source}: no valid pairs")
    return pairs


def _repair(parsed: list[tuple], name: str, problems: list[Problem]) -> list[PairRow]:
    groups: dict[str, list[tuple[str, Row]]] = {}
    loose = 0
    for where, row, _ in parsed:
        if row.pair_id is None:
            loose += 1
            continue
        groups.setdefault(row.pair_id, []).append((where, row))
    if loose and not groups:
        raise UserError(
            f"{name}: unpaired rows without pair ids cannot be used as pairs",
            hint="VRPO needs paired data (prompt/chosen/rejected); train.objective elbo_kto takes unpaired rows",
        )
    if loose:
        console.warn(f"{name}: {loose:,} rows have no pair_id and are left out of the pairs")
    pairs = []
    for pid, members in groups.items():
        good = [r for _, r in members if r.label]
        bad = [r for _, r in members if not r.label]
        where = members[0][0]
        if len(good) != 1 or len(bad) != 1:
            problems.append(Problem(where, f"pair_id '{pid}' has {len(good)} desirable and {len(bad)} undesirable rows (need 1 and 1)"))
            continue
        if not _same_messages(good[0].prompt, bad[0].prompt):
            problems.append(Problem(where, f"pair_id '{pid}': the two rows have different prompts"))
            continue
        pairs.append(PairRow(pid, good[0].prompt, good[0].completion, bad[0].completion))
    return pairs


def load_prompts(
    source: str | Path,
    split: Optional[str] = None,
    limit: Optional[int] = None,
    *,
    skip_invalid: bool = False,
    quiet: bool = False,
) -> list[PromptRow]:
    """Distinct prompts of any layout, or of a ``.txt`` file with one prompt per line.

    Ids: a ``prompt_id`` column; else a pair's id (paired data, converted rows'
    ``pair_id``); else the row's ``id`` when no prompt repeats; else a hash of
    the prompt. Unpaired rows sharing a prompt give that prompt once. ``limit``
    keeps the first N prompts in file order.
    """
    tables = read_tables(source, split, allow_txt=True)
    if tables[0].role is not None:
        pairs = _pairs_from_pair_files(tables, skip_invalid, quiet)
        return _limit([PromptRow(p.id, p.prompt) for p in pairs], limit)
    problems: list[Problem] = []
    out: list[PromptRow] = []
    layouts = []
    for t in tables:
        lay = "prompts" if t.name.endswith((".txt", ".txt.gz")) else _layout(t, "auto")
        layouts.append(lay)
        out.extend(_prompts_of_table(t, lay, problems))
    report_problems(problems, _source_name(tables, source), skip_invalid)
    _note_layout(tables, layouts, quiet)
    # Distinct ids: identical prompts collapse, a reused id for another prompt is a problem.
    seen: dict[str, PromptRow] = {}
    unique = []
    clashes = []
    for p in out:
        if p.id in seen:
            if not _same_messages(seen[p.id].messages, p.messages):
                clashes.append(p.id)
            continue
        seen[p.id] = p
        unique.append(p)
    if clashes:
        raise UserError(f"{_source_name(tables, source)}: id '{clashes[0]}' is used for different prompts ({len(clashes)} ids)")
    if not unique:
        raise UserError(f"{source}: no prompts")
    return _limit(unique, limit)


def _limit(rows: list, limit: Optional[int]) -> list:
    return rows if limit is None else rows[:limit]


def _prompts_of_table(t: Table, lay: str, problems: list[Problem]) -> list[PromptRow]:
    counters: dict = {}
    if lay == "paired":
        # Pairs sharing a prompt give it once (load_prompts drops same-id, same-prompt repeats).
        return [PromptRow(rid or p.id or _prompt_hash(p.prompt), p.prompt) for _, p, rid in _parse_paired(t, problems)]
    if lay == "unpaired":
        parsed = _parse_unpaired(t, False, problems, counters)
        pids = {}
        for rec in t.records:
            if rec.data is not None and "prompt_id" in rec.data:
                try:
                    pids[rec.where] = _explicit_id(rec.data["prompt_id"])
                except _Bad:
                    pass
        keys = [json.dumps(r.prompt, sort_keys=True) for _, r, _ in parsed]
        repeats = len(set(keys)) < len(keys)
        out = []
        for (where, row, rid), _k in zip(parsed, keys):
            pid = pids.get(where) or row.pair_id or (rid if not repeats else None) or _prompt_hash(row.prompt)
            out.append(PromptRow(pid, row.prompt))
        return out
    out = []
    for rec in t.records:
        if rec.problem:
            problems.append(Problem(rec.where, rec.problem))
            continue
        d = rec.data
        try:
            if "prompt" in d:
                msgs, _ = _messages(d["prompt"], "prompt", t.textual)
            elif "messages" in d:
                msgs, _ = _messages(d["messages"], "messages", t.textual)
                while msgs and msgs[-1]["role"] == "assistant":
                    msgs = msgs[:-1]
                if not msgs:
                    raise _Bad("messages: no user turn before the assistant reply")
            else:
                raise _Bad("missing column 'prompt'")
            _check_prompt_turn(msgs)
            pid = _explicit_id(d.get("prompt_id")) or _explicit_id(d.get("id")) or _prompt_hash(msgs)
            out.append(PromptRow(pid, msgs))
        except _Bad as e:
            problems.append(Problem(rec.where, str(e)))
    return out


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


def class_counts(rows: Iterable[Row]) -> tuple[int, int]:
    """(n_desirable, n_undesirable)."""
    n_d = n_u = 0
    for r in rows:
        if r.label:
            n_d += 1
        else:
            n_u += 1
    return n_d, n_u


def _keep_count(n: int, ratio: float) -> int:
    if ratio >= 1 or n == 0:
        return n
    # Round half up; keep at least one row of a class that had some.
    return max(1, math.floor(ratio * n + 0.5))


def subsample(rows: Sequence[Row], desirable_ratio: float = 1.0, undesirable_ratio: float = 1.0, seed: int = 0) -> list[Row]:
    """Keep ``round(ratio * n)`` rows of each class (the paper's class-imbalance study).

    Which rows stay is a pure function of (seed, row id): rows are ranked by
    ``sha256(seed:id)`` and the lowest ranks are kept. So the choice does not
    depend on the file order, and with one seed a smaller ratio keeps a subset
    of what a larger ratio keeps. The kept rows are returned in their input order.
    """
    for name, r in (("desirable_ratio", desirable_ratio), ("undesirable_ratio", undesirable_ratio)):
        if not (0 < r <= 1):
            raise UserError(f"{name} must be in (0, 1], got {r}")
    keep: set[str] = set()
    for lab, ratio in ((True, desirable_ratio), (False, undesirable_ratio)):
        cls = [r for r in rows if r.label == lab]
        k = _keep_count(len(cls), ratio)
        ranked = sorted(cls, key=lambda r: hashlib.sha256(f"{seed}:{r.id}".encode("utf-8")).hexdigest())
        keep.update(r.id for r in ranked[:k])
    return [r for r in rows if r.id in keep]


def balance_weights(rows: Iterable[Row]) -> tuple[float, float]:
    """(lambda_D, lambda_U) with lambda_D * n_D = lambda_U * n_U, the larger class weighted 1.

    This is the weighting of the paper's class-imbalance study (section "KTO under
    class imbalance"). Normalisation: the class with more rows keeps weight 1 and
    the rarer class gets n_larger / n_smaller (>= 1), so the common class trains
    exactly as with default weights.
    """
    n_d, n_u = class_counts(rows)
    if n_d == 0 or n_u == 0:
        missing = "desirable" if n_d == 0 else "undesirable"
        raise UserError(f"cannot balance class weights: there are no {missing} rows")
    if n_d >= n_u:
        return 1.0, n_d / n_u
    return n_u / n_d, 1.0


def weight_ratio(n_d: int, n_u: int, lambda_d: float, lambda_u: float) -> float:
    """lambda_D * n_D / (lambda_U * n_U), the quantity the KTO paper keeps in [1, 4/3]."""
    if n_u == 0 or lambda_u == 0:
        return math.inf
    return lambda_d * n_d / (lambda_u * n_u)


def check_weight_ratio(n_d: int, n_u: int, lambda_d: float, lambda_u: float, *, warn: bool = True, chosen: bool = False) -> bool:
    """True when the class weights sit in KTO's recommended range; warns (stderr) otherwise.

    ``chosen``: the weights were set on purpose (recipe keys or a weights file), so
    the ratio is reported as information rather than as a warning.
    """
    q = weight_ratio(n_d, n_u, lambda_d, lambda_u)
    lo, hi = KTO_RATIO_RANGE
    ok = lo - 1e-9 <= q <= hi + 1e-9
    what = f"lambda_D*n_D / (lambda_U*n_U) = {lambda_d:g}*{n_d} / ({lambda_u:g}*{n_u}) = {q:.3g}"
    if not ok and warn and chosen:
        console.info(f"class weights: {what}, as the recipe chose (the KTO paper's range is [1, 4/3])")
    elif not ok and warn:
        console.warn(f"{what}, outside the KTO paper's recommended [1, 4/3] (convert --balance-weights gives 1)")
    return ok


def weights_path_for(output: str | Path) -> Path:
    """The sidecar written by ``convert --balance-weights``: ``OUT.jsonl`` -> ``OUT.weights.json``."""
    p = Path(output)
    name = p.name
    for suf in (".jsonl", ".parquet", ".json"):
        if name.endswith(suf):
            name = name[: -len(suf)]
            break
    return p.with_name(name + ".weights.json")


def read_weights_file(path: str | Path) -> tuple[float, float]:
    """(lambda_desirable, lambda_undesirable) from a ``convert --balance-weights`` sidecar."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"weights file not found: {p}", hint="write it with `dllm-align convert ... --balance-weights`")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: not a valid JSON weights file ({e})") from None
    out = []
    for key in ("lambda_desirable", "lambda_undesirable"):
        v = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
            raise UserError(f"{p}: '{key}' must be a positive number, got {_show(v)}")
        out.append(float(v))
    return out[0], out[1]


# --------------------------------------------------------------------------- the recipe's data section
def rows_from_section(section, split: Literal["train", "test"] = "train", *, quiet: bool = False) -> list[Row]:
    """The unpaired training rows a recipe's ``data`` section describes.

    Reads ``train`` (or ``test``) with ``format`` and ``label``, keeps the first
    ``limit`` rows, then applies ``desirable_ratio`` / ``undesirable_ratio`` with
    ``seed`` (:func:`subsample`).
    """
    source = section.train if split == "train" else section.test
    if source is None:
        raise UserError(f"data.{split} is not set", hint=f"set data.{split} in the recipe or with --set data.{split}=PATH")
    rows = load_unpaired(
        source,
        split=section.train_split if split == "train" else section.test_split,
        format=section.format,
        label=section.label,
        quiet=quiet,
    )
    if section.limit is not None:
        rows = rows[: section.limit]
    if section.desirable_ratio < 1 or section.undesirable_ratio < 1:
        before = class_counts(rows)
        rows = subsample(rows, section.desirable_ratio, section.undesirable_ratio, section.seed)
        after = class_counts(rows)
        if not quiet:
            console.info(
                f"subsampled (seed {section.seed}): desirable {before[0]:,} -> {after[0]:,}, "
                f"undesirable {before[1]:,} -> {after[1]:,}"
            )
    return rows


# --------------------------------------------------------------------------- writing
def write_rows(rows: Sequence[Row], output: str | Path) -> Path:
    """Write rows atomically as JSONL, or Parquet when the name ends in ``.parquet``."""
    from dllm_align.core.io import atomic_path, atomic_write_bytes

    out = Path(output)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(
            [{"id": r.id, "prompt": r.prompt, "completion": r.completion, "label": r.label, "pair_id": r.pair_id} for r in rows],
            schema=pa.schema(
                [
                    ("id", pa.string()),
                    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                    ("completion", pa.string()),
                    ("label", pa.bool_()),
                    ("pair_id", pa.string()),
                ]
            ),
        )
        with atomic_path(out, suffix=".parquet") as tmp:
            pq.write_table(table, tmp)
    elif out.suffix == ".jsonl":
        buf = io.BytesIO()
        for r in rows:
            buf.write((json.dumps(r.to_dict(), ensure_ascii=False) + "\n").encode("utf-8"))
        atomic_write_bytes(out, buf.getvalue())
    else:
        raise UserError(f"{out}: output must end in .jsonl or .parquet")
    return out


# --------------------------------------------------------------------------- convert
@dataclass
class ConvertSummary:
    rows_in: int
    n_desirable: int
    n_undesirable: int
    output: Path
    weights: Optional[tuple[float, float]] = None
    weights_file: Optional[Path] = None


def convert(
    source: str | Path,
    output: str | Path,
    *,
    split: Optional[str] = None,
    format: Format = "auto",
    label: Optional[bool] = None,
    skip_invalid: bool = False,
    desirable_ratio: float = 1.0,
    undesirable_ratio: float = 1.0,
    seed: int = 0,
    balance: bool = False,
    limit: Optional[int] = None,
) -> ConvertSummary:
    """``dllm-align convert``: any layout -> validated unpaired rows, optionally subsampled and weighted.

    Nothing is written unless every step succeeds; the data file and the weights
    sidecar (:func:`weights_path_for`) are each written atomically.
    """
    out = Path(output)
    if out.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"{out}: output must end in .jsonl or .parquet")
    from dllm_align.core.io import check_not_input, note_input

    src = Path(str(source)).expanduser()
    if src.is_file():  # refused before reading; files found inside a folder are guarded as they are read
        note_input(src, "input data")
    check_not_input(out)
    check_not_input(weights_path_for(out))
    for name, r in (("--desirable-ratio", desirable_ratio), ("--undesirable-ratio", undesirable_ratio)):
        if not (0 < r <= 1):
            raise UserError(f"{name} must be in (0, 1], got {r}")
    rows = load_unpaired(source, split=split, format=format, label=label, skip_invalid=skip_invalid)
    n_in = len(rows)
    if limit is not None:
        rows = rows[:limit]
    n_d0, n_u0 = class_counts(rows)
    if desirable_ratio < 1 or undesirable_ratio < 1:
        rows = subsample(rows, desirable_ratio, undesirable_ratio, seed)
    n_d, n_u = class_counts(rows)
    if (n_d, n_u) != (n_d0, n_u0):
        console.info(
            f"subsampled with seed {seed}: desirable {n_d0:,} -> {n_d:,} (ratio {desirable_ratio:g}), "
            f"undesirable {n_u0:,} -> {n_u:,} (ratio {undesirable_ratio:g})"
        )
    weights = balance_weights(rows) if balance else None
    write_rows(rows, out)
    console.info(f"wrote {out}: {len(rows):,} rows ({n_d:,} desirable, {n_u:,} undesirable)")
    wfile = None
    if weights is not None:
        from dllm_align.core.io import atomic_write_json

        wfile = weights_path_for(out)
        atomic_write_json(
            wfile,
            {
                "lambda_desirable": weights[0],
                "lambda_undesirable": weights[1],
                "n_desirable": n_d,
                "n_undesirable": n_u,
                "rule": "lambda_desirable * n_desirable = lambda_undesirable * n_undesirable; the larger class has weight 1",
                "data": out.name,
                "desirable_ratio": desirable_ratio,
                "undesirable_ratio": undesirable_ratio,
                "seed": seed,
            },
        )
        console.info(
            f"wrote {wfile}: lambda_desirable {weights[0]:.6g}, lambda_undesirable {weights[1]:.6g} "
            f"(set data.weights_file: {wfile})"
        )
    elif n_d and n_u:
        check_weight_ratio(n_d, n_u, 1.0, 1.0)
    return ConvertSummary(n_in, n_d, n_u, out, weights, wfile)


# --------------------------------------------------------------------------- stats
def _percentiles(values: Sequence[int]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    a = np.asarray(values)
    out = {"min": int(a.min())}
    for q in (50, 90, 95, 99):
        out[f"p{q}"] = int(np.percentile(a, q, method="nearest"))
    out["max"] = int(a.max())
    out["mean"] = round(float(a.mean()), 1)
    return out


def dataset_stats(
    rows: Sequence[Row],
    tokenizer,
    data_section,
    batch_size: int,
    global_batch_size: Optional[int] = None,
    seed: int = 0,
) -> dict:
    """Counts, token-length percentiles and the tokens each padding choice feeds (``data stats``).

    Lengths are reported before truncation (what the data holds) and the padding
    costs after it (what training would see with ``data_section``).
    """
    from types import SimpleNamespace

    from dllm_align.data.batching import padding_costs
    from dllm_align.data.tokenize import fit, tokenize_with_report

    raw, _ = tokenize_with_report(
        rows, tokenizer, SimpleNamespace(
            max_length=1 << 62, max_prompt_length=None, truncation="completion",
            end_of_turn=getattr(data_section, "end_of_turn", "scored"),
        )
    )
    bos = tokenizer.bos_token_id
    fitted = []
    dropped = prompt_cut = completion_cut = 0
    for e in raw:
        f = fit(e.prompt_ids, [e.completion_ids], data_section.max_length, data_section.max_prompt_length, data_section.truncation, bos)
        if f is None:
            dropped += 1
            continue
        prompt_cut += f[2]
        completion_cut += f[3][0]
        fitted.append(len(f[0]) + len(f[1][0]))
    n_d, n_u = class_counts(rows)
    costs = padding_costs(fitted, data_section.max_length, batch_size, global_batch_size, seed) if fitted else {}
    return {
        "rows": len(rows),
        "desirable": n_d,
        "undesirable": n_u,
        "pairs": len({r.pair_id for r in rows if r.pair_id is not None}),
        "distinct_prompts": len({json.dumps(r.prompt, sort_keys=True) for r in rows}),
        "tokens": {
            "prompt": _percentiles([len(e.prompt_ids) for e in raw]),
            "completion": _percentiles([len(e.completion_ids) for e in raw]),
            "total": _percentiles([e.length for e in raw]),
        },
        "max_length": data_section.max_length,
        "max_prompt_length": data_section.max_prompt_length,
        "truncation": data_section.truncation,
        "over_max_length": sum(e.length > data_section.max_length for e in raw),
        "prompt_cut": prompt_cut,
        "completion_cut": completion_cut,
        "dropped": dropped,
        "rows_kept": len(fitted),
        "batch_size": batch_size,
        "global_batch_size": global_batch_size or batch_size,
        "seed": seed,
        "tokens_fed": costs,
    }
