"""``dllm-align doctor``: the preflight a user runs on the node before a multi-hour job.

Three parts, each a function returning plain data (the CLI prints it):

* :func:`environment` - devices, bf16, attention backends, NCCL, free disk
  for the cache and checkpoints (sized from the recipe), host RAM for loading;
* :func:`memory_report` - the per-device estimate of :mod:`dllm_align.training.memory`
  from ``config.json`` alone, and a verdict against the device's memory;
* :func:`smoke` - N real optimiser steps on the real model and data, in a
  temporary folder (nothing is written in the run folder): the step-0
  invariant against the cache (or the online reference when there is no
  cache yet), peak memory, seconds per step, and the whole recipe's
  precompute, epoch and generation time extrapolated from them.

Tolerance of the invariant (docs/benchmarks.md#the-step-0-check): exact where the reference ran the policy's
forward shapes, measured where it did not.

* Same shapes: precompute scores every training row in the micro-batch, row order and call layout training
  uses at epoch 0 (:func:`dllm_align.training.reference.micro_batch_groups`), and the online reference runs on
  the very micro-batch the policy does. The policy and the reference then run the same kernels on the same
  operands (the reference's bf16 Linear weights are autocast's own rounding of the policy's), so every
  bf16 value is the same on both sides. On the CPU that makes every margin exactly 0
  (``tests/test_invariants_real.py``), and 0 is the tolerance. On CUDA the check runs with
  ``torch.use_deterministic_algorithms`` (warnings only: an op without a deterministic kernel is recorded, not
  refused; cuBLAS is recorded too unless ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` was set before the process's
  first matmul, as gpu_check.py sets it), and what may still differ is the order in which a row's fp32
  log-probabilities are summed (``index_add``'s atomics): a row allows :func:`summation_tolerance`,
  ``8 u sqrt(n) |B_ref|`` with u = 2^-24 and n its completion tokens: every term is a log-probability times a
  positive weight, so ``sum |terms| = |B|``, and two orders of an n-term fp32 sum differ by at most
  ``2 lambda sqrt(n) u sum |terms|`` with probability ``1 - 4 exp(-lambda^2 / 2)`` (lambda = 4, Higham and
  Mary's probabilistic bound). That is 2.5e-5 |B| at 1,000 tokens: a precision
  defect (bf16 rotary frequencies, a tied head rounded in the reference only) moves every token's
  log-probability by bf16-sized amounts and fails it.
* A cache computed in other micro-batches (``train.batch_size``, ``train.rows_per_forward``, the draws or the
  plan differ): rows met other batch-mates, so bf16 kernels rounded them differently (up to ~0.07 nats per
  draw on the CPU). The check then measures that rounding on this backend: it scores each checked row's
  policy ELBO again alone and allows 4 x the largest |batch - alone| difference (a row's own summation
  bound where larger). This tolerance cannot tell a small precision defect from rounding; the note says
  to run precompute-ref with the recipe for the exact check.

How many rows: at least :data:`INVARIANT_ROWS` rows and two global steps (each
of at least one micro-batch), so that rows of different widths and different
packed row-mates are checked: a composition difference rounds every scored
log-probability of a row whose forward is shaped unlike the cache's, so it
shows on every such row (on 16 real rows, scoring the reference longest first
instead of in training's micro-batches gives a nonzero margin on 16 of 16 in bf16).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import threading
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.data.load import load_prompts
from dllm_align.models.families import family_for_config
from dllm_align.models.load import BUILTIN_SPECS
from dllm_align.objective.base import objective_for
from dllm_align.training.cache import cache_dir, composition, dataset_digest
from dllm_align.training.distributed import make_accelerator
from dllm_align.training.host import HostRam, host_loading, host_precompute, merged_bytes
from dllm_align.training.loop import invariant_margins, invariant_values
from dllm_align.training.memory import GiB, Launch, advice, estimate, model_shape, precompute_estimate
from dllm_align.training.train import setup_run

# lazy imports: resource: POSIX only; the peak-memory line
# lazy imports: torch.nn.attention: probed inside a try (the report says whether this torch has FlexAttention)

H100_BYTES = 81559 * 1024**2  # what torch reports for an 80 GB H100


def _host_ram() -> tuple[Optional[int], Optional[int]]:
    """(total, available) bytes from /proc/meminfo (None where it cannot be read)."""
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
        return info.get("MemTotal"), info.get("MemAvailable")
    except (OSError, ValueError):
        return None, None


def _free_disk(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def environment(recipe, launch: Launch, shape) -> dict:
    """Devices, bf16, attention backends, NCCL, disk and host RAM against what the recipe needs."""
    env: dict = {"torch": torch.__version__}
    cuda = torch.cuda.is_available()
    devices = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            devices.append({"index": i, "name": torch.cuda.get_device_name(i), "total_bytes": total, "free_bytes": free})
    env["cuda"] = cuda
    env["devices"] = devices
    env["bf16"] = bool(cuda and torch.cuda.is_bf16_supported()) if cuda else "cpu autocast only (slow)"
    backends = {"sdpa": True, "eager": True}
    backends["flash_attention_2"] = importlib.util.find_spec("flash_attn") is not None and cuda
    try:
        from torch.nn.attention import flex_attention  # noqa: F401

        backends["flex_attention"] = True
    except ImportError:
        backends["flex_attention"] = False
    env["attention_backends"] = backends
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if (nccl and cuda) else (bool(nccl) or "not available")

    # disk: checkpoints (what trains and its optimizer state) and the final export; the cache is tiny
    disk = disk_needed(recipe, shape)
    need_out = disk["bytes"]
    out = Path(recipe.output_dir)
    env["disk"] = {
        "output_dir": str(out),
        "free_bytes": _free_disk(out),
        "needed_bytes": need_out,
        "why": disk["why"],
        "cache": str(cache_dir(recipe)),
        "cache_free_bytes": _free_disk(cache_dir(recipe)),
        "cache_bytes_per_10k_rows": 10_000 * (4 * recipe.reference.n_mc + 48),
    }
    total, avail = _host_ram()
    ram = host_ram_needed(recipe, launch, shape)
    env["host_ram"] = {
        "total_bytes": total, "available_bytes": avail, "needed_bytes": ram.per_node,
        "per_process_bytes": ram.per_process, "sharded_read": ram.sharded_read, "why": ram.why,
    }
    problems = []
    if env["disk"]["free_bytes"] < need_out:
        problems.append(f"disk: {out} has {env['disk']['free_bytes'] / 1e9:.1f} GB free, the run needs ~{need_out / 1e9:.1f} GB")
    if avail is not None and avail < ram.per_node:
        fit = avail // max(ram.per_process, 1)
        fam = family_for_config(shape.config) if shape.config else None
        how = ("; an FSDP2 launch reads each process's shard only (recipes/accelerate/fsdp_8gpu.yaml)"
               if not ram.sharded_read and (fam is None or fam.reads_by_name) else "")
        if ram.per_node > ram.per_process * ram.processes_per_node:  # the final export is the larger moment
            why = "final/'s model gathered on the main process; a LoRA run with merge_on_export false gathers none"
        else:
            why = f"{ram.processes_per_node} process(es) x {ram.per_process / 1e9:.1f} GB: {fit} per node would fit{how}"
        problems.append(f"host RAM: {avail / 1e9:.1f} GB available, the run needs ~{ram.per_node / 1e9:.1f} GB ({why})")
    if objective_for(recipe.train).needs_reference and recipe.reference.mode == "cached":
        pre = host_ram_precompute(recipe, launch, shape)
        env["host_ram_precompute"] = {"needed_bytes": pre.per_node, "per_process_bytes": pre.per_process,
                                      "sharded_read": pre.sharded_read, "why": pre.why}
        if avail is not None and avail < pre.per_node:
            problems.append(f"host RAM: {avail / 1e9:.1f} GB available, precompute-ref needs ~{pre.per_node / 1e9:.1f} GB "
                            f"({pre.processes_per_node} process(es) x {pre.per_process / 1e9:.1f} GB)")
    att = recipe.model.attn_implementation
    if att and not backends.get(att, False):
        problems.append(f"model.attn_implementation: {att} is not available here")
    env["problems"] = problems
    return env


def disk_needed(recipe, shape) -> dict:
    """Bytes the run folder needs (``bytes``) and how they are counted (``why``), as the checkpoints are written
    (:mod:`dllm_align.training.checkpoint`): a LoRA checkpoint holds the adapters (fp32) and their AdamW moments, a
    full fine-tune's the weights at their dtype and the moments; keep_checkpoints of them plus the one being written;
    final/ the adapters and, with merge_on_export, the merged model at the weights' dtype."""
    t = recipe.train
    P = shape.params
    w = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    n_ckpt = (t.keep_checkpoints + 1) if t.save_every else 0  # the kept ones + the one being written
    if t.lora.enabled:
        T = shape.lora_params(t.lora.r, list(t.lora.target_modules))
        ckpt, what = T * 4 + T * 8, f"LoRA adapters {T * 4 / 1e9:.2f} GB (T x 4) + AdamW {T * 8 / 1e9:.2f} GB (T x 8)"
        m = merged_bytes(recipe)
        merged = P * m if t.lora.merge_on_export else 0
        final = T * 4 + merged
        fwhy = (f"adapters {T * 4 / 1e9:.2f} GB" + (f" + merged model {merged / 1e9:.1f} GB (P x {m}; "
                f"train.lora.merge_on_export, merged_dtype {t.lora.merged_dtype})" if merged
                else " (train.lora.merge_on_export false: no merged model)"))
    else:
        ckpt, what = P * w + P * 8, f"weights {P * w / 1e9:.1f} GB (P x {w}) + AdamW {P * 8 / 1e9:.1f} GB (P x 8)"
        final, fwhy = P * w, f"model {P * w / 1e9:.1f} GB (P x {w})"
    return {"bytes": n_ckpt * ckpt + final,
            "why": f"{n_ckpt} checkpoint(s) x {ckpt / 1e9:.2f} GB ({what}; keep_checkpoints + the one being written) "
                   f"+ final/ {final / 1e9:.2f} GB ({fwhy})"}


