"""The GPU validation command runs end to end on a CPU with --tiny, and writes the JSON it promises.

On the GPU node the same command runs the real shapes (benchmarks/gpu_check.py's docstring); here it
proves that every part is wired to the library and reports what a GPU run will report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_end_to_end_on_cpu_tiny(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", DLLM_ALIGN_NO_PROGRESS="1")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(r["parts"]) == ["environment", "pytest", "invariants", "doctor", "benchmarks", "families"]
    assert all(part["status"] == "ok" for part in r["parts"].values()), {k: v.get("error") for k, v in r["parts"].items()}
    for part in r["parts"].values():
        assert (tmp_path / part["log"]).is_file() and part["seconds"] >= 0
    inv = r["parts"]["invariants"]
    # two bodies x three paddings x every backend this machine has; every margin exactly 0 in fp32 on CPU
    assert len(inv["rows"]) == 2 * 3 * len(r["parts"]["environment"]["attention_backends"])
    assert inv["all_ok"] and all(row["max_abs_margin"] == 0.0 for row in inv["rows"])
    doc = r["parts"]["doctor"]
    for padding in ("paper", "packed"):
        assert doc[padding]["seconds_per_step"] > 0 and doc[padding]["projected_8gpu_minutes"]["paper"] == {"precompute": 37, "training": 172}
    fam = r["parts"]["families"]
    assert fam["llada"]["generated_tokens"] == 8 and fam["dream"]["invariant_ok"]
    for block in ("sdar", "llada2"):  # block diffusion: a dense Qwen3 body and the LLaDA2.0 MoE body
        assert fam[block]["generated_tokens"] == 8 and fam[block]["invariant_ok"]
    assert json.loads((tmp_path / "benchmarks.json").read_text())


def test_environment_part_names_a_too_old_transformers(monkeypatch):
    """A GPU image with transformers older than 5.2 (every body would be causal) fails the first part, by name."""
    import importlib.util

    import pytest
    import transformers

    from dllm_align.core.errors import UserError

    spec = importlib.util.spec_from_file_location("gpu_check_mod", REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.environment("cpu")["versions"]["transformers"] == transformers.__version__
    # (importing the libraries it lists can leave another transformers module object in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.1.0")
    with pytest.raises(UserError, match=r"transformers 5\.1\.0 is too old"):
        mod.environment("cpu")
