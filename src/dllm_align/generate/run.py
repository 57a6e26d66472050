"""The `generate` command's orchestration: one output file per prompt set, written resumably row by row
(an interrupted run keeps its rows and continues), split across processes by rank with part files merged on
rank 0, with the sampler settings and model recorded in a sidecar so a rerun with other settings is refused.

Library code (also used by :mod:`dllm_align.workflows.pipeline`); the Typer command is :mod:`dllm_align.cli.generate`.
``accelerate`` is imported only when several processes run (one process never needs it).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import PartialState

from dllm_align.config.recipe import write_run_info
from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.core.io import FileLock, JsonlAppender, atomic_write_json, atomic_write_text, check_not_input, recover_jsonl
from dllm_align.core.runfolder import check_shared_folder, differing, refuse_changes
from dllm_align.data.load import load_prompts
from dllm_align.data.tokenize import fit
from dllm_align.generate.backend import backend_component, loads_here, make_generator, recorded_settings
from dllm_align.generate.settings import (
    SamplerSettings,
    SamplerStats,
    encode_prompt,
    length_batches,
    model_fingerprint,
    row_seed,
    unused_by_rule,
)
from dllm_align.models.load import check_device, pick_dtype


@dataclass
class _Ranks:
    """This process's place in a run: rank, world size, device, and the barrier every rank meets at."""

    rank: int
    world: int
    device: "torch.device"
    state: object = None

    @classmethod
    def start(cls, device: Optional[str]) -> "_Ranks":
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun / accelerate launch set WORLD_SIZE
        if world > 1:
            state = PartialState(cpu=not torch.cuda.is_available() or (device or "").startswith("cpu"))
            return cls(state.process_index, state.num_processes, state.device, state)
        return cls(0, 1, check_device(device))

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


@dataclass
class _Output:
    """The output file, its settings sidecar, and the part files each rank writes next to it."""

    out: Path
    sidecar: Path

    @classmethod
    def of(cls, rec, output: Optional[Path]) -> "_Output":
        out = Path(output) if output is not None else Path(rec.output_dir) / f"gen.{rec.generate.split}.jsonl"
        if out.suffix != ".jsonl":
            raise UserError(f"--output {out}: expected a .jsonl file name")
        return cls(out, out.with_name(out.name[: -len(".jsonl")] + ".settings.json"))

    def part(self, rank: int) -> Path:
        return self.out.with_name(self.out.name[: -len(".jsonl")] + f".part{rank}.jsonl")

    def parts(self) -> list[Path]:
        out = self.out
        return sorted(out.parent.glob(out.name[: -len(".jsonl")] + ".part*.jsonl")) if out.parent.exists() else []


def run_generate(
    rec,
    *,
    output: Optional[Path] = None,
    prompts: Optional[str] = None,
    device: Optional[str] = None,
    overwrite: bool = False,
    allow_long: bool = False,
) -> Path:
    """Generate for the recipe's prompts into a JSONL file (resumable; one or many processes).

    One writer per output file (a second run onto it is refused while the first
    runs); a file made with other settings is refused, naming each setting."""
    g = rec.generate
    settings = SamplerSettings.from_section(g)
    backend_component(g.backend)  # an unknown backend is refused before anything is read or written
    source, split_name = _prompt_source(rec, prompts)
    files = _Output.of(rec, output)
    ranks = _Ranks.start(device)
    rows = load_prompts(source, split=split_name, limit=g.limit, quiet=ranks.rank != 0)
    for p in (files.out, files.sidecar):
        check_not_input(p)  # the prompts (or the recipe) are never overwritten, --overwrite or not
    record = _settings_record(rec, settings, source, split_name, ranks.device)

    # A fresh run makes its generator (its model; make_generator checks the rule's needs of it) before the lock
    # creates the output's folder: a refused model or setting leaves nothing behind. A resumed run makes it only
    # when rows are left to do.
    early = None
    if not files.out.exists() and not files.parts() and rows:
        early = make_generator(g, rec.model, device=ranks.device)

    if ranks.state is not None:  # several nodes: rank 0 merges the part files every rank writes
        check_shared_folder(files.out.parent, "output folder")

    # -- one writer per output file (rank 0 holds it for the whole run)
    made = not files.out.parent.exists()
    fresh = not files.out.exists()
    lock = FileLock(files.out, f"another `dllm-align generate` is writing to {files.out}") if ranks.rank == 0 else None
    if lock is not None:
        lock.__enter__()
    try:
        return _generate_into(
            rec, files, rows, source, settings, record, ranks, overwrite, allow_long,
            make=lambda: early or make_generator(g, rec.model, device=ranks.device),
        )
    except BaseException:
        if lock is not None:
            lock.release()
            lock = None
            _leave_nothing(files, made, fresh)
        raise
    finally:
        if lock is not None:
            lock.release()