def host_ram_needed(recipe, launch: Launch, shape) -> HostRam:
    """Host memory a node needs while the run loads (:func:`dllm_align.training.memory.host_loading`)."""
    gpu = torch.cuda.is_available() or launch.source != Launch().source
    fam = family_for_config(shape.config) if shape.config else None
    return host_loading(shape, recipe, launch, reads_by_name=fam is None or fam.reads_by_name,
                        has_files=recipe.model.name_or_path not in BUILTIN_SPECS, gpu=gpu)


def host_ram_precompute(recipe, launch: Launch, shape) -> HostRam:
    """Host memory a node needs while ``precompute-ref`` loads the reference (:func:`host_precompute`)."""
    return host_precompute(shape, recipe, launch, gpu=torch.cuda.is_available() or launch.source != Launch().source)


def device_capacity(launch: Launch, gpu_memory_gb: Optional[float]) -> tuple[int, str]:
    """Bytes one device offers, and where the figure comes from."""
    if gpu_memory_gb:
        return int(gpu_memory_gb * 1e9), "--gpu-memory"
    if torch.cuda.is_available():
        return min(torch.cuda.mem_get_info(i)[1] for i in range(torch.cuda.device_count())), "this machine's smallest GPU"
    if launch.source != Launch().source:  # a GPU launch config read on a machine without GPUs
        return H100_BYTES, "assumed: an 80 GB H100 (no GPU here; pass --gpu-memory)"
    total, avail = _host_ram()
    return (avail or total or 0), "host RAM available (CPU run)"


