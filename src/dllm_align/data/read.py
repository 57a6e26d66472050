"""Reading sources into tables of records: local files (.jsonl/.json/.parquet/.csv/.txt, gzip), folders,
`datasets.save_to_disk` folders, hub ids and the built-in toy data. Every record keeps its file and line.
"""


from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
import socket
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.core.io import note_input
from dllm_align.data import toy
from dllm_align.data.rows import DATA_SUFFIXES, TEXT_SUFFIXES, BadValue, Record, Table

# lazy imports: datasets, pyarrow: slow to import, and only hub data sets and Parquet files need them


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
        if suffixes and suffixes[-1] in TEXT_SUFFIXES:
            return suffixes[-1][1:]
        return None
    if suffixes and suffixes[-1] in DATA_SUFFIXES + (".txt",):
        return suffixes[-1][1:]
    return None


def _decode(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadValue(f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None


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
                raise BadValue(f"malformed JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise BadValue("JSON nested too deeply") from None
            if not isinstance(obj, dict):
                raise BadValue(f"expected a JSON object, got {type(obj).__name__}")
            if "\\ud" in text.lower() and _lone_surrogate(obj):
                raise BadValue("a lone UTF-16 surrogate escape (such as \\ud800) is not text")
            records.append(Record(where, obj))
        except BadValue as e:
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
            bad = [k for k, v in row.items() if isinstance(v, str) and has_surrogates(v)]
            if bad or any(has_surrogates(k) for k in row if k):
                records.append(Record(where, problem=f"not UTF-8 text (in column {bad[0] if bad else '?'})"))
                continue
            records.append(Record(where, {k: v for k, v in row.items() if v is not None}))
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    return records


def has_surrogates(s: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in s)


def _read_txt(path: Path) -> list[Record]:
    records = []
    for i, raw in enumerate(_open_bytes(path).split(b"\n"), start=1):
        where = f"{path}:{i}"
        try:
            text = _decode(raw.rstrip(b"\r"))
        except BadValue as e:
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


def hub_reachable(timeout: float = 3.0) -> bool:
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
    if not offline and not hub_reachable():
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



