"""Full-size GPU benchmarks, each part planned under 9 minutes of device time, beside the straightforward method.

    python benchmarks/gpu_bench.py                          # CUDA: every part; results into benchmarks/gpu-latest.json ("bench")
    python benchmarks/gpu_bench.py --only train-8b-lora     # one group a device session (docs/benchmarks.md)
    python benchmarks/gpu_bench.py --device cpu             # the dry run: every part at small size, JSON on stdout

Parts (docs/benchmarks.md#full-size-gpu-benchmarks says what each measures and what it would take):

* ``train-1b``: a 1B LLaDA-shaped body (2048 x 16, LLaDA's vocabulary of 126,464), full fine-tune, bf16
  autocast, K = 8 draws, rows at kto-mix-14k lengths (``kto_mix_lengths.json``, the file gpu_check.py reads);
  ours (precompute, then ``train`` on the cache: length-grouped batches, padding none, the chunked head at
  masked positions) beside the straightforward method (K separate forwards, full [B, T, V] logits, random
  batches padded to their longest row: ``throughput.straightforward_train``) on the same rows and steps.
  Tokens per second (K x real tokens) and MFU: the model FLOPs per token of :func:`flops_per_token` over the
  device's dense bf16 peak.
* ``train-8b-lora``: the same for an 8B LLaDA-shaped body (4096 x 32) with LoRA r = 8 on q/k/v/o and
  activation checkpointing on both sides.
* ``sampler-b1``, ``sampler-b16``: the fast sampler (the recipe's fast settings: dual cache, threshold) against
  the exact one on the 8B-shaped body in bf16, at batch 1 and batch 16, prompts of kto-mix-14k prompt lengths
  (capped at 512 tokens), 256 tokens in blocks of 32, 256 steps; paired repeats (both samplers in turn each
  repeat: 3 at batch 1, 2 at batch 16), the median ratio and its spread.
* ``stream``: block diffusion's shared clean stream against K separate ``[x_t; x_0]`` rows at K = 8 and
  L = 2,048 tokens (``block_stream.measure``) on an SDAR-shaped body, bf16 autocast; paired repeats.

Each part runs in its own process under a hard limit (``LIMITS``, seconds; a part past it is killed and
recorded as ``timeout``). Results: ``--out FILE`` when given; else on CUDA the ``bench`` entry of
``benchmarks/gpu-latest.json`` (the rest of that file kept), with the device, torch version and command;
on the CPU (the dry run) JSON on stdout and nothing written into the repository. ``--profile`` runs each part
under torch.profiler and keeps its top operators (for a part whose fast path loses on the device).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

LATEST = HERE / "gpu-latest.json"
VOCAB = 126_464  # LLaDA's vocabulary: the head the straightforward method computes everywhere
K = 8
# Hard limits, seconds per part on one H100/H200 (the part's whole process: building the models on the device
# included), about twice the planned time (docs/benchmarks.md), so that the three groups a device session runs
# (train-8b-lora; train-1b and stream; both samplers) each stay under 9 minutes with the machine's start beside.
LIMITS = {"train-1b": 240, "train-8b-lora": 420, "sampler-b1": 180, "sampler-b16": 360, "stream": 180}
# Dense bf16 peak FLOP/s by device name (the vendors' datasheets, without sparsity); an unknown device: no MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}

SHAPES = {  # part -> (dims, LoRA, activation checkpointing, rows, rows per step)
    "train-1b": (dict(hidden_size=2048, layers=16, heads=16, intermediate_size=5632), False, False, 16, 2),
    "train-8b-lora": (dict(hidden_size=4096, layers=32, heads=32, intermediate_size=12288), True, True, 8, 1),
}
DRY = {"train-1b": dict(hidden_size=64, layers=2, heads=4, intermediate_size=128),
       "train-8b-lora": dict(hidden_size=128, layers=2, heads=4, intermediate_size=256)}
DRY_VOCAB = 4096
LORA_R = 8
LORA_TARGETS = 4  # q, k, v, o (the recipe's default targets)


class UsageError(Exception):
    """Bad flags: one ``Error:`` line, exit 2."""


# --------------------------------------------------------------------------- model FLOPs
def flops_per_token(dims: dict, vocab: int, lora: bool, attn_len: float, scored_share: float) -> dict:
    """Model FLOPs of one training token (one position of one draw), forward and backward; docs/benchmarks.md
    derives each term. Body parameters N = L (4 h^2 + 3 h i) (q, k, v, o; gate, up, down; LLaDA has as many
    key/value heads as heads). Full fine-tune: 6 N (forward 2 N, backward 4 N). LoRA: 4 N (the frozen weights'
    backward computes input gradients only) + 6 N_lora with N_lora = L x 4 targets x r (h + h). Attention:
    12 L h T (scores and weighted sum, 4 L h T forward, twice that backward; bidirectional, so all T keys).
    The head V h counts only at the positions the loss scores (``scored_share`` of the positions): 6 V h or,
    frozen under LoRA, 4 V h there. Activation checkpointing's recompute is not model FLOPs (MFU, not HFU)."""
    h, L, i = dims["hidden_size"], dims["layers"], dims["intermediate_size"]
    n_body = L * (4 * h * h + 3 * h * i)
    n_lora = L * LORA_TARGETS * LORA_R * 2 * h if lora else 0
    body = (4 if lora else 6) * n_body + 6 * n_lora
    attention = 12 * L * h * attn_len
    head = (4 if lora else 6) * vocab * h * scored_share
    return {"per_token": body + attention + head, "body": body, "attention": attention, "head": head,
            "n_body": n_body, "n_lora": n_lora, "n_head": vocab * h}