def memory_report(recipe, launch: Launch, gpu_memory_gb: Optional[float] = None, shape=None) -> dict:
    shape = shape or model_shape(recipe)
    # train.mixed_precision decides (auto: bf16 on CUDA); a GPU launch config counts as CUDA
    gpu = torch.cuda.is_available() or launch.source != Launch().source
    mode = recipe.train.mixed_precision
    autocast = mode in ("bf16", "fp16") or (mode == "auto" and gpu)
    est = estimate(shape, recipe, launch, autocast)
    cap, cap_src = device_capacity(launch, gpu_memory_gb)
    fits = est.total <= cap
    pre = None
    if objective_for(recipe.train).needs_reference and recipe.reference.mode == "cached":
        pre = precompute_estimate(shape, recipe, launch, autocast)
        pre["fits"] = pre["total"] <= cap
    return {
        "precompute": pre,
        "model": {"source": shape.source, "params": shape.params, "trainable": est.trainable,
                  "hidden": shape.hidden, "layers": shape.layers, "vocab": shape.vocab},
        "launch": {"source": launch.source, "type": launch.distributed_type, "processes": launch.processes,
                   "machines": launch.machines,
                   "fsdp_version": launch.fsdp_version if launch.fsdp else None,
                   "activation_checkpointing": est.checkpointing, "autocast_bf16": autocast},
        "tokens_per_forward": est.tokens,
        "estimate": est.as_json(),
        "capacity_bytes": cap,
        "capacity_source": cap_src,
        "fits": fits,
        "verdict": "fits" if fits else "does not fit",
        "advice": [] if fits else advice(est, shape, recipe, launch, cap),
    }


