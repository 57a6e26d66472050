"""The benchmark driver (benchmarks/run.py), the library names the benchmarks use, and the throughput
benchmark's straightforward method.

The benchmarks themselves take minutes and are run by hand (benchmarks/README.md); CI runs every one
in its smallest mode (``run.py --smoke``, .ci/run). These tests keep the driver from rotting, hold
the benchmarks to the library's public names (so that moving a class fails here, not in the next
benchmark run), and check that the straightforward ELBO written in the throughput benchmark computes
the same numbers as the library, so its speed-up compares equal work.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO

BENCH = REPO / "benchmarks"


@pytest.fixture()
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def test_driver_runs_padding_and_writes_json(shared_data, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--only", "padding", "--no-assert", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| padding_ratio |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "yes" and cells[-2] == "<= 1.15 x real tokens"
    assert cells[3].endswith("positions")  # absolute figures: ours vs the paper's padding
    payload = json.loads(out.read_text())
    r = payload["results"]
    assert 1.0 <= r["padding_ratio"] <= 1.15
    assert r["padding_ratio_paper"] > 4  # the paper pads ~750-token rows to 4,096
    assert payload["missed"] == [] and payload["quick"] is True
    assert {"date", "torch", "cores", "threads"} <= set(payload["machine"])


def test_benchmarks_on_kto_mix_rows_say_skipped_without_them(tmp_path):
    """A GPU node without the split (no ../shared, no `datasets`): the benchmarks that need its rows report
    skipped with the reason, and the run still succeeds (they failed with FileNotFoundError on an H100)."""
    import os

    empty = tmp_path / "no-rows"
    empty.mkdir()
    out = tmp_path / "bench.json"
    env = dict(os.environ, DLLM_ALIGN_KTO_MIX_TEST=str(empty), PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--quick", "--only", "throughput", "packing", "variance",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())["results"]
    for mod in ("throughput", "packing", "variance"):
        assert "DLLM_ALIGN_KTO_MIX_TEST" in r[f"{mod}_skipped"] and f"{mod}_error" not in r
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "skipped" in line]
    assert len(rows) == 7 and all(line.rstrip().endswith("| skipped |") for line in rows)


def test_driver_exit_codes(bench_path, monkeypatch, capsys):
    import run

    fake = types.ModuleType("padding")
    sizes = []

    def missing_target(device, size):
        sizes.append(size)
        return {"padding_ratio": 2.0}  # misses the <= 1.15 target

    fake.run = missing_target
    monkeypatch.setitem(sys.modules, "padding", fake)
    assert run.main(["--only", "padding"]) == 1
    assert "| padding_ratio |" in capsys.readouterr().out
    assert run.main(["--only", "padding", "--no-assert"]) == 0
    assert run.main(["--only", "padding", "--quick"]) == 0  # a short run fails on errors only
    assert "NO (quick settings)" in capsys.readouterr().out
    assert run.main(["--only", "padding", "--smoke"]) == 0  # the smallest settings judge no target
    assert "| 2.000 |" in (out := capsys.readouterr().out) and "not judged (smoke)" in out
    assert sizes == ["full", "full", "quick", "smoke"]
    with pytest.raises(SystemExit) as e:
        run.main(["--quick", "--smoke"])
    assert e.value.code == 2

    def broken(device, size):
        raise RuntimeError("boom")

    fake.run = broken  # one failing benchmark is reported as an error, and fails every mode
    for mode in ([], ["--quick"], ["--smoke"], ["--no-assert"]):
        assert run.main(["--only", "padding", *mode]) == 1, mode
        assert "| error |" in capsys.readouterr().out

    fake.run = lambda device, size: {"padding_ratio_paper": 5.0}  # returned, but not its table figure
    assert run.main(["--only", "padding", "--smoke"]) == 1
    assert "| error |" in capsys.readouterr().out
    fake.run = lambda device, size: {"padding_skipped": "no rows here"}  # said why: not a failure
    assert run.main(["--only", "padding", "--smoke"]) == 0
    assert "skipped: no rows here" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        run.main(["--only", "nosuch"])
    assert e.value.code == 2


def _library_names(path):
    """(line, module, name, object) for every dllm_align name a benchmark file uses: the names it imports
    from a dllm_align module, and the attributes it reads off an imported dllm_align module."""
    tree = ast.parse(path.read_text())
    bound, used = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dllm_align"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                if hasattr(mod, a.name):
                    obj = getattr(mod, a.name)
                else:
                    try:  # a submodule
                        obj = importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        obj = None
                used.append((node.lineno, node.module, a.name, obj))
                bound[a.asname or a.name] = obj
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod = bound.get(node.value.id)
            if inspect.ismodule(mod):
                used.append((node.lineno, mod.__name__, node.attr, getattr(mod, node.attr, None)))
    return used


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_use_public_names_from_their_owners(path):
    """A benchmark reaches the library only through public names, taken from the module that defines
    them: a class moved to another module (or renamed private) fails here at once."""
    problems = []
    for line, module, name, obj in _library_names(path):
        where = f"{path.name}:{line} {module}.{name}"
        if obj is None:
            problems.append(f"{where} does not exist")
        elif name.startswith("_") and not name.startswith("__"):
            problems.append(f"{where} is private")
        elif (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ != module:
            problems.append(f"{where} belongs to {obj.__module__}")
    assert not problems, "\n".join(problems)


def test_every_benchmark_has_every_size(bench_path):
    """run.py passes size= full / quick / smoke to each module it lists."""
    import run

    for mod in dict.fromkeys(m for m, *_ in run.BENCHMARKS):
        fn = importlib.import_module(mod).run
        assert list(inspect.signature(fn).parameters)[:2] == ["device", "size"], mod
        settings = getattr(importlib.import_module(mod), "SETTINGS", None)
        if settings is not None:  # padding counts every row whatever the size
            assert set(settings) == {"full", "quick", "smoke"}, mod


def test_straightforward_elbo_equals_the_library(bench_path, tiny):
    """K full-logit forwards with padding to the longest row give elbo_draws' values and gradients."""
    import throughput

    from dllm_align.data.batching import collate
    from dllm_align.objective.elbo import DrawConfig, elbo_draws
    from dllm_align.data.tokenize import Example

    exs = [
        Example("a", [1, 2, 3], [4, 5, 6, 7, 8, 9], True),
        Example("b", [1, 2], [10, 11, 12], False),
        Example("c", [1, 2, 3, 4, 5], [13, 14], True),
    ]
    b = collate(exs, "none", 64, tiny.tokenizer.pad_token_id)
    cfg = DrawConfig(n_mc=5, seed=3)
    params = list(tiny.model.parameters())
    ours = elbo_draws(tiny, b["input_ids"], b["attention_mask"], b["completion_mask"], b["ids"], cfg)
    g_ours = torch.autograd.grad(ours.mean(), params)
    plain = throughput.straightforward_draws(tiny.model, b, cfg, tiny.mask_token_id)
    g_plain = torch.autograd.grad(plain.mean(), params)
    assert plain.shape == (3, 5)
    torch.testing.assert_close(plain, ours, atol=1e-4, rtol=1e-5)
    for x, y in zip(g_plain, g_ours):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_ci_runs_the_benchmark_smoke_after_the_tests():
    lines = [x.strip() for x in (REPO / ".ci" / "run").read_text().splitlines()]
    tests = next(i for i, x in enumerate(lines) if "python -m pytest" in x and not x.startswith("#"))
    smoke = next(i for i, x in enumerate(lines) if x.startswith("python benchmarks/run.py --smoke"))
    assert smoke > tests
    assert any(x.startswith("echo") and "Benchmark smoke" in x for x in lines[tests:smoke])  # its heading in the log


