"""One command that validates dllm-align on a GPU node inside a fixed time budget, and writes one JSON and one log.

    python benchmarks/gpu_check.py --out DIR                       # one H100: at most --budget seconds (360)
    python benchmarks/gpu_check.py --out DIR --device cpu --tiny   # the same parts on shrunk shapes (CI)

Every part runs in its own process under a hard time limit, its share of ``--budget`` (``SHARES``); a part
past its limit is killed (its whole process group) and recorded as ``timeout`` with its limit, keeping what
it had written so far; a failing part is recorded with its error; the next part always runs. Results go to
DIR/gpu_check.json (rewritten after every part), the parts' output to DIR/gpu_check.log.

* ``environment``: Python, torch, CUDA, the device, library versions, attention backends present.
* ``pytest``: the suite's ``gpu``-marked tests; then (not with ``--tiny``) ``tests/test_cli_train.py``'s bf16
  step after its fp32 runs in one process (accelerate's state carried over between tests once failed it on the
  device), and the step-0 invariant (the planted-defect tests included), same-device, fused-kernel and
  FlexAttention tests with CUDA visible.
* ``invariants``: the step-0 invariant (every margin policy - reference before the first update) through the
  training path (``doctor``'s smoke step), in bf16, on rows of real kto-mix-14k lengths (``LENGTHS``), for a
  ~1B LLaDA-shaped body under every installed attention backend (sdpa, flash_attention_2 when flash-attn is
  installed, flex_attention) and for an SDAR-shaped block-diffusion body (sdpa and flex streams attention).
* ``doctor``: an 8B LLaDA-shaped body with LoRA and activation checkpointing, 8 draws, one row per step,
  ``padding: paper`` at the median and the 95th-percentile kto-mix-14k length (``--doctor-shapes``): measured
  peak memory (loading and steps apart) against ``doctor``'s estimate for that very shape, seconds per step, and
  the epoch projected by tokens. A shape runs only where the estimate fits; running out of memory anyway is
  recorded as a finding (the command then exits 1), and the next shape runs.
* ``families``: for every registered model family's built-in shrunk model, one bf16 step and one generation.
* ``benchmarks``: ``benchmarks/run.py --quick`` (throughput against the straightforward method), as JSON. The
  benchmarks on kto-mix-14k rows (padding, throughput, packing, variance) need the split (``../shared/data``,
  ``DLLM_ALIGN_KTO_MIX_TEST``, a cached copy, or ``datasets`` and the hub); without it each is listed under
  ``skipped`` with the reason. A benchmark that raises fails the part.

Models are built directly on the device (the library's builders run under ``torch.device(DEVICE)``): random
weights, no download, nothing built on the host first. ``--tiny`` shrinks every shape to the built-in tiny
models and the lengths by 16, so that the whole command runs in about a minute on a CPU
(``tests/test_gpu_check.py``). On a GPU node install what its image lacks first (``benchmarks/gpu_wheels.sh``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))

PAPER_MINUTES = {"precompute": 37, "training": 172}  # 8x H100 80GB, FSDP full fine-tune, kto-mix-14k (the paper)
LENGTHS = HERE / "kto_mix_lengths.json"  # [prompt, completion] token counts of the 1,500 kto-mix-14k test rows
KTO_MIX_TRAIN_ROWS = 13_500

# Each part's share of --budget, in order: seconds at --budget 360, about 1.2x what each took on an H100
# (2026-11-26, torch 2.11: environment 8.2, pytest's gpu-marked run 39.0, invariants 75.9 for 5 cases, families
# 26.7, benchmarks 59.2; doctor's p50 shape 53 s with its two 8B models built). doctor's p95 shape and pytest's
# second run start only with time left for them (a larger --budget); a part must get at least MIN_PART seconds.
SHARES = {"environment": 10, "pytest": 48, "invariants": 92, "doctor": 105, "families": 33, "benchmarks": 72}
MIN_PART = 5.0
DEFAULT_BUDGET = 360.0
SECOND_PYTEST_RUN_SECONDS = 30.0  # the least time left for which pytest's second run starts

GPU_SHAPES = {  # bodies of the published layouts, random weights, the built-in models' tokenizers
    "llada-8b-shape": dict(hidden_size=4096, layers=32, heads=32, intermediate_size=12288),
    "llada-1b-shape": dict(hidden_size=2048, layers=16, heads=16, intermediate_size=5632),
    "sdar-1b-shape": dict(hidden_size=2048, layers=16, heads=16, intermediate_size=6144, family="sdar"),
}


class UsageError(Exception):
    """Bad flags: one ``Error:`` line, exit 2."""


# --------------------------------------------------------------------------- the parent: parts under hard limits
def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".probe-"):
            pass
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there ({e.strerror or e})") from None


def part_limits(budget: float, parts: list[str]) -> dict[str, float]:
    """Each part's hard limit: its share of the budget; refused when one would get under MIN_PART seconds."""
    total = sum(SHARES[p] for p in parts)
    limits = {p: budget * SHARES[p] / total for p in parts}
    short = min(limits, key=limits.get)
    if limits[short] < MIN_PART:
        need = MIN_PART * total / SHARES[short]
        raise UsageError(f"--budget {budget:g} s is too small: the {short} part would get {limits[short]:.1f} s "
                         f"(at least {MIN_PART:g} s each; give --budget {math.ceil(need)} or more)")
    return limits