INVARIANT_ROWS = 16


SUM_LAMBDA = 4.0  # the probabilistic summation bound's confidence parameter (module docstring)
COMPOSITION_FACTOR = 4.0  # a cache from other micro-batches: this many times the measured batch-vs-alone spread


def summation_tolerance(reference: float, completion_tokens: int) -> float:
    """The largest |margin| two fp32 summation orders of one row's ELBO may give (module docstring)."""
    return 2 * SUM_LAMBDA * 2.0**-24 * math.sqrt(max(completion_tokens, 1)) * abs(reference)


def row_tolerance(device: torch.device, same_shapes: bool, reference: float, completion_tokens: int,
                  composition_spread: Optional[float] = None) -> float:
    """The largest |margin| the step-0 check accepts on one row: 0 on the CPU when the reference ran the
    policy's forward shapes; else the summation bound, widened to the measured composition spread when the
    reference came from other micro-batches (module docstring)."""
    if device.type == "cpu" and same_shapes:
        return 0.0
    tol = summation_tolerance(reference, completion_tokens)
    if not same_shapes and composition_spread is not None:
        tol = max(tol, COMPOSITION_FACTOR * composition_spread)
    return tol


@contextlib.contextmanager
def deterministic_kernels(device: torch.device):
    """Deterministic algorithms for the check's forwards on CUDA (the CPU's already are); yields the list of
    warnings torch raised for ops without a deterministic kernel (warn_only: the check still runs)."""
    if device.type != "cuda":
        yield []
        return
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield caught
        finally:
            torch.use_deterministic_algorithms(was, warn_only=was_warn)


@torch.no_grad()
def composition_spread(run, steps: int) -> float:
    """The largest |B_policy in its micro-batch - B_policy scored alone| over the checked rows: how much this
    backend's rounding moves a row when its batch-mates change."""
    worst = 0.0
    for step in range(steps):
        for units in run.data.micro_batches(step, run.plan):
            together = run.policy_elbo(run.to_device(run.collate_units(units))).float()
            alone = torch.cat([run.policy_elbo(run.to_device(run.collate_units([u]))).float() for u in units])
            worst = max(worst, float((together - alone).abs().max()))
    return worst


