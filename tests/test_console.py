"""core/console: progress bars are drawn by global rank 0 only, whatever the node's local rank."""

from __future__ import annotations

import pytest
from rich.console import Console

from dllm_align.core import console


@pytest.mark.parametrize("env, shown", [({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True),
                                        ({"RANK": "1", "LOCAL_RANK": "0"}, False),  # node 1's first process
                                        ({"RANK": "9", "LOCAL_RANK": "1"}, False)])
def test_progress_bars_only_on_global_rank_0(monkeypatch, env, shown):
    monkeypatch.delenv("DLLM_ALIGN_NO_PROGRESS", raising=False)
    for k in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(console, "err", Console(stderr=True, force_terminal=True))
    assert console.progress_enabled() is shown
    with console.progress("x", total=2) as bar:
        assert (bar._p is not None) is shown
        bar.advance(1)
