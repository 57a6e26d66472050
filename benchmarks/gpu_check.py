"""One command that validates dllm-align on a GPU node, and writes one JSON plus logs.

    python benchmarks/gpu_check.py --out DIR                       # on one GPU: about 9 minutes
    python benchmarks/gpu_check.py --out DIR --device cpu --tiny   # the same parts on shrunk shapes (CI)

Parts, in order; each times itself, records its failure (with the error and a log) and the next
one runs; a part that would start after ``--budget`` seconds is recorded as skipped:

* ``environment``: Python, torch, CUDA, the device, library versions, attention backends present.
* ``pytest``: the suite's ``gpu``-marked tests, then (not with ``--tiny``) the step-0 invariant and
  packing tests with CUDA visible.
* ``invariants``: the step-0 invariant (every margin policy - reference before the first update)
  through the real training path (``dllm-align doctor``'s smoke step), for an LLaDA-8B-shaped body
  with LoRA and a ~1B LLaDA-shaped body with full fine-tuning (random weights built from code, no
  download), each with ``padding`` paper / none / packed and every attention backend installed,
  in bf16 on CUDA.
* ``doctor``: three smoke steps at 8 draws x 4,096 tokens with ``padding: paper`` and with the
  fastest faithful setting (``packed``): measured peak memory against ``doctor``'s estimate,
  seconds per step, and the precompute and epoch times projected to 8 GPUs next to the paper's
  37 and 172 minutes on 8x H100.
* ``benchmarks``: ``benchmarks/run.py --device DEVICE`` (throughput against the straightforward
  method, generation tokens/s), as JSON.
* ``families``: for every registered model family with a built-in shrunk model, one bf16 step and
  one generation.

``--tiny`` shrinks every shape to the built-in tiny models so that the whole command runs in well
under a minute on a CPU (``tests/test_gpu_check.py`` runs it). On the GPU node, install what its
image lacks from a folder of wheels first (``benchmarks/gpu_wheels.sh``, docs/gpus.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))

PAPER_MINUTES = {"precompute": 37, "training": 172}  # 8x H100 80GB, FSDP, kto-mix-14k (paper, SPEC.md section 9)

# Shapes for the real check (bodies of LLaDA's layout, random weights, tokenizer of the built-in models).
GPU_SHAPES = {
    "llada-8b-shape": dict(hidden_size=4096, layers=32, heads=32, intermediate_size=12288),
    "llada-1b-shape": dict(hidden_size=2048, layers=16, heads=16, intermediate_size=5632),
}


class Check:
    """Runs the parts, each timed and isolated, and writes DIR/gpu_check.json after each one."""

    def __init__(self, out: Path, budget: float):
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self.t0 = time.monotonic()
        self.result: dict = {"started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "parts": {}}

    def part(self, name: str, fn, *args) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed > self.budget:
            self.result["parts"][name] = {"status": "skipped", "why": f"past the {self.budget:.0f} s budget ({elapsed:.0f} s)"}
            self.save()
            return
        print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
        log = io.StringIO()
        t = time.monotonic()
        try:
            with contextlib.redirect_stderr(log):
                data = fn(*args)
            rec = {"status": "ok", "seconds": round(time.monotonic() - t, 2), **(data or {})}
        except Exception as e:  # noqa: BLE001 - a part's failure is a result, and the next part runs
            log.write(traceback.format_exc())
            rec = {"status": "failed", "seconds": round(time.monotonic() - t, 2), "error": f"{type(e).__name__}: {e}"[:500]}
        (self.logs / f"{name}.log").write_text(log.getvalue(), encoding="utf-8")
        rec["log"] = f"logs/{name}.log"
        self.result["parts"][name] = rec
        print(f"[gpu_check] {name}: {rec['status']} in {rec['seconds']} s", file=sys.stderr, flush=True)
        self.save()

    def save(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.t0, 2)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str), encoding="utf-8")
        os.replace(tmp, self.out / "gpu_check.json")


def _smoke(rec, steps: int) -> dict:
    """``doctor``'s smoke steps with accelerate's process-wide state reset first (each call may use
    another mixed precision, which accelerate refuses to change in a live state)."""
    from accelerate.state import AcceleratorState, GradientState

    from dllm_align.training import doctor as d
    from dllm_align.training.memory import Launch

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return d.smoke(rec, steps, Launch())


# --------------------------------------------------------------------------- parts
def attention_backends(device: str) -> list[str]:
    """The attention implementations this machine can train with (sdpa always; flex with torch's
    FlexAttention on CUDA, which has no CPU backward; flash_attention_2 when the flash-attn wheel is
    installed and a CUDA device is present)."""
    import importlib.util

    out = ["sdpa"]
    if device == "cuda" and importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        out.append("flex_attention")
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        out.append("flash_attention_2")
    return out


def environment(device: str) -> dict:
    import torch

    versions = {}
    for mod in ("torch", "transformers", "accelerate", "peft", "typer", "pydantic", "safetensors", "numpy", "datasets", "openai", "lm_eval"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent is an answer
            versions[mod] = None
    from dllm_align import __version__
    from dllm_align.models.load import require_transformers

    if versions["transformers"]:  # an image's older transformers: said first, by name
        require_transformers(versions["transformers"])
    env = {"python": platform.python_version(), "platform": platform.platform(), "dllm_align": __version__,
           "versions": versions, "device": device, "attention_backends": attention_backends(device)}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda, bf16=torch.cuda.is_bf16_supported())
    return env


def _pythonpath() -> str:
    """The repository's src first, then whatever PYTHONPATH already holds (wheels installed with
    ``pip install --target DIR`` on a node whose environment is read-only are found there)."""
    return os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)


def run_pytest(tiny: bool, device: str) -> dict:
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    runs = [("gpu-marked", ["-m", "gpu"])]
    if not tiny:
        runs.append(("invariants-and-packing", ["tests/test_invariants.py", "tests/test_invariants_real.py", "tests/test_packing.py",
                                                 "-k", "step0 or within_sequences or flash or flex"]))
    out = {}
    for name, args in runs:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
        tail = (p.stdout + p.stderr).strip().splitlines()
        print("\n".join(tail[-60:]), file=sys.stderr)
        out[name] = {"exit_code": p.returncode, "summary": tail[-1] if tail else ""}
        if p.returncode not in (0, 5):  # 5: no test selected (none marked gpu, say)
            raise RuntimeError(f"pytest {name} exited {p.returncode}: {out[name]['summary']}")
    return out


def _register_shapes(tiny: bool) -> dict[str, str]:
    """Model names for the invariant and doctor parts: built-in models, or LLaDA-shaped bodies registered as built-ins."""
    from dllm_align.models.load import BUILTIN_SPECS, TinySpec

    if tiny:
        return {"lora": "builtin:tiny", "full": "builtin:small"}
    for name, dims in GPU_SHAPES.items():
        BUILTIN_SPECS[f"builtin:{name}"] = TinySpec(**dims)
    return {"lora": "builtin:llada-8b-shape", "full": "builtin:llada-1b-shape"}


def _recipe(model: str, *, padding: str, attn: str, lora: bool, device: str, k: int, max_length: int, batch: int, extra=()):
    from dllm_align.config.recipe import load_recipe

    sets = [f"model.name_or_path={model}", f"data.padding={padding}", f"model.attn_implementation={attn}",
            f"train.lora.enabled={str(lora).lower()}", f"train.mixed_precision={'bf16' if device == 'cuda' else 'no'}",
            "reference.mode=online", f"reference.n_mc={k}", f"train.n_mc={k}", f"data.max_length={max_length}",
            f"train.batch_size={batch}", f"train.global_batch_size={batch}", "data.limit=64", *extra]
    return load_recipe("demo", sets, str(Path(os.environ.get("TMPDIR", "/tmp")) / "dllm-align-gpu-check"))


def invariants(tiny: bool, device: str) -> dict:
    models = _register_shapes(tiny)
    rows = []
    for kind, model in models.items():
        for padding in ("paper", "none", "packed"):
            for attn in attention_backends(device):
                rec = _recipe(model, padding=padding, attn=attn, lora=kind == "lora", device=device, k=2 if tiny else 8,
                              max_length=64 if tiny else 1024, batch=2)
                row = {"model": model, "training": "LoRA" if kind == "lora" else "full fine-tune", "padding": padding, "attention": attn}
                try:
                    inv = _smoke(rec, 1)["invariant"]
                    row.update(max_abs_margin=inv["max_abs_margin"], tolerance=inv["tolerance"], rows=inv["rows"], ok=inv["ok"])
                except Exception as e:  # noqa: BLE001 - one combination failing is a row, not the end
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return {"rows": rows, "all_ok": all(r.get("ok") for r in rows)}


def doctor_timing(tiny: bool, device: str) -> dict:
    from dllm_align.training import doctor as d
    from dllm_align.training.memory import RESERVE, Launch

    models = _register_shapes(tiny)
    out = {}
    k, length = (2, 64) if tiny else (8, 4096)
    for padding in ("paper", "packed"):
        rec = _recipe(models["lora"], padding=padding, attn="sdpa", lora=True, device=device, k=k, max_length=length, batch=1)
        mem = d.memory_report(rec, Launch())
        sm = _smoke(rec, 2 if tiny else 3)
        ex = sm["extrapolated"]
        # kto-mix-14k on 8 GPUs: the smoke's per-row figures for 13.5k rows, divided over 8 processes
        rows_paper, world = 13_500, 8
        per_row_step = sm["seconds_per_step"] / max(rec.train.global_batch_size or 1, 1)
        out[padding] = {
            "draws_x_tokens": f"{k} x {length}",
            "seconds_per_step": sm["seconds_per_step"],
            "peak_memory_bytes": sm["peak_memory_bytes"],
            "peak_memory_kind": sm["peak_memory_kind"],
            "estimate_bytes": mem["estimate"]["total"],
            "estimate_without_reserve_bytes": mem["estimate"]["total"] - RESERVE,
            "invariant_ok": sm["invariant"]["ok"],
            "projected_8gpu_minutes": {
                "training_epoch": rows_paper * per_row_step / world / 60,
                "precompute": ex["precompute_seconds"] / max(ex["steps_per_epoch"] * (rec.train.global_batch_size or 1), 1)
                * rows_paper / world / 60,
                "paper": PAPER_MINUTES,
                "how": "seconds per step per row x 13,500 rows / 8 processes (training); the smoke's precompute "
                       "figure scaled to 13,500 rows / 8 processes",
            },
        }
    return out


def benchmarks(tiny: bool, device: str, out: Path) -> dict:
    args = [sys.executable, str(HERE / "run.py"), "--device", device, "--json", str(out / "benchmarks.json"), "--no-assert"]
    if tiny:
        args += ["--quick", "--only", "padding"]
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=420,
                       env=dict(os.environ, PYTHONPATH=_pythonpath(), HF_HUB_OFFLINE="1"))
    print(p.stdout[-20000:] + p.stderr[-20000:], file=sys.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"benchmarks/run.py exited {p.returncode}")
    return {"json": "benchmarks.json", "table": p.stdout.strip().splitlines()[-12:]}


def families(tiny: bool, device: str) -> dict:
    """One bf16 step and one generation per registered family that has a built-in shrunk model."""
    from dllm_align.generate.sampler import generate
    from dllm_align.generate.settings import SamplerSettings, encode_prompt
    from dllm_align.models.families import FAMILIES
    from dllm_align.models.load import BUILTIN_SPECS, load_model

    out = {}
    for fam in FAMILIES:
        names = [n for n, s in BUILTIN_SPECS.items() if s.family == fam and "shape" not in n]
        if not names:
            out[fam] = {"status": "no built-in shrunk model for this family"}
            continue
        name = min(names, key=lambda n: BUILTIN_SPECS[n].hidden_size)
        rec = _recipe(name, padding="none", attn="sdpa", lora=False, device=device, k=2, max_length=256, batch=2,
                      extra=("train.mixed_precision=bf16",))
        sm = _smoke(rec, 1)
        mp = load_model(name, device=device)
        ids = encode_prompt(mp.tokenizer, [{"role": "user", "content": "Sort 3 1 2"}])
        block = mp.block_size or 8  # a block-diffusion model decodes in its own blocks
        comp = generate(mp, [ids], SamplerSettings(gen_length=8, block_length=block, steps=8))[0]
        out[fam] = {"model": name, "bf16_step_seconds": sm["seconds_per_step"], "invariant_ok": sm["invariant"]["ok"],
                    "generated_tokens": len(comp.raw), "stopped": comp.stopped}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and logs/")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="built-in tiny shapes: the whole command in well under a minute on a CPU")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds after which no further part starts (default 540: 9 minutes)")
    ap.add_argument("--only", nargs="*", metavar="PART", help="run only these parts")
    a = ap.parse_args(argv)
    os.environ.setdefault("DLLM_ALIGN_NO_PROGRESS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    chk = Check(a.out, a.budget)
    chk.result.update(device=a.device, tiny=a.tiny)
    parts = [("environment", environment, a.device), ("pytest", run_pytest, a.tiny, a.device),
             ("invariants", invariants, a.tiny, a.device), ("doctor", doctor_timing, a.tiny, a.device),
             ("benchmarks", benchmarks, a.tiny, a.device, a.out), ("families", families, a.tiny, a.device)]
    for name, fn, *args in parts:
        if a.only and name not in a.only:
            continue
        chk.part(name, fn, *args)
    failed = [n for n, p in chk.result["parts"].items() if p["status"] == "failed"]
    print(json.dumps({"json": str(a.out / "gpu_check.json"), "failed": failed, "seconds": chk.result["seconds"]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
