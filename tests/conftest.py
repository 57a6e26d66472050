"""Shared fixtures. Tests never download models: the hub is switched off here for everything but the
one public data set some tests read (the kto-mix-14k test split, fetched once when it is neither beside the
checkout nor cached; ``DLLM_ALIGN_TEST_OFFLINE=1`` keeps that off the network too, and those tests skip)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["DLLM_ALIGN_NO_PROGRESS"] = "1"
# The models here are tiny: one thread per process avoids oversubscribing a 2-core box
# (multi-process tests start several), where torch's default can be ~10x slower.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.pop("DLLM_ALIGN_DEBUG", None)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow") or os.environ.get("DLLM_ALIGN_RUN_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (or DLLM_ALIGN_RUN_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

REPO = Path(__file__).resolve().parents[1]
_KTO_MIX: list = []  # (folder, None) or (None, reason), found once per session


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The public kto-mix-14k test split as chosen.jsonl + rejected.jsonl: ../shared beside the
    checkout, a cached copy, or the hub through `datasets` (dllm_align.data.public); a skip
    with a one-line reason only when none of them can be had."""
    from dllm_align.data.public import Unavailable, kto_mix_test

    if not _KTO_MIX:
        try:
            _KTO_MIX.append((kto_mix_test(REPO), None))
        except Unavailable as e:
            _KTO_MIX.append((None, str(e)))
    folder, reason = _KTO_MIX[0]
    if folder is None:
        pytest.skip(f"kto-mix-14k test split unavailable: {reason}")
    return folder


@pytest.fixture(scope="session")
def tiny():
    """The built-in tiny model as a MaskPredictor (fp32, CPU)."""
    from dllm_align.models.load import load_model

    return load_model("builtin:tiny")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The built-in tiny model saved to a folder (save_pretrained format)."""
    from dllm_align.models.load import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps one process-wide state; a test that changes mixed precision starts and ends clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture()
def connections(monkeypatch) -> list:
    """Every address a socket of this process tries to connect to while the test runs (they still connect):
    "offline", "no retries" and "at once" asserted as the attempts made, never as seconds on a clock."""
    import socket

    seen: list = []
    real = socket.socket.connect

    def connect(self, address):
        seen.append(address)
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return seen


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test starts with torch.compile's caches empty. Dynamo keys its recompiles on the compiled function's
    code, so FlexAttention compiled by one test (the block families' streams) made a later test's compile of the
    same function (a masked family's packed rows) a recompile with symbolic sizes, for which torch 2.13's CPU
    code generation emits C++ that does not compile. A process runs one model family; the suite runs all."""
    yield
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "reset"):
        dynamo.reset()
