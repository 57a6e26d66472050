"""Wall time of ``dllm-align demo``, run as the README's Quick start runs it.

The whole method on the toy task (precompute-ref, ELBO-KTO, generate with the base and the aligned
model, judge), in a fresh process and a fresh run folder, with the environment the benchmark was
started with: without ``OMP_NUM_THREADS`` the demo runs torch on one thread itself (``--threads N``
of run.py sets it for the child). It reports the seconds, the child's peak memory and the headline
AWR (the run must also succeed: a failed demo is an error, not a time). An absolute figure, not a
ratio: the target is the README's promise, the demo in under 5 minutes on a 2-core CPU box.
``quick`` shortens the run (4 steps, 24 prompts) and ``smoke`` to the least that runs every stage
(1 step on 16 rows, 4 prompts); their seconds say nothing about the target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `python -m MODULE ARGS...` that writes the process's own peak resident memory (kB) to a file as it exits.
# Not getrusage: a child's ru_maxrss starts from its parent's resident size when it was spawned (Linux records the
# replaced memory map's peak at exec), so a child of a large process (the suite, run.py after the other benchmarks)
# would report the parent's size. VmHWM belongs to the child's own memory map.
PEAK_WRAPPER = """
import atexit, resource, runpy, sys
path = sys.argv.pop(1)
def peak():
    try:
        kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(path, "w") as f:
        f.write(str(kb))
atexit.register(peak)
module = sys.argv.pop(1)
sys.argv[0] = module
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
SETTINGS = {
    "full": [],
    "quick": ["--set", "train.max_steps=4", "--set", "train.save_every=4", "--set", "generate.limit=24"],
    "smoke": ["--set", "train.max_steps=1", "--set", "train.save_every=1", "--set", "generate.limit=4", "--set", "data.limit=16"],
}


def run(device: str = "cpu", size: str = "full") -> dict:
    if device != "cpu":
        return {"demo_skipped": "the demo is a CPU run"}
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="dllm-align-bench-demo-") as tmp:
        out = Path(tmp) / "demo"
        err_path, peak_path = Path(tmp) / "stderr.txt", Path(tmp) / "peak_kb"
        t = time.perf_counter()
        with open(err_path, "w") as err:
            proc = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, str(peak_path), "dllm_align", "demo", "-o", str(out),
                                   *SETTINGS[size]], env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=3 * 3600)
        seconds = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"dllm-align demo exited {proc.returncode}: {err_path.read_text().strip().splitlines()[-1:]}")
        results = json.loads((out / "results.json").read_text())
        peak_mb = int(peak_path.read_text()) / 1024
    return {
        "demo_seconds": round(seconds, 1),
        "demo_figures": {"seconds": round(seconds, 1), "peak_memory_mb": round(peak_mb), "awr": results["awr"],
                         "ci90": results["ci90"], "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset (the demo's default: 1)"),
                         "size": size},
    }


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=list(SETTINGS))
    print(json.dumps(run(size=ap.parse_args().size), indent=2))
