"""`dllm-align train`, top to bottom: the run folder (fresh, `--resume` or `--overwrite`) and the settings check
on resume; the setup in named steps (the plan, the policy, the data, the reference, the optimiser, the state to
continue from); the loop over optimiser steps with checkpoints, metrics and the progress bar; the final export.

Test hooks (:mod:`dllm_align.core.faults`)
    ``DLLM_ALIGN_FAULT=kill_after_step:N``, ``kill_in_checkpoint:N`` or
    ``kill_in_final`` makes the main process SIGKILL itself after optimiser
    step N, halfway through writing checkpoint N, or with ``final/`` written
    but not yet renamed into place (used by the resume tests).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from accelerate.utils import broadcast_object_list

from dllm_align.config.recipe import write_run_info
from dllm_align.core.console import info, progress, progress_enabled, warn
from dllm_align.core.errors import UserError
from dllm_align.core.io import (
    DirLock,
    JsonlAppender,
    _fsync_dir,
    atomic_write_json,
    atomic_write_text,
    disk_errors,
    fsync_tree,
    recover_jsonl,
    write_checksums,
)
from dllm_align.core.runfolder import check_shared_folder, check_training_settings
from dllm_align.data.examples import units_digest
from dllm_align.objective.base import objective_for
from dllm_align.training.cache import cache_dir
from dllm_align.training.checkpoint import (
    FINAL,
    METRICS,
    TMP_FINAL,
    RunRecord,
    TrainState,
    _clear_previous,
    export,
    load_state,
    prepare_output,
    read_state,
    save_checkpoint,
    state_dict_of,
)
from dllm_align.training.distributed import fsdp_launch_of, is_fsdp, make_accelerator
from dllm_align.training.loop import Run, load_data
from dllm_align.training.monitor import MarginWatch, TrainResult, _fault, _flat, status_line
from dllm_align.training.plan import TrainPlan, check_fsdp, make_plan, resolve_padding
from dllm_align.training.policy import load_policy, wrap_policy
from dllm_align.training.reference import open_reference


def train(
    recipe,
    *,
    resume: bool = False,
    overwrite: bool = False,
    examples: Optional[list] = None,
    accelerator=None,
    allow_changes: Sequence[str] = (),
) -> TrainResult:
    """Train the policy as the recipe says (``dllm-align train``); returns where the model went.

    ``examples`` (tokenised :class:`dllm_align.data.tokenize.Example` s) replace
    ``data.train`` when given (tests, the toy demo). ``resume`` refuses settings
    that change the results unless their keys are in ``allow_changes``.
    """
    acc = accelerator or make_accelerator(recipe)
    recipe = resolve_padding(recipe, quiet=not acc.is_main_process)  # refused before the run folder is touched
    check_fsdp(recipe, is_fsdp(acc), *fsdp_launch_of(acc))
    out = Path(recipe.output_dir)
    created = not out.exists()
    cached = recipe.reference.mode == "cached" and objective_for(recipe.train).needs_reference
    try:
        # Several nodes: rank 0 writes the run folder and every rank reads it back (a checkpoint to resume,
        # the cache): a folder on each node's own disk is refused before anything is written.
        check_shared_folder(out, "run folder")
        if cached:
            check_shared_folder(cache_dir(recipe), "reference cache", create=False)
    except UserError:
        if acc.is_main_process and created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    lock: Optional[DirLock] = None
    cache_lock: Optional[DirLock] = None
    # The main process inspects the run folder (and verifies the checkpoint to
    # resume from); every process must then agree, or fail together.
    decision: list = [None]
    if acc.is_main_process:
        try:
            lock = DirLock(out, f"another `dllm-align train` is writing to {out}").__enter__()
            if cached:
                # The cache must stay the one this run trains against: a `precompute-ref --overwrite`
                # into it is refused while the run lasts (it takes the exclusive lock).
                cdir = cache_dir(recipe)
                cache_lock = DirLock(cdir, f"the reference cache {cdir} is being rewritten by a running `dllm-align precompute-ref`",
                                     shared=True).__enter__()
            found = prepare_output(recipe, resume, overwrite)
            state = None
            if resume and found:
                state = read_state(found)
            changes = check_training_settings(recipe, out, allow_changes, state) if resume else []
            if resume:
                recover_jsonl(out / METRICS)  # cut a torn last line; refuse a damaged middle
            decision = [("ok", str(found) if found else None, changes)]
        except UserError as e:
            decision = [("error", e.message, e.hint)]
    if acc.num_processes > 1:
        broadcast_object_list(decision, from_process=0)
    try:
        if decision[0][0] == "error":
            raise UserError(decision[0][1], hint=decision[0][2])
        resume_from = Path(decision[0][1]) if decision[0][1] else None
        return _train(recipe, acc, out, resume, overwrite, resume_from, examples, decision[0][2])
    except UserError:
        # Refused before anything was written: leave no empty run folder behind.
        if acc.is_main_process and created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        for held in (cache_lock, lock):
            if held is not None:
                held.__exit__(None, None, None)


def setup_run(recipe, accelerator, resume_from: Optional[Path] = None, examples: Optional[list] = None) -> Run:
    """Everything a run needs, in order, loaded and checked before the run folder changes."""
    recipe = resolve_padding(recipe, quiet=True)
    plan = make_plan(recipe, accelerator)
    mp = load_policy(recipe, plan, accelerator, resume_from)
    data = load_data(recipe, plan, mp.tokenizer, examples, block_size=mp.block_size)
    reference = open_reference(recipe, plan, mp, data) if plan.objective.needs_reference else None
    policy = wrap_policy(mp, recipe.train, plan, accelerator)
    record = run_record(recipe, plan, data)
    window = recipe.train.margin_watch_window
    if resume_from is not None:
        state = load_state(resume_from, record, policy.optimizer, rank=plan.rank, main=plan.main, margin_window=window)
    else:
        state = TrainState(MarginWatch(window))
    run = Run(accelerator, recipe.train, plan, data, mp, policy, reference, record, state)
    if plan.main:
        announce(run)
    return run


def run_record(recipe, plan: TrainPlan, data) -> RunRecord:
    t = recipe.train
    return RunRecord(
        model=recipe.model.name_or_path, objective=plan.objective.name, total_steps=data.total,
        steps_per_epoch=data.steps_per_epoch, global_batch_size=plan.global_batch, seed=t.seed,
        group_by_length=recipe.data.group_by_length, units_digest=units_digest(data.units), world_size=plan.world,
        fsdp=plan.fsdp, lora=t.lora.enabled, recipe=recipe.model_dump(mode="json"),
    )


def announce(run: Run) -> None:
    """What the run will do, said once on the main process."""
    t, plan, data, objective = run.train, run.plan, run.data, run.plan.objective
    n_params = sum(p.numel() for p in run.policy.params)
    info(
        f"train: objective {objective.name}, {len(data.units):,} {objective.unit_name}, "
        f"global batch {plan.global_batch} ({plan.world} process(es) x {plan.accum} micro-batch(es) x {t.batch_size}), "
        f"{data.total} step(s), K={plan.k} draws, {n_params:,} trainable parameters, "
        f"mixed precision {run.accelerator.mixed_precision}"
    )
    if objective.step_legend:  # the step line's abbreviations, said once
        info(f"train: step lines show {objective.step_legend}")
    if data.dropped_per_epoch:
        info(f"train: {data.dropped_per_epoch} row(s) per epoch do not fill a global batch and are left out of that epoch")
    if plan.device.type == "cpu" and t.mixed_precision == "auto":
        info("train: bf16 autocast is off (no CUDA device: CPU bf16 is slow and changes the numbers)")


def _train(recipe, acc, out: Path, resume: bool, overwrite: bool, resume_from: Optional[Path], examples, changes=()) -> TrainResult:
    torch.manual_seed(recipe.train.seed)
    run = setup_run(recipe, acc, resume_from, examples)  # loads and checks everything before the run folder changes
    t, data, state, main = recipe.train, run.data, run.state, acc.is_main_process
    summary_path = out / FINAL / "training_summary.json"
    if resume and summary_path.exists():
        # Checked before the metrics are trimmed to the checkpoint: a finished run stays as it is.
        summary = json.loads(summary_path.read_text())
        if summary.get("steps", 0) >= data.total:
            if main:
                info(f"train: {out} already finished ({summary['steps']} steps); nothing to do")
            return TrainResult(out, out / FINAL, 0, 0.0, 0, summary.get("last_metrics") or {})
    if main:
        if not resume and overwrite:
            _clear_previous(out)
        if changes:  # let through on purpose (--allow-change): said now, and kept in the run's record
            for k, was, now in changes:
                warn(f"train: {k} changed on resume ({was!r} then, {now!r} now)")
        write_run_info(recipe, out, "train", changes=[{"key": k, "was": a, "now": b, "at_step": state.step} for k, a, b in changes])
    history: list[dict] = []
    metrics_path = out / METRICS
    if main:
        rows = recover_jsonl(metrics_path)
        keep = [r for r in rows if r.get("step", 0) <= state.step]  # steps after the checkpoint are redone
        if len(keep) != len(rows):
            atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        history = keep
    if acc.log_with:
        acc.init_trackers(recipe.name, config=_flat(recipe.model_dump(mode="json")))

    def checkpoint() -> Path:
        return save_checkpoint(out, run.saver, run.policy.optimizer, run.record, state, history, t.lora, t.keep_checkpoints)

    last_ckpt = resume_from
    appender = JsonlAppender(metrics_path) if main else None
    start_step = state.step
    t_run = time.perf_counter()
    step_examples = run.plan.global_batch * run.plan.objective.rows_per_unit
    try:
        # -- the steps
        with progress(f"train ({t.objective})", total=data.total if main else None, unit="step") as bar:
            if start_step:
                bar.advance(0)
            while state.step < data.total:
                t0 = time.perf_counter()
                lr, m, grad_norm = run.step_once(last_ckpt)
                dt = time.perf_counter() - t0
                state.elapsed += dt
                state.examples_seen += step_examples
                state.tokens_seen += m["tokens"]
                row = {
                    "step": state.step,
                    "epoch": round(state.step / data.steps_per_epoch, 4),
                    **{k: m[k] for k in run.plan.objective.metric_names},
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": m["tokens"] / dt,
                    "examples_per_s": step_examples / dt,
                    "seconds": dt,
                }
                history.append(row)
                if main:
                    appender.write(row)
                    line = status_line(run.plan.objective.status(m), lr, row["tokens_per_s"])
                    bar.advance(1, status=line)
                    if state.step % t.log_every == 0 and not _bar_on():
                        info(f"step {state.step}/{data.total}: " + line)
                    msg = state.margin_watch.add(state.step, run.plan.objective.watched_margin(m))
                    if msg:
                        warn(msg)
                if acc.log_with and state.step % t.log_every == 0:
                    acc.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and v is not None}, step=state.step)
                if main:
                    _fault("kill_after_step", state.step)
                if t.save_every and state.step % t.save_every == 0 and state.step < data.total:
                    last_ckpt = checkpoint()
        # -- the final export
        seconds = time.perf_counter() - t_run
        n_steps = state.step - start_step
        export_final(run, out, {
            "objective": t.objective,
            "steps": state.step,
            "steps_this_session": n_steps,
            "seconds": seconds,
            "steps_per_s": n_steps / seconds if seconds > 0 else None,
            "examples": n_steps * step_examples,
            "examples_per_s": n_steps * step_examples / seconds if seconds > 0 else None,
            "global_batch_size": run.plan.global_batch,
            "processes": run.plan.world,
            "last_metrics": history[-1] if history else None,
        })
        if t.save_every and state.step % t.save_every == 0:
            checkpoint()
        acc.wait_for_everyone()
    finally:
        if appender is not None:
            appender.close()
        if acc.log_with:
            acc.end_training()
    return TrainResult(out, out / FINAL, n_steps, seconds, n_steps * step_examples, history[-1] if history else {})


def export_final(run: Run, out: Path, summary: dict) -> None:
    """``final/``: the model (LoRA merged, or the adapter) and tokenizer with ``training_summary.json``, written to a
    temporary folder, checksummed and renamed into place (every process takes part: FSDP gathers)."""
    final, tmp = out / FINAL, out / TMP_FINAL
    main = run.plan.main
    if main and tmp.exists():
        shutil.rmtree(tmp)
    run.accelerator.wait_for_everyone()
    sd = state_dict_of(run.saver)
    if not main:
        return
    with disk_errors(final, "write the final model"):
        export(run.saver, tmp, sd, run.train.lora, run.record.model, final=True, source=_source_folder(run),
               code=_published_code(run))
    # the remote-code files final/ carries (none: its config.json names no auto_map; docs/serving.md)
    summary = {**summary, "remote_code": sorted(p.name for p in tmp.glob("*.py"))}
    atomic_write_json(tmp / "training_summary.json", summary)
    write_checksums(tmp)
    fsync_tree(tmp)
    _fault("kill_in_final")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(out)


def _source_folder(run: Run) -> Optional[Path]:
    """The checkpoint folder the policy was loaded from (its remote code and generation config go with the export);
    None for a built-in model."""
    from dllm_align.models.load import BUILTIN_SPECS, resolve_model_path

    name = run.record.model
    if name in BUILTIN_SPECS:
        return None
    revision = (run.record.recipe.get("model") or {}).get("revision")
    try:
        path = Path(resolve_model_path(name, revision))
    except UserError:  # the run trained from it, so this is not expected; the export then carries no remote code
        return None
    return path if path.is_dir() else None


def _published_code(run: Run) -> Optional[Path]:
    """``model.published_code``: a folder of the family's published modeling files for ``final/`` (None: unset)."""
    code = (run.record.recipe.get("model") or {}).get("published_code")
    return Path(code).expanduser() if code else None


def _bar_on() -> bool:
    return progress_enabled()
