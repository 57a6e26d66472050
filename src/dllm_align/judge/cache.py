"""The judge's cache: one line per finished API judgement in ``DIR/cache.jsonl``.

A judgement is keyed by a hash of everything that shapes its request (judge,
template, prompt, the two answers in their shown order, sampling parameters),
so a rerun, a resumed run or a batch never asks for it again. Lines are
appended and fsynced one at a time by the main thread only; a torn last line
(a kill mid-write) is dropped on reading (:func:`dllm_align.core.io.recover_jsonl`).
The file is created with its first line, never empty.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dllm_align.core.io import JsonlAppender, recover_jsonl

CACHE_VERSION = 1


@dataclass(frozen=True)
class Task:
    """One API judgement to obtain: the rendered prompt for one judge and order."""

    key: str
    judge: str
    order: str
    id: str
    content: str


def judgement_key(judge: str, template: str, prompt: str, first: str, second: str, temperature: Optional[float],
                  max_tokens: int, token_param: str = "max_tokens") -> str:
    """Cache key of one API judgement: everything that shapes the request. The
    answers are positional (``first`` is shown as Answer A), so the order is part
    of the key. ``token_param`` enters the hash only when it is not the default
    ``max_tokens``, so a request that sends ``max_tokens`` keeps the key it has in
    caches written before the setting existed."""
    fields: dict[str, Any] = {
        "v": CACHE_VERSION,
        "judge": judge,
        "template": template,
        "prompt": prompt,
        "first": first,
        "second": second,
        "temperature": temperature,
        "max_tokens": max_tokens,
    }
    if token_param != "max_tokens":
        fields["token_param"] = token_param
    payload = json.dumps(fields, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def load_cache(path: Path) -> dict[str, dict]:
    """``{key: row}`` of the finished judgements in ``path`` (first line per key wins)."""
    cache: dict[str, dict] = {}
    for row in recover_jsonl(path):
        key, verdict = row.get("key"), row.get("verdict")
        if isinstance(key, str) and verdict in ("A", "B", "C") and key not in cache:
            cache[key] = row
    return cache


class CacheWriter:
    """Appends cache rows; opens (creates) the file on the first row, so a run whose
    first request fails leaves no empty cache file behind."""

    def __init__(self, path: Path, cache: dict[str, dict]):
        self.path, self.cache = path, cache
        self._appender = None

    def add(self, row: dict) -> bool:
        """Append ``row`` unless its key is cached already; returns whether it was new."""
        if row["key"] in self.cache:
            return False
        if self._appender is None:
            self._appender = JsonlAppender(self.path)
        self._appender.write(row)
        self.cache[row["key"]] = row
        return True

    def close(self) -> None:
        if self._appender is not None:
            self._appender.close()
            self._appender = None

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def add_usage(total: dict, usage: Any) -> None:
    """Add the ``prompt_tokens`` / ``completion_tokens`` of one reply to ``total``."""
    if isinstance(usage, dict):
        for f in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(f), int):
                total[f] = total.get(f, 0) + usage[f]
