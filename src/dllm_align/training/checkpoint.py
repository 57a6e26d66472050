"""Checkpoints and exports of a training run: save, verify, resume, export.

``checkpoints/step-N/`` holds the model in ``save_pretrained`` layout, the
optimiser and RNG state and ``trainer_state.json``; ``checksums.json`` is
written last, so a folder whose checksums verify is complete (see the
:mod:`dllm_align.training.loop` docstring). The functions taking ``run`` read the
training loop's state object (``training._Run``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from dllm_align.core import faults
from dllm_align.core.errors import UserError
from dllm_align.data.examples import units_digest

CHECKPOINTS = "checkpoints"
FINAL = "final"
METRICS = "metrics.jsonl"
STATE = "trainer_state.json"
STATE_VERSION = 2
TMP_FINAL = ".tmp-final"


def _lora_scale(lora) -> float:
    return lora.alpha / lora.r


def merged_state_dict(sd: dict, lora=None) -> tuple[dict, dict]:
    """Split a PolicyScorer state dict into (plain model weights, LoRA adapter weights).

    With LoRA, ``W = W_base + (alpha / r) * B @ A`` is folded in, so the result
    loads with plain transformers; the adapter tensors are returned separately
    (they are what a resumed run needs).
    """
    out: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        k = k.removeprefix("model.")  # PolicyScorer.model -> the transformers model's own names
        if ".lora_A." in k or ".lora_B." in k:
            adapter[k] = v
            continue
        out[k.replace(".base_layer.", ".")] = v
    if adapter:
        scale = _lora_scale(lora)
        for ka in [k for k in adapter if ".lora_A." in k]:
            stem, rest = ka.split(".lora_A.", 1)  # stem: ...q_proj ; rest: default.weight
            a = adapter[ka]
            b = adapter[f"{stem}.lora_B.{rest}"]
            w = out[f"{stem}.weight"]
            out[f"{stem}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out, adapter


def save_model_folder(folder: Path, state_dict: dict, config, tokenizer, max_shard_size: str = "5GB") -> None:
    """Write weights (safetensors, sharded like ``save_pretrained``), config and tokenizer."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = dict(state_dict)
    if getattr(config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied: the loader re-ties it
    split = split_torch_state_dict_into_shards(sd, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: sd[n].detach().cpu().contiguous() for n in names}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = copy.deepcopy(config)
    dtypes = {t.dtype for t in sd.values()}
    if len(dtypes) == 1:
        cfg.dtype = next(iter(dtypes))
    cfg.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def save_peft_adapter(folder: Path, adapter: dict, lora, base_model: str, tokenizer) -> None:
    """A PEFT adapter folder (``PeftModel.from_pretrained(base, folder)`` loads it)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "base_model.model." + k.replace(".default.", "."): v.detach().cpu().contiguous() for k, v in adapter.items()
    }
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model,
    )
    cfg.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def find_checkpoint(output_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint (``checkpoints/step-N`` with its state file)."""
    root = Path(output_dir) / CHECKPOINTS
    best = None
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step-") and p.name[5:].isdigit() and (p / STATE).is_file():
                if best is None or int(p.name[5:]) > int(best.name[5:]):
                    best = p
    return best


def _local_tensors(obj):
    """FSDP2's optimiser state holds DTensors (not loadable with weights_only): keep each rank's shard."""
    if hasattr(obj, "to_local"):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local_tensors(v) for v in obj]
    return obj


def _reshard_optimizer_state(optimizer) -> None:
    """After loading local shards into an FSDP2 optimiser, give them back their parameter's layout."""
    for p, st in optimizer.state.items():
        if not hasattr(p, "device_mesh"):
            continue
        from torch.distributed.tensor import DTensor

        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.to_local().shape:
                st[k] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False)


def state_dict_of(run) -> dict:
    if run.fsdp and not getattr(run.acc, "is_fsdp2", False) and run.acc.device.type == "cpu":
        # FSDP1's offload_to_cpu (accelerate's choice) crashes when the shards already live on
        # the CPU (gloo); there the gathered tensors are CPU tensors anyway.
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(run.module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            sd = run.module.state_dict()
    else:
        sd = run.acc.get_state_dict(run.module)  # full weights on the main process (FSDP gathers)
    if sd is None:
        return {}
    # FSDP2 can hand back sharded DTensors (seen with gloo on CPU): gather them here; every
    # rank calls this, so the collective is matched.
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}