def step0_check(run, steps: int, same_shapes: bool) -> dict:
    """The step-0 invariant on this process's rows of global steps 0..steps-1: every margin within its row's
    tolerance (:func:`row_tolerance`). Returns the worst row (by |margin| / tolerance), the largest |margin|,
    whether it held, and on CUDA the ops torch found no deterministic kernel for."""
    device = run.plan.device
    with deterministic_kernels(device) as caught:
        values = invariant_values(run, steps)
        spread = None if same_shapes else composition_spread(run, steps)
    rows = []
    for rid, (pol, ref, n) in values.items():
        m = pol - ref
        rows.append({"id": rid, "margin": m, "reference": ref, "completion_tokens": n,
                     "tolerance": row_tolerance(device, same_shapes, ref, n, spread)})

    def excess(r):  # over 1: the row fails
        return abs(r["margin"]) / r["tolerance"] if r["tolerance"] > 0 else (math.inf if r["margin"] else 0.0)

    worst = max(rows, key=excess, default=None)
    return {"margins": {r["id"]: r["margin"] for r in rows},
            "max_abs_margin": max((abs(r["margin"]) for r in rows), default=0.0),
            "worst": worst, "worst_excess": excess(worst) if worst else 0.0,
            "composition_spread": spread,
            "exact": device.type == "cpu" and same_shapes,
            "nondeterministic_ops": sorted({str(w.message).splitlines()[0][:200] for w in caught})}


def _rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _smoke_recipe(recipe, tmp: Path):
    """The recipe the smoke runs: into ``tmp``, no checkpoints or trackers, against the online reference when no
    cache is built yet. Returns (recipe, reference mode, a note or None)."""
    cache = cache_dir(recipe)
    mode = recipe.reference.mode
    note = None
    if mode == "cached" and not (cache / "manifest.json").exists():
        mode, note = "online", f"no reference cache at {cache} yet: checked against the online reference"
    sets = {"output_dir": str(tmp)}
    rec = recipe.model_copy(update=sets)
    rec = rec.model_copy(update={
        "reference": recipe.reference.model_copy(update={"mode": mode, "cache": str(cache)}),
        "train": recipe.train.model_copy(update={"save_every": None, "trackers": []}),
    })
    return rec, mode, note