class Check:
    def __init__(self, out: Path, args: argparse.Namespace):
        self.out, self.args = out, args
        self.t0 = time.monotonic()
        self.result: dict = {"started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             "device": args.device, "tiny": args.tiny, "budget_seconds": args.budget, "parts": {}}
        self.log = out / "gpu_check.log"
        self.log.write_text("", encoding="utf-8")

    def save(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.t0, 2)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str), encoding="utf-8")
        os.replace(tmp, self.out / "gpu_check.json")

    def part(self, name: str, limit: float) -> None:
        print(f"[gpu_check] {name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            res = Path(tmp) / "result.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(res), "--out", str(self.out),
                   "--device", self.args.device, "--limit", str(limit)] + (["--tiny"] if self.args.tiny else [])
            cmd += ["--doctor-shapes", *getattr(self.args, "doctor_shapes", DOCTOR_SHAPES),
                    "--pytest-runs", *getattr(self.args, "pytest_runs", PYTEST_RUNS)]
            t = time.monotonic()
            with self.log.open("a", encoding="utf-8") as log:
                log.write(f"\n===== {name} (limit {limit:.0f} s) =====\n")
                log.flush()
                # a new session: on timeout the part and everything it started go, by its process group id
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if name in ("pytest", "invariants"):  # cuBLAS's deterministic workspace for the step-0 checks
                    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
                p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log, start_new_session=True, env=env)
                try:
                    code = p.wait(timeout=limit)
                    why = None
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    code, why = None, f"killed at its {limit:.0f} s limit (its share of --budget {self.args.budget:g})"
                finally:  # this command ended from outside (SIGTERM, Ctrl-C): the part goes with it
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
            data = json.loads(res.read_text(encoding="utf-8")) if res.is_file() else {}
        seconds = round(time.monotonic() - t, 2)
        if why:
            rec = {"status": "timeout", "why": why, **data}
        elif code == 0 and data.get("status") == "ok":
            rec = data
        else:
            rec = {**data, "status": "failed", "error": data.get("error") or f"exited {code} without a result (see the log)"}
        rec.update(seconds=seconds, limit_seconds=round(limit, 1), log="gpu_check.log")
        self.result["parts"][name] = rec
        print(f"[gpu_check] {name}: {rec['status']} in {seconds} s", file=sys.stderr, flush=True)
        self.save()