def peak_flops(device: str) -> tuple[float | None, str]:
    if device != "cuda":
        return None, "no peak on the CPU dry run"
    import torch

    name = torch.cuda.get_device_name(0)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s dense bf16 (datasheet)"
    return None, f"{name}: peak unknown (add it to PEAK_BF16)"


# --------------------------------------------------------------------------- models and rows
def _models_on(device: str, vocab: int) -> None:
    """Built-in bodies built directly on the device, with ``vocab`` output words (the built-in tokenizer's ids
    stay below 262; the head is what a real vocabulary costs)."""
    import torch

    from dllm_align.models import load

    inner = load.build_tiny_model

    def build(*a, **kw):
        with torch.device(device):
            model = inner(*a, **kw)
            model.resize_token_embeddings(vocab, mean_resizing=False)
        return model

    load.build_tiny_model = build


def _register(part: str, dry: bool) -> str:
    from dllm_align.models.load import TinySpec, add_builtin_model

    dims = DRY[part] if dry else SHAPES[part][0]
    name = f"builtin:bench-{part}"
    add_builtin_model(name, TinySpec(max_position_embeddings=8192, **dims))
    return name


def _rows(folder: Path, n: int, dry: bool) -> Path:
    import gpu_check

    path = folder / "rows.jsonl"
    gpu_check.write_rows(path, n, 16 if dry else 1, 256 if dry else 4096)
    return path


