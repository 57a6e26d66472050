"""`dllm-align train`, top to bottom as setup, train, cleanup: the plan (the recipe resolved once); the run folder
held (:func:`dllm_align.core.runfolder.run_folder`: fresh, `--resume` or `--overwrite`, the settings check on
resume); the setup in named steps (the policy, the data, the reference, the optimiser, the state to continue
from); the loop over optimiser steps with checkpoints, metrics and the progress bar; the final export; the metrics
log and trackers closed.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from dllm_align.config.recipe import write_run_info
from dllm_align.core import faults
from dllm_align.core.console import info, progress, progress_enabled, warn
from dllm_align.core.io import (
    DirLock,
    JsonlAppender,
    atomic_write_json,
    atomic_write_text,
    disk_errors,
    fsync_dir,
    fsync_tree,
    recover_jsonl,
    write_checksums,
)
from dllm_align.core.runfolder import HeldFolder, check_shared_folder, check_training_settings, run_folder
from dllm_align.data.examples import units_digest
from dllm_align.training.cache import cache_dir
from dllm_align.training.checkpoint import (
    FINAL,
    METRICS,
    TMP_FINAL,
    RunRecord,
    TrainState,
    adapter_state,
    clear_previous,
    export,
    load_state,
    prepare_output,
    read_state,
    save_checkpoint,
    save_peft_adapter,
    state_dict_of,
)
from dllm_align.training.distributed import make_accelerator
from dllm_align.training.loop import Run, load_data
from dllm_align.training.monitor import MarginWatch, TrainResult, flat_config, status_line
from dllm_align.training.plan import TrainPlan, plan_run
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
    recipe, plan = plan_run(recipe, acc)  # refused before the run folder is touched
    out = Path(recipe.output_dir)
    # Several nodes: rank 0 writes the run folder and every rank reads it back (a checkpoint to resume, the cache):
    # a folder on each node's own disk is refused before anything is written.
    with run_folder(out, f"another `dllm-align train` is writing to {out}", rank=plan.rank, world=plan.world,
                    shared="run folder") as folder:
        if uses_cache(recipe, plan):
            check_shared_folder(cache_dir(recipe), "reference cache", create=False)
        # The main process inspects the run folder (and verifies the checkpoint to resume from); every process
        # then goes on from what it found, or stops with its refusal.
        found, changes = folder.decide(lambda: claim(folder, recipe, plan, resume, overwrite, allow_changes))
        resume_from = Path(found) if found else None
        torch.manual_seed(recipe.train.seed)
        run = setup_run(recipe, acc, resume_from, examples, plan=plan)  # loads and checks before the folder changes
        finished = finished_run(run, out) if resume else None
        if finished is not None:
            return finished
        log = start_log(run, recipe, out, clear=overwrite and not resume, changes=changes)
        try:
            return train_steps(run, out, log, resume_from)
        finally:
            log.close()


def uses_cache(recipe, plan: TrainPlan) -> bool:
    """Whether the run reads the reference cache (``reference.mode: cached`` and an objective with a reference)."""
    return recipe.reference.mode == "cached" and plan.objective.needs_reference


def claim(folder: HeldFolder, recipe, plan: TrainPlan, resume: bool, overwrite: bool, allow_changes) -> tuple:
    """Rank 0's look at the run folder: ``(checkpoint to resume from or None, the changes let through)``."""
    out = folder.folder
    if uses_cache(recipe, plan):
        # The cache must stay the one this run trains against: a `precompute-ref --overwrite` into it is refused
        # while the run lasts (it takes the exclusive lock).
        cdir = cache_dir(recipe)
        folder.hold(DirLock(cdir, f"the reference cache {cdir} is being rewritten by a running `dllm-align precompute-ref`",
                            shared=True))
    found = prepare_output(recipe, resume, overwrite)
    state = read_state(found) if resume and found else None
    changes = check_training_settings(recipe, out, allow_changes, state) if resume else []
    if resume:
        recover_jsonl(out / METRICS)  # cut a torn last line; refuse a damaged middle
    return (str(found) if found else None, changes)