# --------------------------------------------------------------------------- in a part's process
class Part:
    """A part's result file, rewritten after every finished piece (a killed part keeps what it had)."""

    def __init__(self, path: Path, limit: float):
        self.path, self.limit, self.t0 = path, limit, time.monotonic()
        self.data: dict = {"status": "running"}

    def save(self, **kw) -> None:
        self.data.update(kw)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str), encoding="utf-8")
        os.replace(tmp, self.path)

    def left(self) -> float:
        return self.limit - (time.monotonic() - self.t0)


def attention_backends(device: str) -> list[str]:
    """The attention implementations this machine trains with: sdpa always; flex_attention on CUDA (no CPU
    backward); flash_attention_2 when the flash-attn wheel is installed and a CUDA device is present."""
    import importlib.util

    out = ["sdpa"]
    if device == "cuda" and importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        out.append("flex_attention")
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        out.append("flash_attention_2")
    return out


def environment(part: Part, tiny: bool, device: str) -> dict:
    import torch

    from importlib.metadata import PackageNotFoundError, version

    versions = {}  # read from the installed metadata: importing them all takes longer than this part may
    for mod in ("torch", "transformers", "accelerate", "peft", "typer", "pydantic", "safetensors", "numpy", "datasets",
                "openai", "lm_eval", "triton", "flash_attn"):
        try:
            versions[mod] = version(mod.replace("_", "-"))
        except PackageNotFoundError:
            versions[mod] = None
    from dllm_align import __version__
    from dllm_align.models.block_attention import flex_compiles
    from dllm_align.models.load import require_transformers

    if versions["transformers"]:  # an image's older transformers: said first, by name (the one Python imports)
        import transformers

        versions["transformers"] = transformers.__version__
        require_transformers(transformers.__version__)
    env = {"python": platform.python_version(), "platform": platform.platform(), "dllm_align": __version__,
           "versions": versions, "device": device, "attention_backends": attention_backends(device),
           "flex_compiles": flex_compiles(device), "sys_path_order": _path_order(versions)}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda, bf16=torch.cuda.is_bf16_supported())
    return env


def _path_order(versions: dict) -> dict:
    """Where each library is found: carried wheels must come after the image's own site-packages."""
    import importlib.util

    out = {}
    for mod in ("torch", "transformers", "pydantic"):
        spec = importlib.util.find_spec(mod) if versions.get(mod) else None
        if spec is not None and spec.origin:
            out[mod] = str(Path(spec.origin).parent.parent)
    return out


def _env() -> dict:
    src = str(REPO / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", DLLM_ALIGN_NO_PROGRESS="1")


PYTEST_RUNS = ("gpu-marked", "accelerate-state", "invariants-and-kernels")
DOCTOR_SHAPES = ("p50", "p95")


def run_pytest(part: Part, tiny: bool, device: str, which=PYTEST_RUNS) -> dict:
    runs = [("gpu-marked", ["-m", "gpu"])]
    if not tiny:
        # the gpu-marked bf16 step that failed on the device after fp32 runs in the same process (accelerate's
        # state carried over; fixed by resetting it per test): here with those fp32 runs before it, as then
        runs.append(("accelerate-state", ["tests/test_cli_train.py", "-k", "bf16_autocast or trackers"]))
        runs.append(("invariants-and-kernels", ["tests/test_invariants.py", "tests/test_block_attention.py", "tests/test_packing.py",
                                                "-k", "step0 or same_device or within_sequences or fused or flash or flex"]))
    out = {}
    for name, args in [r for r in runs if r[0] in which]:
        if out and part.left() < SECOND_PYTEST_RUN_SECONDS:
            out[name] = {"skipped": f"{part.left():.0f} s left of the part's limit (give a larger --budget)"}
            part.save(**out)
            continue
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=max(part.left() - 2, 1))
        tail = (p.stdout + p.stderr).strip().splitlines()
        print("\n".join(tail[-60:]), file=sys.stderr)
        out[name] = {"exit_code": p.returncode, "summary": tail[-1] if tail else ""}
        part.save(**out)
        if p.returncode not in (0, 5):  # 5: no test selected (none marked gpu, say)
            raise RuntimeError(f"pytest {name} exited {p.returncode}: {out[name]['summary']}")
    return out


