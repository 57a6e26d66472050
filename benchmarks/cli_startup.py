"""Start-up time of the command line: ``dllm-align --help`` in a fresh interpreter.

Command modules import torch, transformers and datasets only inside command bodies, so
``--help`` (and an error in a flag) answers before any of them loads. The unit tests check
that torch and transformers stay unimported (tests/test_cli_basics.py); this benchmark
times it: the best and the median of several runs, each a new ``python -m dllm_align
--help`` process, as a user's shell starts it. An absolute figure, not a ratio: the target
(2 s) is what a user waits for help on a quiet 2-core box, about 5x the typical figure.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import sys, dllm_align.cli.app as a; sys.argv = ['dllm-align', '--help']\n"
         "try:\n    a.main()\nexcept SystemExit:\n    pass\n"
         "sys.stderr.write(f\"loaded: {'torch' in sys.modules} {'transformers' in sys.modules}\\n\")")


SETTINGS = {"full": {"runs": 7}, "quick": {"runs": 3}, "smoke": {"runs": 2}}


def run(device: str = "cpu", size: str = "full") -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    n = SETTINGS[size]["runs"]
    seconds = []
    for _ in range(n):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dllm_align", "--help"], env=env, capture_output=True, text=True, timeout=120)
        seconds.append(time.perf_counter() - t)
        if proc.returncode != 0 or "Usage" not in proc.stdout:
            raise RuntimeError(f"dllm-align --help exited {proc.returncode}: {proc.stderr[-300:]}")
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    loaded = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "?"
    return {
        "cli_help_seconds": round(min(seconds), 3),
        "cli_startup_figures": {"runs": n, "best_s": round(min(seconds), 3), "median_s": round(statistics.median(seconds), 3),
                                "worst_s": round(max(seconds), 3), "torch_and_transformers_loaded": loaded == "loaded: True True",
                                "torch_loaded": loaded.split()[1:2] == ["True"]},
    }


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=list(SETTINGS))
    print(json.dumps(run(size=ap.parse_args().size), indent=2))