def setup_run(recipe, accelerator, resume_from: Optional[Path] = None, examples: Optional[list] = None,
              plan: Optional[TrainPlan] = None) -> Run:
    """Everything a run needs, in order, loaded and checked before the run folder changes. ``plan``: the run's
    (:func:`dllm_align.training.plan.plan_run`, with the recipe it resolved); made here when not given."""
    if plan is None:
        recipe, plan = plan_run(recipe, accelerator, quiet=True)
    mp = load_policy(recipe.model, recipe.train.lora, recipe.data.max_length, plan, resume_from)
    data = load_data(recipe, plan, mp.tokenizer, examples, block_size=mp.block_size, canvas_length=mp.canvas_length)
    reference = open_reference(recipe, plan, mp, data, accelerator) if plan.objective.needs_reference else None
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


def finished_run(run: Run, out: Path) -> Optional[TrainResult]:
    """A resumed run that had finished already: its result, and nothing changes (checked before the metrics are
    trimmed to the checkpoint)."""
    summary_path = out / FINAL / "training_summary.json"
    if not summary_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    if summary.get("steps", 0) < run.data.total:
        return None
    if run.plan.main:
        info(f"train: {out} already finished ({summary['steps']} steps); nothing to do")
    return TrainResult(out, out / FINAL, 0, 0.0, 0, summary.get("last_metrics") or {})


@dataclass
class StepLog:
    """Where each step's metrics go: the run's history, ``metrics.jsonl`` (main process) and the trackers."""

    accelerator: object
    history: list = field(default_factory=list)
    appender: Optional[JsonlAppender] = None

    def write(self, row: dict, log_every: int) -> None:
        self.history.append(row)
        if self.appender is not None:
            self.appender.write(row)
        if self.accelerator.log_with and row["step"] % log_every == 0:
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and v is not None},
                                 step=row["step"])

    @property
    def last(self) -> Optional[dict]:
        return self.history[-1] if self.history else None

    def close(self) -> None:
        if self.appender is not None:
            self.appender.close()
        if self.accelerator.log_with:
            self.accelerator.end_training()


def start_log(run: Run, recipe, out: Path, *, clear: bool, changes) -> StepLog:
    """The run folder made ready for the steps (main process): a previous run cleared (``clear``), the record of
    this one written, the metrics cut back to the checkpoint; the trackers started."""
    acc, state = run.accelerator, run.state
    log = StepLog(acc)
    if run.plan.main:
        if clear:
            clear_previous(out)
        for k, was, now in changes:  # let through on purpose (--allow-change): said now, and kept in the run's record
            warn(f"train: {k} changed on resume ({was!r} then, {now!r} now)")
        write_run_info(recipe, out, "train", changes=[{"key": k, "was": a, "now": b, "at_step": state.step} for k, a, b in changes])
        metrics_path = out / METRICS
        rows = recover_jsonl(metrics_path)
        keep = [r for r in rows if r.get("step", 0) <= state.step]  # steps after the checkpoint are redone
        if len(keep) != len(rows):
            atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        log.history = keep
        log.appender = JsonlAppender(metrics_path)
    if acc.log_with:
        acc.init_trackers(recipe.name, config=flat_config(recipe.model_dump(mode="json")))
    return log


def train_steps(run: Run, out: Path, log: StepLog, resume_from: Optional[Path]) -> TrainResult:
    """The optimiser steps from the run's state to the end, with their checkpoints, then the final export."""
    t, data, state, plan = run.train, run.data, run.state, run.plan
    step_examples = plan.global_batch * plan.objective.rows_per_unit

    def checkpoint() -> Path:
        return save_checkpoint(out, run.saver, run.policy.optimizer, run.record, state, log.history, t.lora, t.keep_checkpoints)

    last_ckpt = resume_from
    start_step = state.step
    t_run = time.perf_counter()
    with progress(f"train ({t.objective})", total=data.total if plan.main else None, unit="step") as bar:
        if start_step:
            bar.advance(0)
        while state.step < data.total:
            one_step(run, log, bar, step_examples, last_ckpt)
            if t.save_every and state.step % t.save_every == 0 and state.step < data.total:
                last_ckpt = checkpoint()
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
        "global_batch_size": plan.global_batch,
        "processes": plan.world,
        "last_metrics": log.last,
    })
    if t.save_every and state.step % t.save_every == 0:
        checkpoint()
    run.accelerator.wait_for_everyone()
    return TrainResult(out, out / FINAL, n_steps, seconds, n_steps * step_examples, log.last or {})