def _build_on(device: str) -> None:
    """The library's model builders run under ``torch.device(device)``: parameters are created and randomly
    initialised on the device, never on the host first."""
    import torch

    from dllm_align.models import load

    inner = load.build_tiny_model

    def on_device(*a, **kw):
        with torch.device(device):
            return inner(*a, **kw)

    load.build_tiny_model = on_device


def _register_shapes(tiny: bool) -> dict[str, str]:
    from dllm_align.models.load import TinySpec, add_builtin_model

    if tiny:
        return {"8b": "builtin:tiny", "1b": "builtin:small", "block": "builtin:small-sdar"}
    for name, dims in GPU_SHAPES.items():
        add_builtin_model(f"builtin:{name}", TinySpec(max_position_embeddings=8192, **dims))
    return {"8b": "builtin:llada-8b-shape", "1b": "builtin:llada-1b-shape", "block": "builtin:sdar-1b-shape"}


def read_lengths() -> list[tuple[int, int]]:
    return [tuple(r) for r in json.loads(LENGTHS.read_text(encoding="utf-8"))["rows"]]


def measure_lengths(folder: Path) -> dict:
    """The fixture's numbers, from the kto-mix-14k test split (4 characters a token, as benchmarks/padding.py)."""
    from dllm_align.data.load import load_unpaired
    from dllm_align.models.load import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    rows = load_unpaired(str(folder / "chosen.jsonl"), label=True, quiet=True) + load_unpaired(
        str(folder / "rejected.jsonl"), label=False, quiet=True)
    out = [[math.ceil(len(tok.apply_chat_template(r.prompt, tokenize=False, add_generation_prompt=True)) / 4.0),
            math.ceil(len(r.completion) / 4.0) + 1] for r in rows]
    return {"what": "token counts [prompt, completion] of the 1,500 rows of the kto-mix-14k test split (MIT), as a "
                    "characters-per-token model counts them (4 characters a token, as benchmarks/padding.py; completion "
                    "+ 1 for the end-of-turn token)",
            "how": "python benchmarks/gpu_check.py --measure-lengths ../shared/data/kto-mix-14k-test", "rows": out}