def smoke(recipe, steps: int, launch: Launch) -> dict:
    """N real optimiser steps in a temporary folder; the step-0 invariant; timings and extrapolations."""
    _remove_stale_smoke_folders()
    tmp = Path(tempfile.mkdtemp(prefix=f"{SMOKE_PREFIX}{os.getpid()}-"))
    # SIGTERM (a scheduler's time limit) ends the smoke through its `finally`, so the folder goes too;
    # a SIGKILL's folder is removed by the next doctor run (the pid in its name is gone by then).
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is not None:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        rec, mode, note = _smoke_recipe(recipe, tmp)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = _rss()
        acc = make_accelerator(rec)
        torch.manual_seed(rec.train.seed)
        run = setup_run(rec, acc)
        plan, data = run.plan, run.data
        load_peak = None
        if cuda:  # loading's peak (the reference is cast after it loads) apart from the steps'
            load_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        step_rows = plan.global_batch * plan.objective.rows_per_unit
        check_steps = max(1, min(max(2, math.ceil(INVARIANT_ROWS / step_rows)), data.steps_per_epoch))
        cache = run.reference.cache if run.reference is not None else None
        same_shapes, shapes_note = _same_composition(rec, data.examples, cache, mode)
        check = step0_check(run, check_steps, same_shapes)
        t0 = time.perf_counter()
        invariant_margins(run, 1)  # again, warm: the timing behind the precompute and generation figures
        fwd_s = time.perf_counter() - t0  # policy forward (+ online reference) of one global step, no grad
        worst, excess = check["max_abs_margin"], check["worst_excess"]
        if plan.world > 1:
            w = torch.tensor([worst, min(excess, 1e30)], dtype=torch.float64, device=acc.device)
            torch.distributed.all_reduce(w, op=torch.distributed.ReduceOp.MAX)
            worst, excess = (float(x) for x in w)
        row = check["worst"] or {}
        if shapes_note:
            note = f"{note}; {shapes_note}" if note else shapes_note
        times = []
        for _ in range(steps):
            s0 = time.perf_counter()
            run.step_once()
            times.append(time.perf_counter() - s0)
            if acc.is_main_process:
                info(f"doctor: smoke step {len(times)}/{steps}: {times[-1]:.2f} s")
        step_peak = torch.cuda.max_memory_allocated() if cuda else None
        peak = max(load_peak, step_peak) if cuda else max(_peak_rss() - base, 0)
        per_step = statistics.median(times[1:] or times)  # the first step is warm-up
        rows_per_step = step_rows
        n_rows = sum(len(u) for u in data.units)
        K_ref, k = rec.reference.n_mc, plan.k
        # precompute: one no-grad forward per row at K_ref draws, spread over the processes
        ref_factor = 1.0 if mode == "cached" else 0.5  # an online step ran the policy and the reference
        per_row_fwd = fwd_s * ref_factor / rows_per_step * plan.world
        precompute_s = n_rows * per_row_fwd * (K_ref / k) / plan.world
        gen = rec.generate
        gen_per_prompt = per_row_fwd / k * gen.steps * (gen.gen_length + rec.data.max_length) / max(rec.data.max_length, 1)
        n_prompts = _count_prompts(rec)
        return {
            "steps": steps,
            "processes": plan.world,
            "invariant": {"rows": len(check["margins"]) * plan.world, "steps_checked": check_steps, "max_abs_margin": worst,
                          # this process's worst row by |margin| / tolerance, and that ratio over every process
                          "worst_row": row, "tolerance": row.get("tolerance", 0.0),
                          "worst_excess": None if excess >= 1e30 else excess,  # None: a nonzero margin where 0 is allowed
                          "exact": check["exact"], "composition_spread": check["composition_spread"],
                          "nondeterministic_ops": check["nondeterministic_ops"], "same_shapes": same_shapes,
                          "reference": mode, "ok": excess <= 1.0, "note": note},
            "peak_memory_bytes": peak,
            "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "process RSS growth (peak - before loading)",
            "peak_memory_loading_bytes": load_peak,  # CUDA only: the policy and reference loaded
            "peak_memory_steps_bytes": step_peak,  # CUDA only: the invariant check and the steps
            "seconds_per_step": per_step,
            "step_seconds": times,
            "extrapolated": {
                "steps_per_epoch": data.steps_per_epoch,
                "total_steps": data.total,
                "epoch_seconds": data.steps_per_epoch * per_step,
                "training_seconds": data.total * per_step,
                "precompute_seconds": precompute_s if plan.objective.needs_reference else 0.0,
                "generation_prompts": n_prompts,
                "generation_seconds": (n_prompts or 0) * gen_per_prompt / plan.world,
                "how": "epoch/training: median s/step x steps; precompute: the step-0 no-grad forward per row x K_ref/K' "
                       "x rows / processes; generation: that forward x steps x (gen_length + max_length)/max_length per prompt "
                       "(no KV cache)",
            },
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


SMOKE_PREFIX = "dllm-align-doctor-"


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _remove_stale_smoke_folders() -> None:
    """Temporary smoke folders of doctor runs that were killed (their process is gone)."""
    for p in Path(tempfile.gettempdir()).glob(f"{SMOKE_PREFIX}*-*"):
        pid = p.name[len(SMOKE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def _same_composition(recipe, examples: list, cache, mode: str) -> tuple[bool, Optional[str]]:
    """Whether the reference values came from the policy's forward shapes (online: always; a cache: when
    its recorded micro-batch composition is this run's), and a note when not."""
    if mode != "cached" or cache is None:
        return True, None

    fp = cache.manifest["fingerprint"]
    was = fp.get("composition")
    now = composition(recipe)
    if was == now and fp.get("dataset") == dataset_digest(examples):
        return True, None
    if was == now:  # a subset of the cached rows (an ablation): the plan, hence the micro-batches, differ
        return False, ("the cache was made for another set of rows: training's micro-batches differ from the "
                       "cache's, so the rounding tolerance applies")
    return False, (f"the cache was computed in other micro-batches ({was} there, {now} here): rows meet other "
                   "batch-mates, so the rounding tolerance applies; run precompute-ref with this recipe for an exact check")


def _count_prompts(rec) -> Optional[int]:
    g = rec.generate
    source = rec.data.test if g.split == "test" else rec.data.train
    split = rec.data.test_split if g.split == "test" else rec.data.train_split
    if source is None:
        return None
    try:
        return len(load_prompts(source, split=split, limit=g.limit, quiet=True))
    except UserError:
        return None


def fmt_bytes(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB ({n / 1e9:.1f} GB)"


def fmt_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