def _leave_nothing(files: _Output, made: bool, fresh: bool) -> None:
    """After a refusal before the first row (the prompts against the model's positions, the rule's needs): the
    empty output file the lock made, and the folder this run made, are taken away again."""
    out = files.out
    if fresh and out.is_file() and out.stat().st_size == 0 and not files.sidecar.exists():
        out.unlink()
    folder = out.parent
    if made and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _prompt_source(rec, prompts: Optional[str]) -> tuple[str, str]:
    """Where the prompts come from (``--prompts`` or the recipe's data) and the split to read."""
    g = rec.generate
    split_name = rec.data.test_split if g.split == "test" else rec.data.train_split
    if prompts is not None:
        return prompts, split_name
    source = rec.data.test if g.split == "test" else rec.data.train
    if source is None:
        raise UserError(
            f"the recipe has no data.{g.split} to take prompts from",
            hint="pass --prompts FILE, or set data.test / data.train in the recipe",
        )
    return source, split_name


def _settings_record(rec, settings: SamplerSettings, source, split_name: str, dev) -> dict:
    """What the sidecar (and every row) records: the model asked for, the prompts, and what the backend used
    to decide the tokens (the dtype only when it loads the weights here; its ``reads`` of the section)."""
    record = {
        "model": rec.model.name_or_path,
        "model_checksums": model_fingerprint(rec.model.name_or_path),
        "revision": rec.model.revision,
        "tokenizer": rec.model.tokenizer,
    }
    if loads_here(settings.backend):
        record["dtype"] = str(pick_dtype(rec.model.dtype, dev)).removeprefix("torch.")
    record.update({
        "prompts": str(source),
        "split": split_name,
        "max_prompt_length": rec.data.max_prompt_length,
        "sampler": recorded_settings(settings),
        "backend": settings.backend,
    })
    return record


def _generate_into(rec, files: _Output, rows, source, settings, record, ranks: _Ranks, overwrite, allow_long,
                   make: Callable) -> Path:
    _resume_or_refuse(files, record, ranks, overwrite)
    done: set[str] = set()
    for p in [files.out, *files.parts()]:
        done.update(str(r.get("id")) for r in recover_jsonl(p))
    _refuse_changed_prompts(done, rows, source, record["split"], files.out, limited=rec.generate.limit is not None)
    todo = [r for r in rows if r.id not in done]
    if ranks.rank == 0:
        already = f", {len(rows) - len(todo):,} already in {files.out}" if done else ""
        console.info(f"generate: {len(rows):,} prompts from {source}{already}"
                     + (f"; {ranks.world} processes" if ranks.world > 1 else ""))

    # The generator (its model) is made, and a damaged one refused, before anything is written.
    gen = make() if todo else None
    ids = _prompt_ids(rec, gen, todo, settings, ranks, allow_long) if todo else []
    # Everything is checked: only now does the run leave its settings and record behind.
    if ranks.rank == 0:
        atomic_write_json(files.sidecar, record)
        write_run_info(rec, files.out.parent, "generate")
    ranks.barrier()
    if todo:
        _decode(gen, files, todo, ids, settings, record, ranks, rec.generate.batch_size)
    ranks.barrier()
    if ranks.rank == 0:
        _merge(files, {r.id: i for i, r in enumerate(rows)})
    ranks.barrier()
    return files.out


def _refuse_changed_prompts(done: set[str], rows, source, split: str, out: Path, limited: bool) -> None:
    """A prompt's id is a hash of its text: rows of the output whose ids the prompts no longer hold were written for
    another prompts file under the same name (its settings record names only the file), and resuming would mix the
    two in one output. Refused before anything is written (rows past a ``--limit`` are not such rows)."""
    stray = done - {r.id for r in rows}
    if stray and limited:
        stray -= {r.id for r in load_prompts(source, split=split, limit=None, quiet=True)}
    if stray:
        raise UserError(f"{source}: {len(stray):,} rows of {out} are for prompts it no longer holds (it changed since "
                        "they were written); refusing to mix the two", hint="choose another --output, or pass --overwrite "
                        "to start afresh")


