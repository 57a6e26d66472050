"""The public kto-mix-14k test split, as the tests and benchmarks read it.

1,500 rows (MIT licence): every prompt once with a desirable and once with an
undesirable completion. The tests and benchmarks want it as two files that share
ids, ``chosen.jsonl`` and ``rejected.jsonl`` (a paired set and an unpaired set at
once). Where it comes from, first found first:

1. ``$DLLM_ALIGN_KTO_MIX_TEST``, a folder holding those two files;
2. ``../shared/data/kto-mix-14k-test`` beside the checkout (this project's CI);
3. a copy made earlier in ``$DLLM_ALIGN_CACHE`` (default ``~/.cache/dllm-align``);
4. the hub through ``datasets`` (``trl-lib/kto-mix-14k``, split ``test``, cached by
   ``datasets`` as usual), paired by prompt and written to 3.

When none works, :class:`Unavailable` carries a one-line reason (tests skip with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from dllm_align.core.io import atomic_write_text
from dllm_align.data.read import hub_reachable

# lazy imports: datasets: slow to import, and only a download from the hub needs it

HUB_ID = "trl-lib/kto-mix-14k"
SPLIT = "test"
FOLDER = "kto-mix-14k-test"
FILES = ("chosen.jsonl", "rejected.jsonl")


class Unavailable(Exception):
    """The split could not be found or fetched; ``str()`` is a one-line reason."""


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in FILES)


def cache_folder() -> Path:
    root = os.environ.get("DLLM_ALIGN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dllm-align")
    return Path(root) / FOLDER


def pair_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Unpaired rows (prompt, completion, label) -> (chosen, rejected) rows sharing ids 1, 2, ...

    Rows are grouped by prompt in order of first appearance; the k-th desirable and
    k-th undesirable completion of a prompt form a pair. Unmatched rows are left out.
    """
    groups: dict[str, dict] = {}
    for r in rows:
        key = json.dumps(r["prompt"], sort_keys=True, ensure_ascii=False)
        g = groups.setdefault(key, {"prompt": r["prompt"], True: [], False: []})
        g[bool(r["label"])].append(r["completion"])
    chosen, rejected = [], []
    for g in groups.values():
        for good, bad in zip(g[True], g[False]):
            i = len(chosen) + 1
            chosen.append({"id": i, "prompt": g["prompt"], "completion": good})
            rejected.append({"id": i, "prompt": g["prompt"], "completion": bad})
    return chosen, rejected


def _write(folder: Path, chosen: list[dict], rejected: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(FILES, (chosen, rejected)):
        atomic_write_text(folder / name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def fetch(folder: Optional[Path] = None) -> Path:
    """Load the split through ``datasets`` (its cache first) and write the two files."""
    folder = folder or cache_folder()

    import datasets

    offline = bool(getattr(datasets.config, "HF_DATASETS_OFFLINE", False) or getattr(datasets.config, "HF_HUB_OFFLINE", False))
    if not offline and not hub_reachable():
        raise Unavailable(f"{HUB_ID} ({SPLIT}) not cached and the hub is unreachable")
    try:
        ds = datasets.load_dataset(HUB_ID, split=SPLIT)
    except Exception as e:  # offline without a cached copy, or the hub failed
        raise Unavailable(f"{HUB_ID} ({SPLIT}) could not be loaded: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}") from None
    chosen, rejected = pair_rows(ds.to_list())
    if not chosen:
        raise Unavailable(f"{HUB_ID} ({SPLIT}) holds no prompt with both a desirable and an undesirable completion")
    _write(folder, chosen, rejected)
    return folder


def kto_mix_test(repo: Optional[Path] = None, allow_download: bool = True, timeout: float = 300.0) -> Path:
    """The folder with ``chosen.jsonl`` and ``rejected.jsonl``; raises :class:`Unavailable`.

    The hub is tried in a child process with the offline switches lifted (test
    sessions switch them on for everything else), and only when ``allow_download``.
    """
    env_dir = os.environ.get("DLLM_ALIGN_KTO_MIX_TEST")
    if env_dir:
        if _complete(Path(env_dir)):
            return Path(env_dir)
        raise Unavailable(f"DLLM_ALIGN_KTO_MIX_TEST={env_dir} does not hold {' and '.join(FILES)}")
    repo = repo or Path(__file__).resolve().parents[3]
    for folder in (repo.parent / "shared" / "data" / FOLDER, cache_folder()):
        if _complete(folder):
            return folder
    if not allow_download:
        raise Unavailable(f"kto-mix-14k test rows not found beside the checkout nor in {cache_folder()}")
    env = dict(os.environ)
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(k, None)
    if os.environ.get("DLLM_ALIGN_TEST_OFFLINE"):  # keep the caller's choice to stay off the network
        env["HF_DATASETS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    code = "from dllm_align.data.public import fetch, Unavailable\ntry:\n    print(fetch())\nexcept Unavailable as e:\n    print('UNAVAILABLE', e)\n"
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{HUB_ID} ({SPLIT}): download took longer than {timeout:.0f} s") from None
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"{HUB_ID} ({SPLIT}) could not be fetched: {tail[:160]}")
    if out[-1].startswith("UNAVAILABLE"):
        raise Unavailable(out[-1][len("UNAVAILABLE "):])
    folder = Path(out[-1])
    if not _complete(folder):
        raise Unavailable(f"{HUB_ID} ({SPLIT}): fetched, but {folder} is incomplete")
    return folder