def test_the_timings_the_suite_does_not_assert_are_benchmark_parts(tmp_path):
    """`--help` and the demo are timed here (absolute seconds with a target), never in a test: a timing bound
    in a test fails whenever the machine is busy. The start-up part runs for real: --help in fresh processes,
    without torch."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--smoke", "--only", "cli_startup", "--no-assert", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| cli_help_seconds |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2] == "<= 2 s" and cells[-1] == "not judged (smoke)" and "torch not loaded" in cells[3]
    r = json.loads(out.read_text())["results"]
    f = r["cli_startup_figures"]
    assert f["runs"] == 2 and f["best_s"] == r["cli_help_seconds"] <= f["median_s"] <= f["worst_s"]
    assert f["torch_loaded"] is False and f["torch_and_transformers_loaded"] is False


def test_the_demo_part_runs_the_quick_start_command(bench_path, monkeypatch, tmp_path):
    """The demo part runs `python -m dllm_align demo -o FRESH` with the caller's environment (so without
    OMP_NUM_THREADS the demo picks one thread itself) and reads its results; a failing demo is an error.
    The peak memory is the demo process's own: neither the largest of every child the caller has waited for
    (run.py runs the other benchmarks' children first) nor the caller's own size, which a spawned child's
    getrusage figure starts from. The demo module is replaced by a small one (its smoke size runs a real,
    shortened demo in CI's benchmark smoke); the wrapper that measures it is the benchmark's own."""
    import demo as bench_demo
    import run

    (row,) = [b for b in run.BENCHMARKS if b[0] == "demo"]
    assert row[1] == "demo_seconds" and row[3] == "<= 300 s" and row[4](299.0, {}) and not row[4](301.0, {})
    # An earlier child of this process with a large peak, and this process itself made large.
    subprocess.run([sys.executable, "-c", "b = bytearray(400 * 2**20)"], check=True)
    ballast = bytearray(400 * 2**20)
    (tmp_path / "fake_demo").mkdir()
    (tmp_path / "fake_demo" / "__main__.py").write_text(
        "import json, pathlib, sys\n"
        "b = bytearray(60 * 2**20)\n"
        "if 'fail' in sys.argv: sys.stderr.write('Error: boom\\n'); sys.exit(2)\n"
        "o = pathlib.Path(sys.argv[sys.argv.index('-o') + 1]); o.mkdir(parents=True)\n"
        "(o / 'results.json').write_text(json.dumps({'awr': 0.7, 'ci90': [0.65, 0.75]}))\n")
    seen = {}
    real_run = subprocess.run

    def fake_run(cmd, env, **kw):
        seen.update(cmd=list(cmd), env=dict(env))
        cmd = [("fake_demo" if c == "dllm_align" else c) for c in cmd] + (["fail"] if seen.get("fail") else [])
        return real_run(cmd, env=dict(env, PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"), **kw)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(bench_demo.subprocess, "run", fake_run)
    r = bench_demo.run(size="full")
    i = seen["cmd"].index("dllm_align")
    assert seen["cmd"][i:i + 2] == ["dllm_align", "demo"] and "--set" not in seen["cmd"]
    assert "OMP_NUM_THREADS" not in seen["env"] and r["demo_figures"]["awr"] == 0.7 and r["demo_seconds"] >= 0
    assert 60 <= r["demo_figures"]["peak_memory_mb"] < 300, r["demo_figures"]
    del ballast
    seen["fail"] = True
    with pytest.raises(RuntimeError, match="exited 2.*Error: boom"):
        bench_demo.run(size="smoke")


def test_paired_spread_and_a_target_judged_on_the_median(bench_path, monkeypatch, capsys):
    """A speed ratio is the median of its repeats; a spread reaching both sides of the target says straddles (and
    counts as missed only when the median misses), a spread wholly on one side says yes or NO."""
    import paired
    import run

    sp = paired.spread([1.2, 3.5, 2.0, 4.0, 2.5])
    assert sp["median"] == 2.5 and (sp["min"], sp["max"]) == (1.2, 4.0) and sp["repeats"] == 5 and sp["q1"] == 2.0
    at_least_3 = lambda v, r: v >= 3.0  # noqa: E731
    assert paired.verdict(at_least_3, 2.5, sp, {}) == "straddles (median misses)"
    assert paired.verdict(at_least_3, 3.2, {**sp, "min": 2.9}, {}) == "yes, spread straddles"
    assert paired.verdict(at_least_3, 3.2, {**sp, "min": 3.1}, {}) == "yes"
    assert paired.verdict(at_least_3, 2.5, {**sp, "max": 2.9}, {}) == "NO"
    assert paired.verdict(at_least_3, 3.2, {**sp, "min": 2.0, "repeats": 1}, {}) == "yes"

    fake = types.ModuleType("generation")
    fake.run = lambda device, size: {"generate_fast_speedup": 2.5, "generate_fast_speedup_spread": sp,
                                     "generation_figures": {"fast": {"tokens_per_s": 25.0}, "exact": {"tokens_per_s": 10.0}},
                                     "generate_exact_speedup": 1.1, "generate_exact_identical": True}
    monkeypatch.setitem(sys.modules, "generation", fake)
    assert run.main(["--only", "generation"]) == 1  # judged on the median: missed
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| generate_fast_speedup |"))
    assert "| 2.500 (1.20-4.00, 5 repeats) |" in row and row.rstrip().endswith("| straddles (median misses) |")


def test_gpu_bench_model_flops_per_token_by_hand(bench_path):
    """The MFU's numerator (docs/benchmarks.md#full-size-gpu-benchmarks): LLaDA-8B's shape, by hand."""
    import gpu_bench

    dims = dict(hidden_size=4096, layers=32, heads=32, intermediate_size=12288)
    n_body = 32 * (4 * 4096**2 + 3 * 4096 * 12288)  # 6.98e9
    full = gpu_bench.flops_per_token(dims, 126_464, False, attn_len=800, scored_share=0.25)
    assert full["n_body"] == n_body and full["n_head"] == 126_464 * 4096
    assert full["per_token"] == 6 * n_body + 12 * 32 * 4096 * 800 + 6 * 126_464 * 4096 * 0.25
    lora = gpu_bench.flops_per_token(dims, 126_464, True, attn_len=800, scored_share=0.25)
    n_lora = 32 * 4 * 8 * 2 * 4096
    assert lora["per_token"] == 4 * n_body + 6 * n_lora + 12 * 32 * 4096 * 800 + 4 * 126_464 * 4096 * 0.25
    assert 0.66 < lora["per_token"] / full["per_token"] < 0.7


def test_gpu_bench_parts_dry_run_on_cpu(bench_path, monkeypatch, fresh_accelerate):
    """Every part of the GPU benchmark script at its small CPU size, in this process: ours and the straightforward
    method both measured, the samplers and the streams paired and repeated."""
    import gpu_bench
    from dllm_align.config import components
    from dllm_align.models import load

    monkeypatch.setattr(load, "build_tiny_model", load.build_tiny_model)  # the script wraps it: undone after
    llada = components.get("family", "llada")  # the script adds its shapes to the family's built-in models
    try:
        _gpu_bench_parts(gpu_bench)
    finally:
        components.redeclare(llada)
    assert "builtin:bench-train-1b" not in load.BUILTIN_SPECS


def _gpu_bench_parts(gpu_bench):
    for part in ("train-1b", "train-8b-lora"):
        r = gpu_bench.PARTS[part]("cpu", True)
        assert r["ours"]["tokens_per_s"] > 0 and r["straightforward"]["tokens_per_s"] > 0 and r["speedup"] > 0, part
        assert r["ours"]["mfu"] is None and r["draws"] == 8 and r["flops_per_token"]["per_token"] > 0
        assert len(r["ours"]["step_seconds"]) == len(r["straightforward"]["step_seconds"]) == 4 // r["rows_per_step"]
    assert "LoRA" in r["training"] and "checkpointing" in r["training"]
    s = gpu_bench.PARTS["sampler-b16"]("cpu", True)
    assert s["batch"] == 16 and s["fast_over_exact"]["repeats"] == 2 and 0 <= s["agreement_with_exact"] <= 1
    b = gpu_bench.PARTS["stream"]("cpu", True)
    assert b["block_stream_speedup_spread"]["repeats"] == 2 and b["block_stream_settings"]["K"] == 8


def test_gpu_bench_on_the_cpu_writes_nothing_into_the_repository(tmp_path):
    """The dry run prints its JSON; only --out (or a CUDA run) writes a file; --device cuda without CUDA is one error."""
    latest = (BENCH / "gpu-latest.json").read_bytes()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    p = subprocess.run([sys.executable, str(BENCH / "gpu_bench.py"), "--device", "cpu", "--only", "stream", "--profile"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(p.stdout)
    assert rec["parts"]["stream"]["status"] == "ok" and rec["environment"]["device"] == "cpu"
    assert any("aten::" in line for line in rec["parts"]["stream"]["profile"]["top"])  # the operators that took the time
    assert (BENCH / "gpu-latest.json").read_bytes() == latest and list(tmp_path.iterdir()) == []
    if not torch.cuda.is_available():
        p = subprocess.run([sys.executable, str(BENCH / "gpu_bench.py")], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 2 and p.stderr.startswith("Error: --device cuda, but torch sees no CUDA device")
