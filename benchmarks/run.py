"""Run every benchmark in one process and print a markdown table of ratios.

    python benchmarks/run.py [--quick | --smoke] [--json OUT] [--device cpu|cuda] [--only NAME ...]

Each benchmark compares dllm-align with a faithful implementation of the
straightforward method written in the benchmark itself (see each module's
docstring), and first checks that both sides compute the same numbers;
``cli_startup`` and ``demo`` report absolute seconds instead (how long a user
waits for ``--help`` and for the demo; the tests assert no time).
Memory and time targets are asserted here, not in the unit tests: the exit
code is 1 when a target is missed or a benchmark fails (``--no-assert``: only
a failure counts). ``--quick`` runs small settings and ``--smoke`` the
smallest (seconds a benchmark: the equal-work checks and every figure, which
CI runs); there only a failing benchmark sets the exit code, and targets are
not judged. A benchmark fails when it raises, or when it returns without a
figure of the table and without a ``<module>_skipped`` reason.

Speed ratios come from repeated paired measurements (``paired.py``): the table shows the median with its
min-max over the repeats, a target is judged on the median, and a spread that reaches both sides of the
target says ``straddles`` instead of a plain yes or NO.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from cli_args import Parser, check_json_out  # noqa: E402 - benchmarks/ is put on the path just above
from paired import verdict  # noqa: E402

def _get(r: dict, *path):
    for k in path:
        if not isinstance(r, dict) or k not in r:
            return None
        r = r[k]
    return r


def _pair(a, b, fmt: str, unit: str) -> str:
    if a is None or b is None:
        return "-"
    return f"{a:{fmt}} vs {b:{fmt}} {unit}"


# (module, key, what the straightforward method is, target text, check(value, results), absolute figures(results))
BENCHMARKS = [
    ("memory", "loss_memory_ratio", "full [K, L, V] logits, then gather", "<= 0.15", lambda v, r: v <= 0.15,
     lambda r: _pair(r.get("loss_memory_ours_mb"), r.get("loss_memory_straightforward_mb"), ",.0f", "MB")),
    ("padding", "padding_ratio", "pad every row to 4,096 (paper)", "<= 1.15 x real tokens", lambda v, r: v <= 1.15,
     lambda r: _pair(_get(r, "padding_settings", "ours_tokens"), _get(r, "padding_settings", "paper_tokens"), ",", "positions")),
    ("throughput", "train_speedup", "K separate forwards, full logits, pad to longest", ">= 3x", lambda v, r: v >= 3.0,
     lambda r: _pair(r.get("throughput_train_ours_ex_per_s"), r.get("throughput_train_straightforward_ex_per_s"), ".2f", "ex/s")),
    ("throughput", "precompute_speedup", "same, no grad", ">= 3x", lambda v, r: v >= 3.0,
     lambda r: _pair(r.get("throughput_precompute_ours_ex_per_s"), r.get("throughput_precompute_straightforward_ex_per_s"), ".2f", "ex/s")),
    ("packing", "packing_positions_ratio", "uniform batches padded to their longest row", "<= 1.05 x real tokens",
     lambda v, r: v <= 1.05,
     lambda r: _pair(_get(r, "packing_figures", "packed_uniform", "positions_fed"),
                     _get(r, "packing_figures", "padded_uniform", "positions_fed"), ",", "positions")),
    ("packing", "packing_train_vs_grouped", "length-grouped batches, padded (train, body-heavy model)", ">= 0.9x",
     lambda v, r: v >= 0.9,
     lambda r: _pair(_get(r, "packing_figures", "packed_uniform", "train_ex_per_s_body"),
                     _get(r, "packing_figures", "grouped", "train_ex_per_s_body"), ".2f", "ex/s")),
    ("packing", "packing_precompute_vs_padded", "uniform rows padded to their longest (precompute, body-heavy)", "reported", None,
     lambda r: _pair(_get(r, "packing_figures", "packed_uniform", "precompute_ex_per_s_body"),
                     _get(r, "packing_figures", "padded_uniform", "precompute_ex_per_s_body"), ".2f", "ex/s")),
    ("generation", "generate_exact_speedup", "one full forward per step (plain sampler)", ">= 1.0x, identical tokens (fp32)",
     lambda v, r: v >= 1.0 and (r.get("generate_exact_identical") is True or _get(r, "generation_settings", "dtype") != "float32"),
     lambda r: _pair(_get(r, "generation_figures", "exact", "tokens_per_s"),
                     _get(r, "generation_figures", "straightforward", "tokens_per_s"), ".1f", "tok/s")
     + ("" if r.get("generate_exact_identical") is None else
        (", identical" if r["generate_exact_identical"] else ", tokens DIFFER"))),
    ("generation", "generate_fast_speedup", "exact mode", ">= 3x at batch 1", lambda v, r: v >= 3.0,
     lambda r: _pair(_get(r, "generation_figures", "fast", "tokens_per_s"),
                     _get(r, "generation_figures", "exact", "tokens_per_s"), ".1f", "tok/s")),
    ("block_stream", "block_stream_speedup", "K rows of [x_t ; x_0], published 2L mask (block diffusion)", ">= 1.6x at K = 8",
     lambda v, r: v >= 1.6,
     lambda r: _pair(_get(r, "block_stream_figures", "shared_ex_per_s"),
                     _get(r, "block_stream_figures", "2l_ex_per_s"), ".2f", "ex/s")),
    ("cli_startup", "cli_help_seconds", "absolute: best of 7 (--quick 3, --smoke 2) fresh `dllm-align --help` processes", "<= 2 s",
     lambda v, r: v <= 2.0,
     lambda r: f"{r['cli_help_seconds']:.2f} s best, {_get(r, 'cli_startup_figures', 'median_s'):.2f} s median"
     + (", torch loaded!" if _get(r, "cli_startup_figures", "torch_loaded") else ", torch not loaded")),
    ("demo", "demo_seconds", "absolute: `dllm-align demo` in a fresh process (README's Quick start)", "<= 300 s",
     lambda v, r: v <= 300.0,
     lambda r: f"{r['demo_seconds']:.0f} s, peak {_get(r, 'demo_figures', 'peak_memory_mb'):,} MB, "
     f"AWR {_get(r, 'demo_figures', 'awr'):.3f}"),
    ("serving", "serve_concurrency_speedup", "the same 64 requests to `serve` one at a time", ">= 3x (2 cores)",
     lambda v, r: v >= 3.0,
     lambda r: _pair(_get(r, "serving_figures", "together_s"), _get(r, "serving_figures", "one_at_a_time_s"), ".2f", "s")),
    ("serving", "serve_client_overhead_ms", "in-process generate at batch 1 (ms a prompt costs more through HTTP)",
     "reported", None,
     lambda r: _pair(_get(r, "serving_figures", "client_s"), _get(r, "serving_figures", "in_process_batch1_s"), ".2f", "s")),
    ("serving", "serve_hostile_ok", "hostile requests: each a 4xx or a bounded refusal, the server alive after", "== 1",
     lambda v, r: v == 1.0,
     lambda r: ", ".join(f"{k}: {v}" for k, v in (_get(r, "serving_figures", "hostile", "thousand_codes") or {}).items())),
    ("variance", "variance_ratio_shared", "independent masks for policy and reference", "reported", None,
     lambda r: _pair(r.get("variance_shared"), r.get("variance_independent"), ".3g", "")),
    ("variance", "variance_ratio_stratified", "independent masks for policy and reference", "reported", None,
     lambda r: _pair(r.get("variance_shared_stratified"), r.get("variance_independent"), ".3g", "")),
]


def machine() -> dict:
    import torch

    info = {
        "date": _dt.date.today().isoformat(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


MAX_THREADS = 1024  # far past any machine's cores; a larger count makes OpenMP allocate until it crashes


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag checked before any benchmark runs or anything is written."""
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        ap.error(f"--threads {args.threads}: a number of threads from 1 to {MAX_THREADS}")
    if args.only is not None and not args.only:
        ap.error("--only needs at least one benchmark name")
    check_json_out(ap, args.json)


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="small settings: a short run; a missed target does not fail it")
    size.add_argument("--smoke", action="store_true",
                      help="the smallest settings (seconds a benchmark): equal-work checks and every figure only")
    ap.add_argument("--json", metavar="OUT", help="write the ratios, settings and machine as JSON")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--only", nargs="*", metavar="NAME",
                    help="run only these modules (memory padding throughput packing generation block_stream cli_startup demo serving variance)")
    ap.add_argument("--no-assert", action="store_true",
                    help="exit 0 even if a target is missed (a failing benchmark still exits 1)")
    ap.add_argument("--threads", type=int, metavar="N",
                    help="torch / OpenMP threads here and in child processes (1 is steadier on a busy machine)")
    args = ap.parse_args(argv)
    check_args(ap, args)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    known = {m for m, *_ in BENCHMARKS}
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {' '.join(sorted(known))}")
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the memory benchmark's child processes
        import torch

        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.stderr.write("Error: --device cuda but no CUDA device is visible to torch\n")
            return 2

    modules = []
    for mod, *_ in BENCHMARKS:
        if mod not in modules and (not args.only or mod in args.only):
            modules.append(mod)
    results: dict = {}
    timings = {}
    for mod in modules:
        sys.stderr.write(f"[bench] {mod} ...\n")
        sys.stderr.flush()
        t = time.perf_counter()
        try:
            out = importlib.import_module(mod).run(device=args.device, size=size)
            absent = [key for m, key, *_ in BENCHMARKS if m == mod and out.get(key) is None]
            if absent and f"{mod}_skipped" not in out:  # a figure it should have produced: broken, not missed
                raise RuntimeError(f"returned no {', '.join(absent)}")
            results.update(out)
        except Exception as e:  # report and go on: one broken benchmark must not hide the others
            results[f"{mod}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()  # where it broke, for the CI log
            sys.stderr.write(f"[bench] {mod} failed: {type(e).__name__}: {e}\n")
        timings[mod] = round(time.perf_counter() - t, 1)

    m = machine()
    lines = [
        f"# dllm-align benchmarks ({m['date']}, {m['platform']}, {m['cores']} cores, torch {m['torch']}"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + f", {m['threads']} torch thread(s), device {args.device}{'' if size == 'full' else ', ' + size})",
        "",
        "| benchmark | straightforward method | ratio (ours / straightforward): median (min-max) | ours vs straightforward | target | met |",
        "|---|---|---|---|---|---|",
    ]
    missed = []
    for mod, key, base, target, check, absolute in BENCHMARKS:
        if mod not in modules:
            continue
        val = results.get(key)
        if val is None and f"{mod}_skipped" in results:  # its data cannot be had here: said, not failed
            lines.append(f"| {key} | {base} | - | skipped: {results[f'{mod}_skipped']} | {target} | skipped |")
            continue
        if val is None:
            ok = "not run" if f"{mod}_error" not in results else "error"
            lines.append(f"| {key} | {base} | - | - | {target} | {ok} |")
            if check is not None:
                missed.append(key)
            continue
        sp = results.get(f"{key}_spread")
        met = "reported" if check is None else verdict(check, val, sp, results)
        if size == "smoke" and check is not None:
            met = "not judged (smoke)"  # the smallest settings say nothing about speed
        elif met in ("NO", "straddles (median misses)"):  # judged on the median
            missed.append(key)
            if size == "quick":
                met = f"{met} (quick settings)"
        shown = f"{val:.3f}"
        if sp is not None:
            shown += " (1 repeat)" if sp["repeats"] == 1 else f" ({sp['min']:.2f}-{sp['max']:.2f}, {sp['repeats']} repeats)"
        lines.append(f"| {key} | {base} | {shown} | {absolute(results)} | {target} | {met} |")
    lines.append("")
    lines.append("Seconds per benchmark: " + ", ".join(f"{k} {v}" for k, v in timings.items()))
    print("\n".join(lines))
    if args.json:
        payload = {"machine": m, "device": args.device, "size": size, "quick": args.quick, "results": results,
                   "seconds": timings, "missed": missed}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    errors = [k.removesuffix("_error") for k in results if k.endswith("_error")]
    if missed:
        sys.stderr.write(f"[bench] targets missed: {', '.join(missed)}\n")
    if errors:
        sys.stderr.write(f"[bench] failed: {', '.join(errors)}\n")
        return 1
    # --quick and --smoke settings are too small for some targets (fast decoding needs
    # long generations to pay off), so only failures fail them.
    return 1 if missed and size == "full" and not args.no_assert else 0


if __name__ == "__main__":
    sys.exit(main())
