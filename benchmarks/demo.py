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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
        err_path = Path(tmp) / "stderr.txt"
        t = time.perf_counter()
        with open(err_path, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "dllm_align", "demo", "-o", str(out), *SETTINGS[size]],
                                    env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
            # The peak of this child alone: RUSAGE_CHILDREN would be the largest of every child this process
            # has waited for, the other benchmarks' included when run.py runs them all.
            timer = threading.Timer(3 * 3600, proc.kill)
            timer.start()
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"dllm-align demo exited {proc.returncode}: {err_path.read_text().strip().splitlines()[-1:]}")
        results = json.loads((out / "results.json").read_text())
    peak_mb = usage.ru_maxrss / 1024  # kB on Linux
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