# --------------------------------------------------------------------------- training: ours beside the straightforward method
def train_part(part: str, device: str, dry: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    try:
        return _train(part, device, dry, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _train(part: str, device: str, dry: bool, root: Path) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import throughput as tp
    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.models.load import load_model
    from dllm_align.objective.draws import DrawConfig
    from dllm_align.training import cache, reference
    from dllm_align.training.policy import apply_lora
    from dllm_align.training.train import setup_run

    dims, lora, ckpt, n_rows, batch = SHAPES[part]
    if dry:
        dims, n_rows = DRY[part], 4
    vocab = DRY_VOCAB if dry else VOCAB
    _models_on(device, vocab)
    model = _register(part, dry)
    data = _rows(root, n_rows, dry)
    cap = 256 if dry else 4096
    sets = [f"model.name_or_path={model}", f"data.train={data}", "data.format=unpaired", "data.padding=none",
            "data.group_by_length=true", f"data.max_length={cap}", f"train.lora.enabled={str(lora).lower()}",
            f"train.lora.r={LORA_R}", f"model.gradient_checkpointing={str(ckpt).lower()}",
            f"train.mixed_precision={'bf16' if device == 'cuda' else repr('no')}", "reference.mode=cached",
            f"reference.cache={root / 'cache'}", f"reference.n_mc={K}", f"train.n_mc={K}", f"reference.batch_size={batch}",
            f"train.batch_size={batch}", f"train.global_batch_size={batch}", "train.log_every=1000000",
            "train.save_every=null", "train.trackers=[]", "train.lr=1e-6"]
    recipe = load_recipe(None, sets, output_dir=str(root / "run"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if device == "cuda" else "no")
    ref_mp = reference.load_reference(recipe, device)
    examples = load_training_examples(recipe, ref_mp.tokenizer, quiet=True)
    collate = make_collate(recipe, ref_mp.tokenizer)
    lengths = [e.length for e in examples]
    real = sum(lengths)
    # ours: the reference precompute, then the training loop on that cache, as precompute-ref and train run them
    rep = reference.precompute(recipe, examples, collate, acc, ref_mp)
    del ref_mp
    values = cache.ReferenceCache.open(cache.cache_dir(recipe)).lookup([e.id for e in examples], K)
    # the training loop's own step (doctor's smoke steps: no run folder, no export of an 8B model)
    run = setup_run(recipe, acc, None, examples)
    ours_s = []
    for _ in range(run.data.steps_per_epoch):
        _sync(device)
        t0 = time.perf_counter()
        run.step_once()
        _sync(device)
        ours_s.append(time.perf_counter() - t0)
    del run
    acc.free_memory()  # accelerate holds the prepared policy: an 8B fp32 copy must go before the plain one loads
    _free(device)
    # the straightforward method on the same rows, the same number of steps
    plain = load_model(model, dtype="float32", device=device).model
    if lora:
        apply_lora(plain, recipe.train.lora, None)
    if ckpt:
        plain.gradient_checkpointing_enable()
    ref = {e.id: float(v) for e, v in zip(examples, values.mean(1))}
    sf = tp.straightforward_train(plain, examples, collate, batch, DrawConfig(n_mc=K, seed=0), ref, device, recipe.train)
    del plain
    _free(device)

    per_step_tokens = K * real / max(len(ours_s), 1)  # both sides: every row once, in batches of `batch`
    def rate(secs):  # tokens per second over the steps after the first (allocator, kernel choice)
        timed = secs[1:] or secs
        return per_step_tokens / statistics.median(timed)

    completion = sum(len(e.completion_ids) for e in examples)
    scored = 0.5 * completion / real  # the masking rate t ~ U(0, 1): half of the completion tokens on average
    attn_len = sum(x * x for x in lengths) / real  # a token meets its own row's T keys
    fl = flops_per_token(dims, vocab, lora, attn_len, scored)
    peak, peak_src = peak_flops(device)
    out = {"model": f"LLaDA-shaped {dims['hidden_size']} x {dims['layers']}, mlp {dims['intermediate_size']}, vocab {vocab:,}",
           "training": ("LoRA r=8 on q/k/v/o" if lora else "full fine-tune") + (", activation checkpointing" if ckpt else ""),
           "rows": len(examples), "rows_per_step": batch, "draws": K, "real_tokens": real,
           "row_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
           "flops_per_token": fl, "peak": peak_src, "precompute_seconds": rep.seconds,
           "precompute_tokens_per_s": K * real / rep.seconds if rep.seconds else None}
    for side, secs in (("ours", ours_s), ("straightforward", sf["step_seconds"])):
        r = rate(secs)
        out[side] = {"tokens_per_s": r, "step_seconds": secs, "mfu": r * fl["per_token"] / peak if peak else None}
    out["speedup"] = out["ours"]["tokens_per_s"] / out["straightforward"]["tokens_per_s"]
    return out


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the samplers
PROMPT_CAP = 512  # a padded batch of 16 prompts drawn from the heavy tail (p95 1,585) would not fit a part's time


def sampler_part(batch: int, device: str, dry: bool) -> dict:
    """Exact and fast sampling of ``batch`` prompts of kto-mix-14k prompt lengths (capped at PROMPT_CAP), paired
    repeats: both samplers in turn each repeat; the median fast/exact ratio with its spread."""
    import random

    import torch

    import gpu_check
    from paired import spread
    from dllm_align.config.schema import FAST_CACHE, FAST_THRESHOLD
    from dllm_align.generate.sampler import generate_batch
    from dllm_align.generate.settings import SamplerSettings
    from dllm_align.models.load import load_model

    _models_on(device, DRY_VOCAB if dry else VOCAB)
    name = _register("train-8b-lora", dry)
    mp = load_model(name, dtype="bfloat16" if device == "cuda" else "float32", device=device)
    mp.model.eval()
    gen, block = (32, 8) if dry else (256, 32)
    repeats = 2 if dry or batch > 1 else 3
    exact = SamplerSettings(gen_length=gen, block_length=block, steps=gen)
    fast = SamplerSettings(gen_length=gen, block_length=block, steps=gen, cache=FAST_CACHE, threshold=FAST_THRESHOLD)
    rng = random.Random(0)
    lengths = [p for p, _ in gpu_check.read_lengths()]
    text_ids = list(range(32, 127))  # printable bytes of the built-in tokenizer

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    out = {"model": f"LLaDA-shaped {mp.model.config.hidden_size} x {mp.model.config.num_hidden_layers}, "
                    f"{'bf16' if device == 'cuda' else 'fp32'}, random weights",
           "settings": {"gen_length": gen, "block_length": block, "steps": gen, "fast": f"cache={FAST_CACHE}, threshold={FAST_THRESHOLD}"}}
    generate_batch(mp, [[65] * 8], SamplerSettings(gen_length=block, block_length=block, steps=2), stop_early=False)  # warm-up
    prompt_lens = [min(PROMPT_CAP, max(4, rng.choice(lengths) // (16 if dry else 1))) for _ in range(batch)]
    prompts = [[rng.choice(text_ids) for _ in range(n)] for n in prompt_lens]
    secs = {"exact": [], "fast": []}
    toks = {}
    for _ in range(repeats):  # paired: both samplers in turn each repeat
        for side, st in (("exact", exact), ("fast", fast)):
            sync()
            t0 = time.perf_counter()
            res = generate_batch(mp, prompts, st, stop_early=False)
            sync()
            secs[side].append(time.perf_counter() - t0)
            toks[side] = [c.raw for c in res]
    agree = sum(a == b for x, y in zip(toks["exact"], toks["fast"]) for a, b in zip(x, y)) / (gen * batch)
    out.update(batch=batch, prompt_tokens={"min": min(prompt_lens), "median": statistics.median(prompt_lens),
                                           "max": max(prompt_lens), "cap": PROMPT_CAP},
               exact_tokens_per_s=gen * batch / statistics.median(secs["exact"]),
               fast_tokens_per_s=gen * batch / statistics.median(secs["fast"]),
               fast_over_exact=spread([e / f for e, f in zip(secs["exact"], secs["fast"])]),
               agreement_with_exact=agree, seconds=secs)
    return out


# --------------------------------------------------------------------------- the shared clean stream
def stream_part(device: str, dry: bool) -> dict:
    import block_stream

    if dry:
        return block_stream.measure(device, 64, 128, 1, 32, 2, 2)
    # an SDAR-1.7B-shaped body (2048 wide, 16 heads, 8 key/value heads), 8 of its layers; L = 2,048, K = 8
    return block_stream.measure(device, 2048, 6144, 8, 2048, 2, 3, heads=16, kv_heads=8, vocab=4096)


PARTS = {"train-1b": lambda d, dry: train_part("train-1b", d, dry),
         "train-8b-lora": lambda d, dry: train_part("train-8b-lora", d, dry),
         "sampler-b1": lambda d, dry: sampler_part(1, d, dry), "sampler-b16": lambda d, dry: sampler_part(16, d, dry),
         "stream": stream_part}


# --------------------------------------------------------------------------- the parent: parts under hard limits
def run_part(name: str, device: str, dry: bool, result: Path, profile: bool = False) -> int:
    import traceback

    os.environ.update(DLLM_ALIGN_NO_PROGRESS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        if profile:
            data = {"status": "ok", **_profiled(PARTS[name], device, dry)}
        else:
            data = {"status": "ok", **PARTS[name](device, dry)}
        code = 0
    except Exception as e:  # noqa: BLE001 - a part's failure is its result
        traceback.print_exc()
        data, code = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:500]}, 1
    result.write_text(json.dumps(data, default=str), encoding="utf-8")
    return code


def _profiled(fn, device: str, dry: bool) -> dict:
    """The part under torch.profiler: its result with the operators that took the most time (device time on
    CUDA), the first thing to read where a fast path loses (launch overhead, a copy, a kernel a shape falls off)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        out = fn(device, dry)
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    out["profile"] = {"sorted_by": key, "top": table.splitlines()}
    if device == "cuda":
        out["profile"]["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def run_parts(names: list[str], device: str, dry: bool, profile: bool = False) -> dict:
    out = {}
    for name in names:
        limit = LIMITS[name]
        print(f"[gpu_bench] {name} (limit {limit} s) ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="gpu-bench-part-") as tmp:
            res = Path(tmp) / "result.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(res), "--device", device]
            cmd += ["--profile"] if profile else []
            t = time.monotonic()
            p = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=sys.stderr,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
            try:
                p.wait(timeout=limit)
                rec = json.loads(res.read_text(encoding="utf-8")) if res.is_file() else {
                    "status": "failed", "error": f"exited {p.returncode} without a result"}
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rec = {"status": "timeout", "why": f"killed at its {limit} s limit"}
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        rec["seconds"] = round(time.monotonic() - t, 1)
        print(f"[gpu_bench] {name}: {rec['status']} in {rec['seconds']} s", file=sys.stderr, flush=True)
        out[name] = rec
    return out


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(), "device": device}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda: full size; cpu: the dry run at small size (every part, about a minute)")
    ap.add_argument("--only", nargs="+", metavar="PART", choices=list(PARTS), help="run only these parts")
    ap.add_argument("--out", type=Path, metavar="FILE",
                    help="write the JSON here (default: on CUDA the 'bench' entry of benchmarks/gpu-latest.json; "
                         "on the CPU stdout only)")
    ap.add_argument("--profile", action="store_true",
                    help="run each part under torch.profiler and keep its top operators in the JSON (slower: for a "
                         "part whose fast path loses)")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    dry = a.device == "cpu"
    if a.part:
        return run_part(a.part, a.device, dry, a.result, a.profile)
    try:
        if a.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError("--device cuda, but torch sees no CUDA device (--device cpu runs the dry run)")
        if a.out is not None and not a.out.parent.is_dir():
            raise UsageError(f"--out {a.out}: no folder {a.out.parent}")
    except UsageError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    names = [n for n in PARTS if not a.only or n in a.only]
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t = time.monotonic()
    parts = run_parts(names, a.device, dry, a.profile)
    record = {"what": "benchmarks/gpu_bench.py" + (" (dry run: small shapes on the CPU)" if dry else ""),
              "command": "python benchmarks/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": started, "seconds": round(time.monotonic() - t, 1), "environment": environment(a.device),
              "parts": parts}
    text = json.dumps(record, indent=1, default=str)
    if a.out is not None:
        _atomic(a.out, text)
    elif a.device == "cuda":  # the repository's record of the device: this entry replaced, the rest kept
        latest = json.loads(LATEST.read_text(encoding="utf-8")) if LATEST.is_file() else {}
        bench = latest.setdefault("bench", {"what": "benchmarks/gpu_bench.py: each part's latest run on the device"})
        for name, rec in parts.items():  # a part run alone replaces only its own entry
            bench.setdefault("parts", {})[name] = {**rec, "command": record["command"], "started": started,
                                                   "environment": record["environment"]}
        _atomic(LATEST, json.dumps(latest, indent=1, default=str))
    print(text)
    return 0 if all(p["status"] == "ok" for p in parts.values()) else 1


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