def _resume_or_refuse(files: _Output, record: dict, ranks: _Ranks, overwrite: bool) -> None:
    """Start afresh (``--overwrite``), or continue a file made with the same recorded settings; refuse one made
    with others, or one whose settings are unknown. A torn last line left by a kill is cut."""
    out, sidecar = files.out, files.sidecar
    if overwrite and ranks.rank == 0:
        for p in [out, sidecar, *files.parts()]:
            if p.exists():
                p.unlink() if p != out else p.write_bytes(b"")  # keep the locked file itself
    ranks.barrier()
    existing = out.exists() and out.stat().st_size > 0 or bool(files.parts())
    if sidecar.exists():
        try:
            old = json.loads(sidecar.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{sidecar}: not valid JSON", hint="delete it (and the output) or pass --overwrite") from None
        if existing and isinstance(old, dict):
            # a key the rule never reads is not recorded (older records hold it): not a difference
            unread = tuple(f"sampler.{k}" for k in unused_by_rule(record["sampler"].get("sampler", "auto")))
            refuse_changes(
                f"{out} was made with other settings; refusing to mix them",
                differing(old, record, neutral=unread),
                hint="choose another --output, or pass --overwrite to start afresh",
            )
    elif existing:
        raise UserError(f"{out} exists but has no {sidecar.name}, so its settings are unknown", hint="choose another --output, or pass --overwrite")
    if ranks.rank == 0:
        for p in [out, *files.parts()]:
            recover_jsonl(p)  # cut a torn last line left by a kill
    ranks.barrier()


def _prompt_ids(rec, gen, todo, settings, ranks: _Ranks, allow_long: bool) -> list:
    """The prompts' token ids, cut as training cuts them, and checked against the model's positions before any
    decoding (beyond its positions a model gives garbage, slowly)."""
    gen.settings_for(settings)  # the rule's needs of this model (e.g. its block length) refused here, not mid-run
    ids = [encode_prompt(gen.tokenizer, r.messages) for r in todo]
    if rec.data.max_prompt_length is not None:
        # The training cut (tokenize.fit): a long prompt loses its head, BOS kept.
        cap, bos = rec.data.max_prompt_length, gen.tokenizer.bos_token_id
        cut = sum(len(p) > cap for p in ids)
        ids = [fit(p, [[]], len(p) + 1, cap, "completion", bos)[0] for p in ids]
        if cut:
            console.info(f"{cut:,} prompts lost their head to fit data.max_prompt_length {cap}")
    max_pos = gen.max_positions
    longest = max(len(p) for p in ids) + settings.gen_length
    if max_pos and longest > max_pos:
        if not allow_long:
            raise UserError(
                f"the longest prompt plus gen_length is {longest} tokens, beyond the model's {max_pos} positions",
                hint="lower --gen-length, set data.max_prompt_length, or pass --allow-long to generate anyway",
            )
        if ranks.rank == 0:
            console.warn(f"prompt + gen_length reaches {longest} tokens, beyond the model's {max_pos} positions (--allow-long)")
    return ids


def _decode(gen, files: _Output, todo, ids, settings, record: dict, ranks: _Ranks, batch_size: int) -> None:
    """This rank's share of the length-grouped batches, each row appended as it is decoded."""
    batches = length_batches([len(p) for p in ids], batch_size)
    mine = [b for j, b in enumerate(batches) if j % ranks.world == ranks.rank]
    target = files.out if ranks.world == 1 else files.part(ranks.rank)
    stats = SamplerStats()
    t0 = time.perf_counter()
    n_mine = sum(len(b) for b in mine)
    with JsonlAppender(target) as app, console.progress("generate", total=n_mine, unit="prompts") as bar:
        for b in mine:
            res = gen.generate(
                [ids[i] for i in b], settings, [row_seed(settings.seed, todo[i].id) for i in b], batch_size=len(b), stats=stats
            )
            for i, c in zip(b, res):
                app.write(
                    {
                        "id": todo[i].id,
                        "prompt": todo[i].messages,
                        "completion": c.text,
                        "finish_reason": c.finish_reason,
                        "num_tokens": len(c.ids),
                        "settings": record,
                    }
                )
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.advance(len(b), status=f"{stats.decoded / dt:,.0f} tok/s")
    dt = max(time.perf_counter() - t0, 1e-9)
    console.info(
        f"rank {ranks.rank}: " * (ranks.world > 1)
        + f"{n_mine:,} prompts in {dt:,.1f} s ({n_mine / dt:.2f} prompts/s, {stats.decoded / dt:,.0f} tokens/s, "
        f"{stats.forwards:,} forward passes)"
    )


def _merge(files: _Output, order: dict) -> None:
    """One file, every id once, in input order (the same whatever the number of processes)."""
    parts = files.parts()
    merged: dict[str, dict] = {}
    for p in [files.out, *parts]:
        for r in recover_jsonl(p):
            merged.setdefault(str(r.get("id")), r)
    known = sorted((k for k in merged if k in order), key=order.__getitem__)
    extra = [k for k in merged if k not in order]  # rows of an earlier, longer run: kept
    text = "".join(json.dumps(merged[k], ensure_ascii=False) + "\n" for k in known + extra)
    atomic_write_text(files.out, text)
    for p in parts:
        p.unlink()
