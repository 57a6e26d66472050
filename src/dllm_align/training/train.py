"""`dllm-align train`: the run folder (fresh, `--resume` or `--overwrite`), the settings check on resume, the
loop over optimiser steps with checkpoints, metrics and the progress bar, and the final export.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from dllm_align.training.checkpoint import (
    FINAL, METRICS, TMP_FINAL, _clear_previous, prepare_output,
)
from dllm_align.core.errors import UserError
from dllm_align.training.monitor import TrainResult, _fault, _flat
from dllm_align.training.distributed import make_accelerator
from dllm_align.training.loop import _Run, _status


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
    from dllm_align.core.io import DirLock, recover_jsonl
    from dllm_align.core.runfolder import check_training_settings
    from dllm_align.objective.base import objective_for
    from dllm_align.training.cache import cache_dir

    acc = accelerator or make_accelerator(recipe)
    out = Path(recipe.output_dir)
    created = not out.exists()
    lock: Optional[DirLock] = None
    cache_lock: Optional[DirLock] = None
    # The main process inspects the run folder (and verifies the checkpoint to
    # resume from); every process must then agree, or fail together.
    decision: list = [None]
    if acc.is_main_process:
        try:
            lock = DirLock(out, f"another `dllm-align train` is writing to {out}").__enter__()
            if recipe.reference.mode == "cached" and objective_for(recipe.train).needs_reference:
                # The cache must stay the one this run trains against: a `precompute-ref --overwrite`
                # into it is refused while the run lasts (it takes the exclusive lock).
                cdir = cache_dir(recipe)
                cache_lock = DirLock(cdir, f"the reference cache {cdir} is being rewritten by a running `dllm-align precompute-ref`",
                                     shared=True).__enter__()
            found = prepare_output(recipe, resume, overwrite)
            state = None
            if resume and found:
                from dllm_align.training.checkpoint import read_state

                state = read_state(found)
            changes = check_training_settings(recipe, out, allow_changes, state) if resume else []
            if resume:
                recover_jsonl(out / METRICS)  # cut a torn last line; refuse a damaged middle
            decision = [("ok", str(found) if found else None, changes)]
        except UserError as e:
            decision = [("error", e.message, e.hint)]
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

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


def _train(recipe, acc, out: Path, resume: bool, overwrite: bool, resume_from: Optional[Path], examples, changes=()) -> TrainResult:
    from dllm_align.core.console import info, progress, warn
    from dllm_align.core.io import JsonlAppender, atomic_write_json, atomic_write_text, recover_jsonl
    from dllm_align.config.recipe import write_run_info

    torch.manual_seed(recipe.train.seed)
    run = _Run(recipe, acc, resume_from, examples)  # loads and checks everything before the run folder changes
    t = recipe.train
    summary_path = out / FINAL / "training_summary.json"
    if resume and summary_path.exists():
        # Checked before the metrics are trimmed to the checkpoint: a finished run stays as it is.
        summary = json.loads(summary_path.read_text())
        if summary.get("steps", 0) >= run.total:
            if acc.is_main_process:
                info(f"train: {out} already finished ({summary['steps']} steps); nothing to do")
            return TrainResult(out, out / FINAL, 0, 0.0, 0, summary.get("last_metrics") or {})
    if acc.is_main_process:
        if not resume and overwrite:
            _clear_previous(out)
        if changes:  # let through on purpose (--allow-change): said now, and kept in the run's record
            for k, was, now in changes:
                warn(f"train: {k} changed on resume ({was!r} then, {now!r} now)")
        write_run_info(recipe, out, "train", changes=[{"key": k, "was": a, "now": b, "at_step": run.step} for k, a, b in changes])
    history: list[dict] = []
    metrics_path = out / METRICS
    if acc.is_main_process:
        rows = recover_jsonl(metrics_path)
        keep = [r for r in rows if r.get("step", 0) <= run.step]  # steps after the checkpoint are redone
        if len(keep) != len(rows):
            atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        history = keep
    if acc.log_with:
        acc.init_trackers(recipe.name, config=_flat(recipe.model_dump(mode="json")))

    last_ckpt = resume_from
    appender = JsonlAppender(metrics_path) if acc.is_main_process else None
    start_step = run.step
    t_run = time.perf_counter()
    step_examples = run.G * run.rows_per_unit
    try:
        with progress(f"train ({t.objective})", total=run.total if acc.is_main_process else None, unit="step") as bar:
            if start_step:
                bar.advance(0)
            while run.step < run.total:
                t0 = time.perf_counter()
                lr, m, grad_norm = run.step_once(last_ckpt)
                dt = time.perf_counter() - t0
                run.elapsed += dt
                run.examples_seen += step_examples
                run.tokens_seen += m["tokens"]
                row = {
                    "step": run.step,
                    "epoch": round(run.step / run.steps_per_epoch, 4),
                    **{k: m[k] for k in run.objective.metric_names},
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": m["tokens"] / dt,
                    "examples_per_s": step_examples / dt,
                    "seconds": dt,
                }
                history.append(row)
                if acc.is_main_process:
                    appender.write(row)
                    line = _status(run.objective, m, lr, row["tokens_per_s"])
                    bar.advance(1, status=line)
                    if run.step % t.log_every == 0 and not _bar_on():
                        info(f"step {run.step}/{run.total}: " + line)
                    msg = run.margin_watch.add(run.step, run.objective.watched_margin(m))
                    if msg:
                        warn(msg)
                if acc.log_with and run.step % t.log_every == 0:
                    acc.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and v is not None}, step=run.step)
                if acc.is_main_process:
                    _fault("kill_after_step", run.step)
                if t.save_every and run.step % t.save_every == 0 and run.step < run.total:
                    last_ckpt = run.save_checkpoint(history)
        # final export: the model (LoRA merged) and tokenizer, written atomically
        final = out / FINAL
        tmp = out / TMP_FINAL
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
        acc.wait_for_everyone()
        sd = run._state_dict()
        seconds = time.perf_counter() - t_run
        n_steps = run.step - start_step
        if acc.is_main_process:
            from dllm_align.core.io import disk_errors

            with disk_errors(out / FINAL, "write the final model"):
                run.export(tmp, sd, final=True)
            summary = {
                "objective": t.objective,
                "steps": run.step,
                "steps_this_session": n_steps,
                "seconds": seconds,
                "steps_per_s": n_steps / seconds if seconds > 0 else None,
                "examples": n_steps * step_examples,
                "examples_per_s": n_steps * step_examples / seconds if seconds > 0 else None,
                "global_batch_size": run.G,
                "processes": run.world,
                "last_metrics": history[-1] if history else None,
            }
            atomic_write_json(tmp / "training_summary.json", summary)
            from dllm_align.core.io import _fsync_dir, fsync_tree, write_checksums

            write_checksums(tmp)
            fsync_tree(tmp)
            _fault("kill_in_final")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(out)
        if t.save_every and run.step % t.save_every == 0:
            run.save_checkpoint(history)
        acc.wait_for_everyone()
    finally:
        if appender is not None:
            appender.close()
        if acc.log_with:
            acc.end_training()
    return TrainResult(out, out / FINAL, n_steps, seconds, n_steps * step_examples, history[-1] if history else {})


def _bar_on() -> bool:
    from dllm_align.core.console import progress_enabled

    return progress_enabled()

