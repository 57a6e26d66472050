"""Shared fixtures. Tests never touch the network: the hub is switched off here."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["DLLM_ALIGN_NO_PROGRESS"] = "1"
os.environ.pop("DLLM_ALIGN_DEBUG", None)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data" / "kto-mix-14k-test"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "chosen.jsonl").exists():
        pytest.skip(f"shared kto-mix-14k rows not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny():
    """The built-in tiny model as a MaskPredictor (fp32, CPU)."""
    from dllm_align.models import load_model

    return load_model("builtin:tiny")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The built-in tiny model saved to a folder (save_pretrained format)."""
    from dllm_align.models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")