def one_step(run: Run, log: StepLog, bar, step_examples: int, last_ckpt: Optional[Path] = None) -> None:
    """One optimiser step, its metrics row logged, its line shown and its margins watched."""
    t, state, objective, main = run.train, run.state, run.plan.objective, run.plan.main
    t0 = time.perf_counter()
    lr, m, grad_norm = run.step_once(last_ckpt)
    dt = time.perf_counter() - t0
    state.elapsed += dt
    state.examples_seen += step_examples
    state.tokens_seen += m["tokens"]
    row = {
        "step": state.step,
        "epoch": round(state.step / run.data.steps_per_epoch, 4),
        **{k: m[k] for k in objective.metric_names},
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": m["tokens"] / dt,
        "examples_per_s": step_examples / dt,
        "seconds": dt,
    }
    log.write(row, t.log_every)
    if main:
        line = status_line(objective.status(m), lr, row["tokens_per_s"])
        bar.advance(1, status=line)
        if state.step % t.log_every == 0 and not progress_enabled():
            info(f"step {state.step}/{run.data.total}: " + line)
        msg = state.margin_watch.add(state.step, objective.watched_margin(m))
        if msg:
            warn(msg)
        faults.at("kill_after_step", state.step)


def export_final(run: Run, out: Path, summary: dict) -> None:
    """``final/``: the model (LoRA merged, or the adapter) and tokenizer with ``training_summary.json``, written to a
    temporary folder, checksummed and renamed into place (every process takes part: FSDP gathers)."""
    final, tmp = out / FINAL, out / TMP_FINAL
    main = run.plan.main
    if main and tmp.exists():
        shutil.rmtree(tmp)
    run.accelerator.wait_for_everyone()
    lora = run.train.lora
    if lora.enabled and not lora.merge_on_export:
        # the adapters alone: nothing gathers the frozen base
        adapter = adapter_state(run.saver)
        if not main:
            return
        with disk_errors(final, "write the final model"):
            save_peft_adapter(tmp, adapter, lora, run.record.model, run.saver.tokenizer)
    else:
        sd = state_dict_of(run.saver)
        if not main:
            return
        with disk_errors(final, "write the final model"):
            source = _source_folder(run)
            export(run.saver, tmp, sd, lora, run.record.model, final=True, source=source,
                   code=_published_code(run), source_config=run.plan.source.config if source is not None else None,
                   tokenizer_source=_tokenizer_source(run, source))
    # the remote-code files final/ carries (none: its config.json names no auto_map; docs/serving.md)
    summary = {**summary, "remote_code": sorted(p.name for p in tmp.glob("*.py"))}
    atomic_write_json(tmp / "training_summary.json", summary)
    write_checksums(tmp)
    fsync_tree(tmp)
    faults.at("kill_in_final")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(out)


def _source_folder(run: Run) -> Optional[Path]:
    """The checkpoint folder the policy was loaded from (its remote code and generation config go with the export);
    None for a built-in model (the plan read the model's config.json there)."""
    folder = run.plan.source.folder
    return folder if folder is not None and folder.is_dir() else None


def _tokenizer_source(run: Run, source: Optional[Path]) -> Optional[Path]:
    """The folder the run's tokenizer was read from: ``model.tokenizer`` where it names a folder (None for a hub id),
    else the model's own folder."""
    named = (run.record.recipe.get("model") or {}).get("tokenizer")
    if not named:
        return source
    path = Path(named).expanduser()
    return path if path.is_dir() else None


def _published_code(run: Run) -> Optional[Path]:
    """``model.published_code``: a folder of the family's published modeling files for ``final/`` (None: unset)."""
    code = (run.record.recipe.get("model") or {}).get("published_code")
    return Path(code).expanduser() if code else None