def export(run, folder: Path, sd: dict, final: bool = False) -> dict:
    """Write the model folder; returns the LoRA adapter tensors (empty without LoRA)."""
    lora = run.t.lora
    weights, adapter = merged_state_dict(sd, lora if lora.enabled else None)
    if final and lora.enabled and not lora.merge_on_export:
        save_peft_adapter(folder, adapter, lora, run.recipe.model.name_or_path, run.tokenizer)
        return adapter
    save_model_folder(folder, weights, run.acc.unwrap_model(run.module).model.config, run.tokenizer)
    return adapter

def save_checkpoint(run, history: list) -> Path:
    """Write checkpoint ``step-N`` (a temporary folder, fsynced and renamed): a full disk is one error
    naming the checkpoint, and the half-written folder is removed by the next run."""
    from dllm_align.core.io import disk_errors

    with disk_errors(run.out / CHECKPOINTS / f"step-{run.step}", "write checkpoint"):
        return _save_checkpoint(run, history)


def _save_checkpoint(run, history: list) -> Path:
    from safetensors.torch import save_file

    root = run.out / CHECKPOINTS
    final = root / f"step-{run.step}"
    tmp = root / f".tmp-step-{run.step}"
    if run.main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    run.acc.wait_for_everyone()
    sd = state_dict_of(run)
    if run.main:
        adapter = export(run, tmp, sd)
        if adapter:
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(tmp / "adapter.safetensors"))
            (tmp / "adapter_config.json").write_text(json.dumps(run.t.lora.model_dump(), indent=2))
    if run.main:
        faults.at("kill_in_checkpoint", run.step)
    opt_sd = _local_tensors(run.optimizer.state_dict())
    if run.fsdp:
        torch.save(opt_sd, tmp / f"optimizer-rank{run.rank}.pt")
    elif run.main:
        torch.save(opt_sd, tmp / "optimizer.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / f"rng-rank{run.rank}.safetensors"))
    run.acc.wait_for_everyone()
    if run.main:
        state = {
            "version": STATE_VERSION,
            "model": run.recipe.model.name_or_path,
            "objective": run.t.objective,
            "step": run.step,
            "total_steps": run.total,
            "epoch": run.step // run.steps_per_epoch,
            "batch_in_epoch": run.step % run.steps_per_epoch,
            "global_batch_size": run.G,
            "seed": run.t.seed,
            "group_by_length": run.recipe.data.group_by_length,
            "units_digest": units_digest(run.units),
            "world_size": run.world,
            "fsdp": run.fsdp,
            "lora": run.t.lora.enabled,
            "examples_seen": run.examples_seen,
            "tokens_seen": run.tokens_seen,
            "elapsed_seconds": run.elapsed,
            "margin_watch": run.margin_watch.state(),
            # The checkpoint's own record of the settings it was trained with: a folder copied to another
            # node without its recipe.train.yaml is still checked against what really made it.
            "recipe": run.recipe.model_dump(mode="json"),
            "last_metrics": history[-1] if history else None,
        }
        from dllm_align.core.io import _fsync_dir, fsync_tree, write_checksums

        (tmp / STATE).write_text(json.dumps(state, indent=2))
        write_checksums(tmp)  # last: a folder whose checksums verify is complete
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        kept = sorted(
            (p for p in root.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
        for old in kept[: -run.t.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    run.acc.wait_for_everyone()
    return final

def load_state(run, folder: Path) -> None:
    from safetensors.torch import load_file

    from dllm_align.core.console import info

    st = read_state(folder)
    checks = [
        ("global batch size", st["global_batch_size"], run.G),
        ("train.seed", st["seed"], run.t.seed),
        ("data.group_by_length", st["group_by_length"], run.recipe.data.group_by_length),
        ("the training rows", st["units_digest"], units_digest(run.units)),
        ("train.lora.enabled", st["lora"], run.t.lora.enabled),
    ]
    for what, was, now in checks:
        if was != now:
            raise UserError(
                f"cannot resume from {folder}: {what} differs from the interrupted run ({was!r} then, {now!r} now)",
                hint="resume with the same recipe and data, or start a new run with --overwrite",
            )
    if st["fsdp"] != run.fsdp or (run.fsdp and st["world_size"] != run.world):
        raise UserError(
            f"cannot resume from {folder}: it was written by {st['world_size']} process(es) "
            f"{'with' if st['fsdp'] else 'without'} FSDP; resume with the same launch configuration"
        )
    name = f"optimizer-rank{run.rank}.pt" if run.fsdp else "optimizer.pt"
    opt_sd = torch.load(folder / name, map_location="cpu", weights_only=True)
    run.optimizer.load_state_dict(opt_sd)
    _reshard_optimizer_state(run.optimizer)
    rng_file = folder / f"rng-rank{run.rank}.safetensors"
    if not rng_file.exists():
        rng_file = folder / "rng-rank0.safetensors"
    rng = load_file(str(rng_file))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    run.step = int(st["step"])
    run.examples_seen = int(st["examples_seen"])
    run.tokens_seen = int(st["tokens_seen"])
    run.elapsed = float(st["elapsed_seconds"])
    run.margin_watch = type(run.margin_watch).from_state(st["margin_watch"], run.t.margin_watch_window)
    if st["total_steps"] != run.total and run.main:
        info(f"train: the interrupted run planned {st['total_steps']} steps; this one plans {run.total}")
    if run.main:
        info(f"train: resuming from {folder} (step {run.step} of {run.total})")


def prepare_output(recipe, resume: bool, overwrite: bool) -> Optional[Path]:
    """Check the run folder; returns the checkpoint to resume from (or None)."""
    from dllm_align.core.console import info

    out = Path(recipe.output_dir)
    ckpt = find_checkpoint(out)
    started = (out / CHECKPOINTS).exists() or (out / FINAL).exists() or (out / METRICS).exists()
    if resume:
        _finish_interrupted_export(out)
        _remove_partial_checkpoints(out)
        if ckpt is None:
            info(f"train: no checkpoint in {out / CHECKPOINTS}; starting from step 0")
        else:
            st = verify_checkpoint(ckpt)
            if st["model"] != recipe.model.name_or_path:
                raise UserError(
                    f"cannot resume from {ckpt}: it was trained from model {st['model']!r}, "
                    f"but model.name_or_path is now {recipe.model.name_or_path!r}",
                    hint="resume with the recipe the run started with, or start a new run with --overwrite",
                )
        return ckpt
    if started and not overwrite:
        raise UserError(
            f"{out} already holds a training run (checkpoints/, final/ or metrics.jsonl)",
            hint="continue it with --resume, or start again with --overwrite",
        )
    return None


def read_state(folder: Path) -> dict:
    """A checkpoint's ``trainer_state.json``, checked for the keys resuming needs (UserError otherwise)."""
    path = Path(folder) / STATE
    try:
        st = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"cannot resume from {folder}: {STATE} is unreadable ({type(e).__name__})",
                        hint="delete this checkpoint folder to resume from an earlier one") from None
    needed = ("version", "model", "step", "total_steps", "global_batch_size", "seed", "group_by_length", "units_digest",
              "world_size", "fsdp", "lora", "examples_seen", "tokens_seen", "elapsed_seconds", "margin_watch")
    if not isinstance(st, dict):
        raise UserError(f"cannot resume from {folder}: {STATE} is not a JSON object")
    if st.get("version") != STATE_VERSION:
        raise UserError(
            f"cannot resume from {folder}: {STATE} has format version {st.get('version')!r}, this dllm-align writes {STATE_VERSION}",
            hint="resume with the dllm-align version that wrote it, or start again with --overwrite",
        )
    missing = [k for k in needed if k not in st]
    if missing:
        raise UserError(f"cannot resume from {folder}: {STATE} lacks '{missing[0]}'")
    return st


def verify_checkpoint(folder: Path) -> dict:
    """Refuse a checkpoint whose files do not match their checksums; returns its state."""
    from dllm_align.core.io import verify_checksums

    older = sorted(
        (p for p in folder.parent.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit() and p != folder),
        key=lambda p: int(p.name[5:]),
    )
    hint = (f"delete {folder} to resume from {older[-1].name}" if older else f"delete {folder}") + ", or start again with --overwrite"
    verify_checksums(folder, what="checkpoint", hint=hint)
    return read_state(folder)


def _remove_partial_checkpoints(out: Path) -> None:
    """Temporary checkpoint folders of a killed run are never complete: remove them."""
    root = out / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-step-") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def _finish_interrupted_export(out: Path) -> None:
    """A ``.tmp-final`` whose checksums verify was complete when the run was killed: move it into place."""
    from dllm_align.core.console import info
    from dllm_align.core.io import _fsync_dir, verify_checksums

    tmp = out / TMP_FINAL
    if not tmp.is_dir():
        return
    complete = False
    if not (out / FINAL).exists():
        try:
            complete = verify_checksums(tmp, what="export", required=False)
        except UserError:
            complete = False
    if complete:
        os.replace(tmp, out / FINAL)
        _fsync_dir(out)
        info(f"train: finished the final export that an interrupted run had written ({out / FINAL})")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def _clear_previous(out: Path) -> None:
    _remove_partial_checkpoints(out)
    if (out / TMP_FINAL).exists():
        shutil.rmtree(out / TMP_FINAL)
    for name in (CHECKPOINTS, FINAL):
        if (out / name).exists():
            shutil.rmtree(out / name)
    for name in (METRICS,):
        if (out / name).exists():
            (out / name).unlink()

