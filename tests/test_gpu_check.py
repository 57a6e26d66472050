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

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gpu_check(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", DLLM_ALIGN_NO_PROGRESS="1")
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_mod", REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_runs_end_to_end_on_cpu_tiny(tmp_path):
    # a CPU is slower than the device the shares were measured on: a larger budget, the same proportions
    p = _gpu_check("--device", "cpu", "--tiny", "--budget", "600", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(r["parts"]) == ["environment", "pytest", "invariants", "doctor", "families", "benchmarks"]
    assert all(part["status"] == "ok" for part in r["parts"].values()), {k: v.get("error") for k, v in r["parts"].items()}
    for name, part in r["parts"].items():
        assert part["seconds"] <= part["limit_seconds"] + 5 and part["log"] == "gpu_check.log"
        assert f"===== {name} " in (tmp_path / "gpu_check.log").read_text()
    assert sum(r["limits_seconds"].values()) == pytest.approx(600, abs=0.5)
    inv = r["parts"]["invariants"]
    # a whole-sequence body under every backend this machine has, packed rows under sdpa, and a block family;
    # every margin exactly 0 in fp32 on CPU, on rows of kto-mix lengths
    backends = r["parts"]["environment"]["attention_backends"]
    assert len(inv["rows"]) == len(backends) + 1 + len([b for b in backends if b in ("sdpa", "flex_attention")])
    assert {row["model"] for row in inv["rows"]} == {"builtin:small", "builtin:small-sdar"}
    assert inv["all_ok"] and all(row["max_abs_margin"] == 0.0 for row in inv["rows"])
    assert inv["row_tokens"]["max"] > inv["row_tokens"]["min"]  # real lengths vary
    doc = r["parts"]["doctor"]
    for shape in doc["shapes"].values():
        assert shape["seconds_per_step"] > 0 and shape["estimate_bytes"] > 0 and shape["invariant_ok"]
    assert doc["shapes"]["p50"]["draws_x_tokens"] != doc["shapes"]["p95"]["draws_x_tokens"]
    assert "LoRA" in doc["projection"]["scales"] and doc["projection"]["paper_minutes_full_fine_tune_8xH100"]["training"] == 172
    fam = r["parts"]["families"]
    assert fam["llada"]["generated_tokens"] == 8 and fam["dream"]["invariant_ok"]
    for block in ("sdar", "llada2"):  # block diffusion: a dense Qwen3 body and the LLaDA2.0 MoE body
        assert fam[block]["generated_tokens"] == 8 and fam[block]["invariant_ok"]
    bench = json.loads((tmp_path / "benchmarks.json").read_text())
    # the kto-mix rows' benchmarks are listed as skipped, with the reason, wherever the split cannot be had
    assert r["parts"]["benchmarks"]["skipped"] == {k[:-8]: v for k, v in bench["results"].items() if k.endswith("_skipped")}
    assert len(list(tmp_path.iterdir())) <= 8  # what a device call brings back


def test_a_part_past_its_limit_is_killed_and_recorded(tmp_path):
    """A part's hard limit ends it (its process group) however far it got; the next part runs."""
    import argparse
    import time

    mod = _module()
    chk = mod.Check(tmp_path, argparse.Namespace(device="cpu", tiny=True, budget=1.0))
    t = time.monotonic()
    chk.part("environment", 0.3)  # starting Python and torch alone takes longer
    assert time.monotonic() - t < 10
    rec = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["environment"]
    assert rec["status"] == "timeout" and "killed at its 0 s limit" in rec["why"]


@pytest.mark.parametrize("args, message", [
    (["--budget", "20"], r"--budget 20 s is too small: the environment part would get 0\.6 s"),
    (["--budget", "-3"], "--budget must be a positive number"),
])
def test_a_budget_too_small_is_one_error_line(tmp_path, args, message):
    import re

    p = _gpu_check("--device", "cpu", "--tiny", "--out", str(tmp_path / "o"), *args, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1 and re.search(message, p.stderr), p.stderr
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_an_unwritable_out_is_one_error_line(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for out in (file, file / "sub", ro, Path("/proc/dllm-align-gpu-check")):  # /proc: read-only even for root
            if out == ro and os.access(ro, os.W_OK):  # root writes anywhere: the read-only case cannot be made here
                continue
            p = _gpu_check("--device", "cpu", "--tiny", "--out", str(out), timeout=60)
            assert p.returncode == 2 and p.stderr.startswith(f"Error: --out {out}: cannot write there"), p.stderr
            assert p.stderr.count("\n") == 1
    finally:
        ro.chmod(0o700)


def test_rows_follow_the_kto_mix_lengths(tmp_path):
    mod = _module()
    lengths = mod.write_rows(tmp_path / "rows.jsonl", 200, 1, 4096)
    real = {p + c for p, c in mod.read_lengths()}
    under = [n for n in lengths if n + 24 < 4096]
    assert len(under) > 190 and set(under) <= real and len(set(under)) > 100  # drawn from the real rows, uncut
    assert max(lengths) + 24 <= 4096 and len((tmp_path / "rows.jsonl").read_text().splitlines()) == 200
    fixed = mod.write_rows(tmp_path / "fixed.jsonl", 3, 1, 600, length=576)
    assert fixed == [576] * 3


def test_environment_part_names_a_too_old_transformers(monkeypatch):
    """A GPU image with transformers older than 5.2 (every body would be causal) fails the first part, by name."""
    import importlib.util

    import pytest
    import transformers

    from dllm_align.core.errors import UserError

    mod = _module()
    assert mod.environment(None, True, "cpu")["versions"]["transformers"] == transformers.__version__
    # (importing the libraries it lists can leave another transformers module object in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.1.0")
    with pytest.raises(UserError, match=r"transformers 5\.1\.0 is too old"):
        mod.environment(None, True, "cpu")


def test_doctor_part_records_an_out_of_memory_shape_as_a_finding_and_goes_on(tmp_path, monkeypatch):
    """A shape doctor says fits but the device cannot hold is a finding with the estimate beside it; the part
    still finishes, and the next shape runs (here the p50 shape runs out of memory, the p95 one runs)."""
    import torch

    mod = _module()
    real, calls = mod._smoke, []

    def smoke(rec, steps):
        calls.append(rec.data.max_length)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 420.00 MiB.")
        return real(rec, 1)

    monkeypatch.setattr(mod, "_smoke", smoke)
    monkeypatch.setattr(mod, "_build_on", lambda device: None)
    part = mod.Part(tmp_path / "result.json", 300)
    out = mod.doctor_timing(part, True, "cpu")
    p50, p95 = out["shapes"]["p50"], out["shapes"]["p95"]
    assert len(calls) == 2 and calls[0] < calls[1]
    assert "OutOfMemoryError" in p50["out_of_memory"] and p50["estimate_bytes"] > 0 and "seconds_per_step" not in p50
    assert out["findings"] == [f"{p50['draws_x_tokens']}: out of memory where doctor's estimate "
                               f"({p50['estimate_bytes'] / 1e9:.1f} GB) fits"]
    assert p95["seconds_per_step"] > 0 and p95["invariant_ok"] and "out_of_memory" not in p95
    assert json.loads((tmp_path / "result.json").read_text())["findings"] == out["findings"]  # saved as it happened


def test_doctor_part_runs_only_the_shapes_asked_for(tmp_path, monkeypatch):
    mod = _module()
    seen = []

    def smoke(rec, steps):
        seen.append(rec.data.max_length)
        raise KeyboardInterrupt  # enough: the shape was reached

    monkeypatch.setattr(mod, "_smoke", smoke)
    monkeypatch.setattr(mod, "_build_on", lambda device: None)
    with pytest.raises(KeyboardInterrupt):
        mod.doctor_timing(mod.Part(tmp_path / "r.json", 300), True, "cpu", ("p95",))
    p95 = -(-mod.percentile([min(p + c, 4096) for p, c in mod.read_lengths()], 0.95) // 16 // 64) * 64
    assert seen == [p95]