def percentile(values: list[int], q: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def write_rows(path: Path, n: int, scale: int, cap: int, seed: int = 0, length: int | None = None) -> list[int]:
    """``n`` unpaired rows whose prompt and completion lengths (in the byte-level tokenizer's tokens: one a
    character) follow the kto-mix-14k distribution (drawn with ``seed``; divided by ``scale``), each row at
    most ``cap`` tokens; with ``length``, every row that long. Returns the rows' token counts."""
    rng = random.Random(seed)
    pairs = read_lengths()
    lines, totals = [], []
    for i in range(n):
        p, c = rng.choice(pairs)
        p, c = max(p // scale, 4), max(c // scale, 2)
        if length is not None:
            p, c = max(length // 3, 4), length - max(length // 3, 4)
        over = p + c + 24 - cap  # the chat template's own tokens, and the cap
        if over > 0:
            cut = min(over, p - 4)
            p, c = p - cut, max(c - (over - cut), 2)
        lines.append(json.dumps({"id": f"g{i}", "prompt": [{"role": "user", "content": "p" * p}],
                                 "completion": [{"role": "assistant", "content": "c" * c}], "label": i % 2 == 0}))
        totals.append(p + c)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return totals


def _recipe(model: str, data: Path, *, padding: str, attn: str, lora: bool, device: str, k: int, max_length: int, batch: int,
            ckpt: bool = False, extra=()):
    from dllm_align.config.recipe import load_recipe

    sets = [f"model.name_or_path={model}", f"data.train={data}", "data.format=unpaired", f"data.padding={padding}",
            f"model.attn_implementation={attn}", f"train.lora.enabled={str(lora).lower()}",
            f"train.mixed_precision={'bf16' if device == 'cuda' else 'no'}", f"model.gradient_checkpointing={str(ckpt).lower()}",
            "reference.mode=online", f"reference.n_mc={k}", f"train.n_mc={k}", f"data.max_length={max_length}",
            f"train.batch_size={batch}", f"train.global_batch_size={batch}", *extra]
    return load_recipe("demo", sets, str(Path(tempfile.gettempdir()) / "dllm-align-gpu-check"))


def _smoke(rec, steps: int) -> dict:
    """``doctor``'s smoke steps with accelerate's process-wide state reset first (each call may use another
    mixed precision, which accelerate refuses to change in a live state)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from dllm_align.training import doctor as d
    from dllm_align.training.memory import Launch

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return d.smoke(rec, steps, Launch())
    finally:
        # the run's models sit in reference cycles until the collector runs: without this the 8B policy of one
        # doctor shape (27.9 GB) was still on the device when the next shape loaded, and that one ran out of memory
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def invariants(part: Part, tiny: bool, device: str) -> dict:
    _build_on(device)
    models = _register_shapes(tiny)
    scale, cap = (16, 256) if tiny else (1, 2048)
    data = Path(tempfile.mkdtemp(prefix="gpu-check-rows-")) / "rows.jsonl"
    lengths = write_rows(data, 16, scale, cap)
    backends = attention_backends(device)
    combos = [(models["1b"], "full fine-tune", "none", a) for a in backends] + [(models["1b"], "full fine-tune", "packed", "sdpa")]
    combos += [(models["block"], "LoRA", "none", a) for a in backends if a in ("sdpa", "flex_attention")]
    rows: list = []
    part.save(rows=rows, row_tokens={"min": min(lengths), "median": percentile(lengths, 0.5), "max": max(lengths)})
    for model, training, padding, attn in combos:
        rec = _recipe(model, data, padding=padding, attn=attn, lora=training == "LoRA", device=device, k=2,
                      max_length=cap, batch=4, ckpt=not tiny)
        row = {"model": model, "training": training, "padding": padding, "attention": attn}
        try:
            inv = _smoke(rec, 1)["invariant"]
            row.update(max_abs_margin=inv["max_abs_margin"], tolerance=inv["tolerance"], rows=inv["rows"], ok=inv["ok"],
                       worst_row=inv["worst_row"], worst_excess=inv["worst_excess"], exact=inv["exact"],
                       nondeterministic_ops=inv["nondeterministic_ops"])
        except Exception as e:  # noqa: BLE001 - one combination failing is a row, not the end
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        part.save(rows=rows)
    return {"rows": rows, "all_ok": all(r.get("ok") for r in rows)}


def doctor_timing(part: Part, tiny: bool, device: str, which=DOCTOR_SHAPES) -> dict:
    """doctor's estimate against a measurement, for the very shape measured: an 8B LLaDA-shaped body, LoRA,
    activation checkpointing, 8 draws of one row per step, padded to the median and the 95th-percentile length.
    A shape runs only where doctor's estimate says it fits; one that runs out of memory anyway is a finding
    (``findings``), not the part's end."""
    import torch

    from dllm_align.training import doctor as d
    from dllm_align.training.memory import RESERVE, Launch

    _build_on(device)
    OOM = getattr(torch, "OutOfMemoryError", MemoryError)
    model = _register_shapes(tiny)["8b"]
    pairs = read_lengths()
    totals = [min(p + c, 4096) for p, c in pairs]
    scale = 16 if tiny else 1
    k = 8
    out: dict = {"model": model, "training": "LoRA r=8 (the recipe's targets), activation checkpointing, online reference",
                 "shapes": {}}
    per_token = []
    last = None  # the previous shape's wall seconds: the next, longer one needs about 1.5x
    for q in [q for q in (0.5, 0.95) if f"p{int(q * 100)}" in which]:
        if last is not None and part.left() < 1.5 * last:
            out["shapes"][f"p{int(q * 100)}"] = {"skipped": f"{part.left():.0f} s left of the part's limit, the previous "
                                                            f"shape took {last:.0f} s (give a larger --budget)"}
            part.save(**out)
            continue
        t_shape = time.monotonic()
        length = -(-percentile(totals, q) // scale // 64) * 64  # padded to a multiple of 64
        data = Path(tempfile.mkdtemp(prefix="gpu-check-doctor-")) / "rows.jsonl"
        write_rows(data, 16, scale, length, length=length - 24)
        rec = _recipe(model, data, padding="paper", attn="sdpa", lora=True, device=device, k=k, max_length=length, batch=1,
                      ckpt=True, extra=("train.lora.r=8",))
        mem = d.memory_report(rec, Launch())
        e = mem["estimate"]
        est = e["total"]
        shape = f"{k} draws x {length} tokens, 1 row"
        name = f"p{int(q * 100)}"
        row = {"draws_x_tokens": shape, "estimate_bytes": est, "estimate_without_reserve_bytes": est - RESERVE,
               "estimate_steps_bytes": e["steps"] - RESERVE, "estimate_loading_bytes": max(e["loading"] - RESERVE, 0)}
        cap = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
        if cap is not None and est > cap:  # doctor's own verdict: does not fit
            out["shapes"][name] = {**row, "skipped": f"doctor's estimate {est / 1e9:.1f} GB does not fit {cap / 1e9:.1f} GB"}
            part.save(**out)
            continue
        try:
            sm = _smoke(rec, 2)
        except OOM as x:  # doctor said it fits, the device disagreed: a finding, and the next shape still runs
            msg = f"{shape}: out of memory where doctor's estimate ({est / 1e9:.1f} GB) fits" + (
                f" {cap / 1e9:.1f} GB" if cap else "")
            out["shapes"][name] = {**row, "out_of_memory": f"{type(x).__name__}: {x}"[:300]}
            out.setdefault("findings", []).append(msg)
            print(f"finding: {msg}", file=sys.stderr, flush=True)
            part.save(**out)
            last = time.monotonic() - t_shape
            continue
        per_token.append(sm["seconds_per_step"] / (k * length))
        row.update(seconds_per_step=sm["seconds_per_step"], peak_memory_bytes=sm["peak_memory_bytes"],
                   peak_memory_kind=sm["peak_memory_kind"], peak_memory_loading_bytes=sm.get("peak_memory_loading_bytes"),
                   peak_memory_steps_bytes=sm.get("peak_memory_steps_bytes"),
                   measured_over_estimate=sm["peak_memory_bytes"] / max(est - RESERVE, 1), invariant_ok=sm["invariant"]["ok"])
        if sm.get("peak_memory_steps_bytes"):
            row["steps_measured_over_estimate"] = sm["peak_memory_steps_bytes"] / max(e["steps"] - RESERVE, 1)
        out["shapes"][name] = row
        part.save(**out)
        last = time.monotonic() - t_shape
    if per_token:
        drawn = sum(k * min(p + c, 4096) for p, c in pairs) / len(pairs) * KTO_MIX_TRAIN_ROWS / scale
        out["projection"] = {
            "epoch_minutes_8_devices": max(per_token) * drawn / 8 / 60,
            "scales": (f"the slower measured seconds per token (LoRA, {model}, one device, {k} draws, checkpointed) x "
                       f"{KTO_MIX_TRAIN_ROWS:,} rows x {k} draws x the kto-mix-14k mean row length (each row at its own length: "
                       "padding none) / 8 devices; LoRA, not the paper's full fine-tune under FSDP"),
            "paper_minutes_full_fine_tune_8xH100": PAPER_MINUTES}
    return out


def families(part: Part, tiny: bool, device: str) -> dict:
    """One bf16 step and one generation per registered family that has a built-in shrunk model."""
    from dllm_align.generate.rules import rule_reads
    from dllm_align.generate.sampler import generate
    from dllm_align.generate.settings import SamplerSettings, encode_prompt
    from dllm_align.models.families import FAMILIES
    from dllm_align.models.load import BUILTIN_SPECS, load_model

    data = Path(tempfile.mkdtemp(prefix="gpu-check-fam-")) / "rows.jsonl"
    write_rows(data, 16, 16, 256)
    out = {}
    for fam in FAMILIES:
        names = [n for n, s in BUILTIN_SPECS.items() if s.family == fam and "shape" not in n]
        if not names:
            out[fam] = {"status": "no built-in shrunk model for this family"}
            continue
        name = min(names, key=lambda n: BUILTIN_SPECS[n].hidden_size)
        rec = _recipe(name, data, padding="none", attn="sdpa", lora=False, device=device, k=2, max_length=256, batch=2,
                      extra=("train.mixed_precision=bf16",))
        sm = _smoke(rec, 1)
        mp = load_model(name, device=device)
        ids = encode_prompt(mp.tokenizer, [{"role": "user", "content": "Sort 3 1 2"}])
        block = mp.block_size or 8  # a block-diffusion model decodes in its own blocks
        # only the keys the family's own rule reads (LLaDA2.1's rule has its own schedule and refuses `steps`)
        want = {"gen_length": 8, "block_length": block, "steps": 8}
        comp = generate(mp, [ids], SamplerSettings(**{k: v for k, v in want.items() if rule_reads(mp.family.sampler, k)}))[0]
        out[fam] = {"model": name, "bf16_step_seconds": sm["seconds_per_step"], "invariant_ok": sm["invariant"]["ok"],
                    "generated_tokens": len(comp.raw), "stopped": comp.stopped}
        part.save(**out)
    return out


def benchmarks(part: Part, tiny: bool, device: str, out: Path) -> dict:
    args = [sys.executable, str(HERE / "run.py"), "--device", device, "--json", str(out / "benchmarks.json"), "--no-assert", "--quick"]
    if tiny:
        args += ["--only", "padding"]
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=max(part.left() - 2, 1), env=_env())
    print(p.stdout[-20000:] + p.stderr[-20000:], file=sys.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"benchmarks/run.py exited {p.returncode}")
    results = json.loads((out / "benchmarks.json").read_text(encoding="utf-8"))["results"]
    # the kto-mix-14k rows (padding, throughput, packing, variance) come from ../shared/data, the
    # DLLM_ALIGN_KTO_MIX_TEST folder, a cached copy or the hub (with `datasets`): a GPU node often has none,
    # and those benchmarks say so instead of failing
    skipped = {k[: -len("_skipped")]: v for k, v in results.items() if k.endswith("_skipped")}
    errors = {k[: -len("_error")]: v for k, v in results.items() if k.endswith("_error")}
    rec = {"json": "benchmarks.json", "table": p.stdout.strip().splitlines()[-12:], "skipped": skipped}
    if errors:
        part.save(**rec)
        raise RuntimeError("benchmarks failed: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    return rec


PARTS = {"environment": environment, "pytest": run_pytest, "invariants": invariants, "doctor": doctor_timing,
         "families": families, "benchmarks": benchmarks}


def run_part(a) -> int:
    import traceback

    os.environ.update(DLLM_ALIGN_NO_PROGRESS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    part = Part(a.result, a.limit)
    try:
        extra = {"benchmarks": (a.out,), "doctor": (tuple(a.doctor_shapes),), "pytest": (tuple(a.pytest_runs),)}.get(a.part, ())
        data = PARTS[a.part](part, a.tiny, a.device, *extra) or {}
        part.save(status="ok", **data)
        return 0
    except Exception as e:  # noqa: BLE001 - a part's failure is its result
        traceback.print_exc()
        part.save(status="failed", error=f"{type(e).__name__}: {e}"[:500])
        return 1


class Parser(argparse.ArgumentParser):
    """argparse with the project's manners: a refusal is one ``Error:`` line and exit 2."""

    def error(self, message: str):
        sys.stderr.write(f"Error: {message}\nHint: see '{self.prog} --help'\n")
        sys.exit(2)


def check_args(a: argparse.Namespace) -> None:
    """The flags checked before anything runs or is written (UsageError): --out names a folder (an empty name
    would be the working folder, often this repository), the device is there, --measure-lengths is a folder."""
    if a.measure_lengths is not None:
        if not a.measure_lengths.is_dir():
            raise UsageError(f"--measure-lengths {a.measure_lengths}: not a folder (the kto-mix-14k test split's, with "
                             "chosen.jsonl and rejected.jsonl)")
        for name in ("chosen.jsonl", "rejected.jsonl"):
            if not (a.measure_lengths / name).is_file():
                raise UsageError(f"--measure-lengths {a.measure_lengths}: no {name} in it")
        return
    if a.out is None:
        raise UsageError("--out is required")
    if not str(a.out).strip() or str(a.out) in (".", "./"):
        raise UsageError(f"--out {str(a.out)!r}: name a folder for the results (not the working folder)")
    if not math.isfinite(a.budget) or a.budget <= 0:
        raise UsageError(f"--budget must be a positive number of seconds, got {a.budget:g}")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but torch sees no CUDA device (use --device cpu --tiny for the CPU run)")


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for gpu_check.json, gpu_check.log and benchmarks.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="built-in tiny shapes: the whole command in about a minute on a CPU")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                    help=f"seconds for all parts together, shared out by SHARES (default {DEFAULT_BUDGET:g})")
    ap.add_argument("--only", nargs="*", metavar="PART", choices=list(PARTS), help="run only these parts")
    ap.add_argument("--doctor-shapes", nargs="+", default=list(DOCTOR_SHAPES), choices=list(DOCTOR_SHAPES),
                    help="the doctor part's kto-mix length percentiles (default: both)")
    ap.add_argument("--pytest-runs", nargs="+", default=list(PYTEST_RUNS), choices=list(PYTEST_RUNS),
                    help="the pytest part's runs (default: both; the second is not run with --tiny)")
    ap.add_argument("--measure-lengths", type=Path, metavar="FOLDER", help="rewrite benchmarks/kto_mix_lengths.json from the kto-mix-14k test split")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.part:
        return run_part(a)
    try:
        check_args(a)
        if a.measure_lengths:
            LENGTHS.write_text(json.dumps(measure_lengths(a.measure_lengths), separators=(",", ":")), encoding="utf-8")
            return 0
        names = [n for n in PARTS if not a.only or n in a.only]
        limits = part_limits(a.budget, names)
        _check_out(a.out)
    except UsageError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` around this command ends the running part too
    chk = Check(a.out, a)
    chk.result["limits_seconds"] = {n: round(s, 1) for n, s in limits.items()}
    for name in names:
        chk.part(name, limits[name])
    bad = [n for n, p in chk.result["parts"].items() if p["status"] != "ok"]
    findings = [f"{n}: {f}" for n, p in chk.result["parts"].items() for f in p.get("findings", [])]
    print(json.dumps({"json": str(a.out / "gpu_check.json"), "not_ok": bad, "findings": findings, "seconds": chk.result["seconds"]}))
    return 1 if bad or findings else 0


if __name__ == "__main__":
    sys.exit(main())
