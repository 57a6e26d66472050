"""The `generate` command's orchestration: one output file per prompt set, written resumably row by row
(an interrupted run keeps its rows and continues), split across processes by rank with part files merged on
rank 0, with the sampler settings and model recorded in a sidecar so a rerun with other settings is refused.

Library code (also used by :mod:`dllm_align.workflows.pipeline`); the Typer command is :mod:`dllm_align.cli.generate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

def _device(device: Optional[str]):
    """The torch device for ``--device``, refused in one line when it does not exist here."""
    import torch

    from dllm_align.core.errors import UserError

    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device}: not a device name", hint="use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: CUDA is not available on this machine", hint="use --device cpu, or leave --device out")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise UserError(f"--device {device}: not supported", hint="use cpu, cuda or cuda:N")
    return dev


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
    import os

    import torch

    from dllm_align.data.load import load_prompts
    from dllm_align.core.errors import UserError
    from dllm_align.generate.backend import backend_factory, make_generator
    from dllm_align.generate.settings import SamplerSettings, model_fingerprint
    from dllm_align.core.io import FileLock, check_not_input
    from dllm_align.models.load import pick_dtype

    g = rec.generate
    settings = SamplerSettings.from_section(g)
    backend_factory(g.backend)  # an unknown backend is refused before anything is read or written

    # -- where the prompts come from
    if prompts is not None:
        source, split_name = prompts, (rec.data.test_split if g.split == "test" else rec.data.train_split)
    else:
        source = rec.data.test if g.split == "test" else rec.data.train
        split_name = rec.data.test_split if g.split == "test" else rec.data.train_split
        if source is None:
            raise UserError(
                f"the recipe has no data.{g.split} to take prompts from",
                hint="pass --prompts FILE, or set data.test / data.train in the recipe",
            )
    out = Path(output) if output is not None else Path(rec.output_dir) / f"gen.{g.split}.jsonl"
    if out.suffix != ".jsonl":
        raise UserError(f"--output {out}: expected a .jsonl file name")
    sidecar = out.with_name(out.name[: -len(".jsonl")] + ".settings.json")

    # -- processes: torchrun / accelerate launch set WORLD_SIZE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    state = None
    if world > 1:
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available() or (device or "").startswith("cpu"))
        rank, world, dev = state.process_index, state.num_processes, state.device
    else:
        rank = 0
        dev = _device(device)

    def barrier() -> None:
        if state is not None:
            state.wait_for_everyone()

    def part_files() -> list[Path]:
        return sorted(out.parent.glob(out.name[: -len(".jsonl")] + ".part*.jsonl")) if out.parent.exists() else []

    rows = load_prompts(source, split=split_name, limit=g.limit, quiet=rank != 0)
    for p in (out, sidecar):
        check_not_input(p)  # the prompts (or the recipe) are never overwritten, --overwrite or not
    settings_record = {
        "model": rec.model.name_or_path,
        "model_checksums": model_fingerprint(rec.model.name_or_path),
        "revision": rec.model.revision,
        "tokenizer": rec.model.tokenizer,
        "dtype": str(pick_dtype(rec.model.dtype, dev)).removeprefix("torch."),
        "prompts": str(source),
        "split": split_name,
        "max_prompt_length": rec.data.max_prompt_length,
        "sampler": settings.to_dict(),
        "backend": g.backend,
    }

    # A fresh run makes its generator (its model) and checks the rule's needs of it before the lock creates the
    # output's folder: a refused model or setting leaves nothing behind. A resumed run makes it only when rows
    # are left to do.
    early = None
    if not out.exists() and not part_files() and rows:
        early = make_generator(g.backend, rec.model, device=dev)
        early.settings_for(settings)

    # -- several nodes: rank 0 merges the part files every rank writes next to the output
    if state is not None:
        from dllm_align.core.runfolder import check_shared_folder

        check_shared_folder(out.parent, "output folder")

    # -- one writer per output file (rank 0 holds it for the whole run)
    lock = FileLock(out, f"another `dllm-align generate` is writing to {out}") if rank == 0 else None
    if lock is not None:
        lock.__enter__()
    try:
        return _generate_into(
            rec, out, sidecar, rows, source, settings, settings_record, dev, rank, world, barrier, part_files,
            overwrite, allow_long, make=lambda: early or make_generator(g.backend, rec.model, device=dev),
        )
    finally:
        if lock is not None:
            lock.release()


def _generate_into(rec, out, sidecar, rows, source, settings, settings_record, dev, rank, world, barrier, part_files,
                   overwrite, allow_long, make) -> Path:
    import json
    import time

    from dllm_align.core import console
    from dllm_align.core.errors import UserError
    from dllm_align.generate.settings import SamplerStats, encode_prompt, length_batches, row_seed
    from dllm_align.core.io import JsonlAppender, atomic_write_json, atomic_write_text, recover_jsonl
    from dllm_align.config.recipe import write_run_info
    from dllm_align.core.runfolder import differing, refuse_changes
    from dllm_align.data.tokenize import fit

    g = rec.generate
    # -- resume or refuse
    if overwrite and rank == 0:
        for p in [out, sidecar, *part_files()]:
            if p.exists():
                p.unlink() if p != out else p.write_bytes(b"")  # keep the locked file itself
    barrier()
    existing = out.exists() and out.stat().st_size > 0 or bool(part_files())
    if sidecar.exists():
        try:
            old = json.loads(sidecar.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{sidecar}: not valid JSON", hint="delete it (and the output) or pass --overwrite") from None
        if existing and isinstance(old, dict):
            refuse_changes(
                f"{out} was made with other settings; refusing to mix them",
                differing(old, settings_record),
                hint="choose another --output, or pass --overwrite to start afresh",
            )
    elif existing:
        raise UserError(f"{out} exists but has no {sidecar.name}, so its settings are unknown", hint="choose another --output, or pass --overwrite")

    if rank == 0:
        for p in [out, *part_files()]:
            recover_jsonl(p)  # cut a torn last line left by a kill
    barrier()
    done: set[str] = set()
    for p in [out, *part_files()]:
        done.update(str(r.get("id")) for r in recover_jsonl(p))

    order = {r.id: i for i, r in enumerate(rows)}
    todo = [r for r in rows if r.id not in done]
    if rank == 0:
        already = f", {len(rows) - len(todo):,} already in {out}" if done else ""
        console.info(f"generate: {len(rows):,} prompts from {source}{already}" + (f"; {world} processes" if world > 1 else ""))

    # The generator (its model) is made, and a damaged one refused, before anything is written.
    gen = make() if todo else None
    ids: list = []
    if todo:
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
            # Checked before any decoding: beyond its positions a model gives garbage, slowly.
            if not allow_long:
                raise UserError(
                    f"the longest prompt plus gen_length is {longest} tokens, beyond the model's {max_pos} positions",
                    hint="lower --gen-length, set data.max_prompt_length, or pass --allow-long to generate anyway",
                )
            if rank == 0:
                console.warn(f"prompt + gen_length reaches {longest} tokens, beyond the model's {max_pos} positions (--allow-long)")
    # Everything is checked: only now does the run leave its settings and record behind.
    if rank == 0:
        atomic_write_json(sidecar, settings_record)
        write_run_info(rec, out.parent, "generate")
    barrier()

    if todo:
        batches = length_batches([len(p) for p in ids], g.batch_size)
        mine = [b for j, b in enumerate(batches) if j % world == rank]
        target = out if world == 1 else out.with_name(out.name[: -len(".jsonl")] + f".part{rank}.jsonl")
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
                            "settings": settings_record,
                        }
                    )
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.advance(len(b), status=f"{stats.decoded / dt:,.0f} tok/s")
        dt = max(time.perf_counter() - t0, 1e-9)
        console.info(
            f"rank {rank}: " * (world > 1)
            + f"{n_mine:,} prompts in {dt:,.1f} s ({n_mine / dt:.2f} prompts/s, {stats.decoded / dt:,.0f} tokens/s, "
            f"{stats.forwards:,} forward passes)"
        )
    barrier()

    # -- one file, every id once, in input order (the same whatever the number of processes)
    if rank == 0:
        parts = part_files()
        merged: dict[str, dict] = {}
        for p in [out, *parts]:
            for r in recover_jsonl(p):
                merged.setdefault(str(r.get("id")), r)
        known = sorted((k for k in merged if k in order), key=order.__getitem__)
        extra = [k for k in merged if k not in order]  # rows of an earlier, longer run: kept
        text = "".join(json.dumps(merged[k], ensure_ascii=False) + "\n" for k in known + extra)
        atomic_write_text(out, text)
        for p in parts:
            p.unlink()
    barrier()
    return out
