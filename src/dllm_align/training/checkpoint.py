"""Checkpoints and exports of a training run: save, verify, resume, export.

``checkpoints/step-N/`` holds what trains: a full fine-tune's model in ``save_pretrained`` layout (safetensors,
config, tokenizer; under FSDP2 one file per process, each written by its process: :func:`save_model_shards`), a LoRA
run's adapters alone (``adapter.safetensors``: the frozen base is read again from the model the recipe names, and
never gathered), the optimiser state (plain tensors, read back with ``weights_only=True``), the RNG state
(safetensors), ``trainer_state.json`` (the run's record, the step, the data position and what the margin watch needs
to continue) and ``checksums.json`` (size and sha256 of every other file), written last. It is written to a temporary
folder, fsynced and renamed into place, so a folder named ``step-N`` is always complete. ``--resume`` verifies every
checksum of the newest one before loading anything (a truncated or modified file is refused by name), then continues;
the data order, the masks and the learning rate are functions of the step, so the resumed run follows the
uninterrupted one exactly. ``final/`` is written the same way; an export killed after it was complete but before the
rename is finished by the next ``--resume``."""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from dllm_align.config.schema import LoraSection
from dllm_align.core import faults
from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.core.io import disk_errors, fsync_dir, fsync_tree, verify_checksums, write_checksums
from dllm_align.core.runfolder import check_all_see
from dllm_align.models.export import (drop_own_keys, published_state, tokenizer_files, tokenizer_signature,
                                      write_published_layout, write_published_tokenizer)
from dllm_align.models.families import family_for_config
from dllm_align.models.load import load_tokenizer
from dllm_align.training.monitor import MarginWatch

# lazy imports: peft: an optional extra; only LoRA runs save adapters
# lazy imports: torch.distributed.tensor: public from torch 2.5 (pyproject allows 2.4); only FSDP2 states hold DTensors
# lazy imports: torch.distributed.fsdp: the FSDP1 names, which only an FSDP1 run needs

CHECKPOINTS = "checkpoints"
FINAL = "final"
METRICS = "metrics.jsonl"
STATE = "trainer_state.json"
STATE_VERSION = 2
TMP_FINAL = ".tmp-final"
ADAPTER = "adapter.safetensors"  # a LoRA checkpoint's adapters, as resuming reads them
ADAPTER_DIR = "adapter"  # final/'s PEFT adapter folder beside a merged model


@dataclass
class TrainState:
    """What changes as a run trains and continues from a checkpoint."""

    margin_watch: MarginWatch
    step: int = 0  # optimiser steps done
    examples_seen: int = 0
    tokens_seen: int = 0
    elapsed: float = 0.0  # seconds spent in steps


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint records about the run that wrote it; resuming refuses a run that differs."""

    model: str  # model.name_or_path
    objective: str
    total_steps: int
    steps_per_epoch: int
    global_batch_size: int
    seed: int
    group_by_length: bool
    units_digest: str
    world_size: int
    fsdp: bool
    lora: bool
    # The checkpoint's own record of the settings it was trained with: a folder copied to another
    # node without its recipe.train.yaml is still checked against what really made it.
    recipe: dict = field(repr=False)


@dataclass(frozen=True)
class Saver:
    """The wrapped policy and what writing it needs (every process calls the savers: FSDP gathers)."""

    accelerator: object
    module: torch.nn.Module
    tokenizer: object
    fsdp: bool
    rank: int
    main: bool


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


def merged_in(weights: dict, dtype: str) -> dict:
    """The merged model's floating-point weights in ``dtype`` (``train.lora.merged_dtype``: the merge was computed in
    fp32, this rounds it once); integer tensors as they are."""
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    return {k: v.to(dt) if v.is_floating_point() else v for k, v in weights.items()}


def save_model_folder(folder: Path, state_dict: dict, config, tokenizer, max_shard_size: str = "5GB",
                      rename=None) -> None:
    """Write weights (safetensors, sharded like ``save_pretrained``), config and tokenizer. ``rename``: applied to
    the state dict once a tied output layer is dropped (the published weight names of an export)."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = dict(state_dict)
    if getattr(config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied: the loader re-ties it
    skips = family_for_config(config).export_skips
    if skips is not None:
        sd = {k: v for k, v in sd.items() if not skips(k)}
    if rename is not None:
        sd = rename(sd)
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


def save_model_shards(folder: Path, saver: Saver) -> None:
    """A full fine-tune's checkpoint under FSDP2, in ``save_pretrained``'s sharded layout, written by every process:
    each weight is gathered alone (every process calls this: the gathers are matched) and kept by the process that
    owns it (weight i: process i mod N), which writes its own ``model-0000r-of-0000N.safetensors``; the main process
    writes the index, config and tokenizer. A process holds one gathered weight and its own part (about 1/N of the
    model), never the whole."""
    acc = saver.accelerator
    module = acc.unwrap_model(saver.module)
    config = module.model.config
    sd = module.state_dict()
    name = {k: k.replace("_checkpoint_wrapped_module.", "").removeprefix("model.") for k in sd}
    skips = family_for_config(config).export_skips
    tied = getattr(config, "tie_word_embeddings", False)
    keys = [k for k in sd if not (tied and name[k] == "lm_head.weight") and not (skips is not None and skips(name[k]))]
    world = acc.num_processes
    files = [f"model-{r + 1:05d}-of-{world:05d}.safetensors" for r in range(world)]
    mine = {}
    for i, k in enumerate(keys):
        v = sd[k]
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        if i % world == saver.rank:
            mine[name[k]] = full.detach().cpu().contiguous()
        del full
    save_file(mine, str(folder / files[saver.rank]), metadata={"format": "pt"})
    if saver.main:
        index = {"metadata": {"total_size": sum(sd[k].numel() * sd[k].element_size() for k in keys)},
                 "weight_map": {name[k]: files[i % world] for i, k in enumerate(keys)}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        cfg = copy.deepcopy(config)
        dtypes = {sd[k].dtype for k in keys}
        if len(dtypes) == 1:
            cfg.dtype = next(iter(dtypes))
        cfg.save_pretrained(str(folder))
        saver.tokenizer.save_pretrained(str(folder))


def save_peft_adapter(folder: Path, adapter: dict, lora, base_model: str, tokenizer) -> None:
    """A PEFT adapter folder (``PeftModel.from_pretrained(base, folder)`` loads it)."""
    from peft import LoraConfig

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
                # the parameter's global shape, said: inferred from the local shard it is wrong wherever a
                # parameter's rows do not divide by the processes (each rank's moments then had another global
                # shape, and the first step after resuming failed: why DiffusionGemma's FSDP2 runs could not resume)
                st[k] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())


def state_dict_of(saver: Saver) -> dict:
    acc, module = saver.accelerator, saver.module
    if saver.fsdp and not getattr(acc, "is_fsdp2", False) and acc.device.type == "cpu":
        # FSDP1's offload_to_cpu (accelerate's choice) crashes when the shards already live on
        # the CPU (gloo); there the gathered tensors are CPU tensors anyway.
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            sd = module.state_dict()
    else:
        sd = acc.get_state_dict(module)  # full weights on the main process (FSDP gathers)
    if sd is None:
        return {}
    # FSDP2 can hand back sharded DTensors (seen with gloo on CPU): gather them here; every
    # rank calls this, so the collective is matched.
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}


def adapter_state(saver: Saver) -> dict:
    """The LoRA adapters by their names in the model (``...q_proj.lora_A.default.weight``), whole on every process:
    each sharded one is gathered alone (every process calls this: the gathers are matched), so no process gathers
    the frozen base. An FSDP1 module's flat parameters are gathered through its full state dict."""
    if saver.fsdp and not getattr(saver.accelerator, "is_fsdp2", False):
        return _adapters_of(state_dict_of(saver))
    out = {}
    for name, p in saver.accelerator.unwrap_model(saver.module).named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    return _adapters_of(out)


def _adapters_of(sd: dict) -> dict:
    return {k.replace("_checkpoint_wrapped_module.", "").removeprefix("model."): v
            for k, v in sd.items() if ".lora_A." in k or ".lora_B." in k}


def export(saver: Saver, folder: Path, sd: dict, lora: LoraSection, base_model: str, final: bool = False,
           source: Optional[Path] = None, code: Optional[Path] = None, source_config: Optional[dict] = None,
           tokenizer_source: Optional[Path] = None) -> dict:
    """Write the model folder; returns the LoRA adapter tensors (empty without LoRA).

    A checkpoint (``final=False``) keeps the native layout it resumes from. The final model is written in its
    family's published layout (:mod:`dllm_align.models.export`: the published config.json identity, weight names,
    and from ``source``, the folder the run started from, its remote code and generation config; from ``code``, a
    folder of the family's published modeling files, when the source has none), so the published code and the
    serving engines load it as the original; dllm-align reads it back to the same numbers. Without the remote code
    the folder names no ``auto_map`` (said on stderr). ``source_config``: ``source``'s config.json as already read.
    Its tokenizer is the one the published stacks read (:func:`tokenizer_unchanged`, ``models.export.write_published_tokenizer``; ``tokenizer_source``: the folder
    the run's tokenizer came from, None when none)."""
    weights, adapter = merged_state_dict(sd, lora if lora.enabled else None)
    # the source's tokenizer loaded again and compared once, for each folder final/ writes (its config.json as read)
    tok_config = source_config if tokenizer_source is not None and tokenizer_source == source else None
    unchanged = final and tokenizer_unchanged(saver.tokenizer, tokenizer_source, tok_config)
    if final and lora.enabled and not lora.merge_on_export:
        save_peft_adapter(folder, adapter, lora, base_model, saver.tokenizer)
        write_published_tokenizer(folder, tokenizer_source, unchanged)
        return adapter
    if final and lora.enabled and lora.merged_dtype != "trained":
        weights = merged_in(weights, lora.merged_dtype)
    if final and lora.enabled:
        # the adapters beside the merged model, in a folder of their own: an adapter_config.json at the top would
        # make transformers read final/ as an adapter of the base rather than as the merged model
        save_peft_adapter(folder / ADAPTER_DIR, adapter, lora, base_model, saver.tokenizer)
        write_published_tokenizer(folder / ADAPTER_DIR, tokenizer_source, unchanged)
    config = saver.accelerator.unwrap_model(saver.module).model.config
    if not final:
        save_model_folder(folder, weights, config, saver.tokenizer)
        return adapter
    fam = family_for_config(config)
    family = fam.name
    if fam.published is None:  # transformers' own layout: the config less dllm-align's keys
        save_model_folder(folder, weights, config, saver.tokenizer)
        if fam.export_extras is not None:
            fam.export_extras(folder, config, saver.tokenizer, source)
        drop_own_keys(folder)
        write_published_tokenizer(folder, tokenizer_source, unchanged)
        return adapter
    save_model_folder(folder, weights, config, saver.tokenizer, rename=lambda s: published_state(family, s))
    cfg = write_published_layout(folder, family, source, code, source_config)
    write_published_tokenizer(folder, tokenizer_source, unchanged)
    if "auto_map" not in cfg:
        info(f"export: the final model carries no {family} remote code (neither the model's folder nor "
             f"model.published_code has the files), so its config.json names no auto_map: it loads through "
             f"dllm-align and the serving engines that know {cfg['architectures'][0]}; for the published code's "
             f"trust_remote_code load set model.published_code to a folder of its modeling files (docs/serving.md)")
    return adapter


def tokenizer_unchanged(tokenizer, source: Optional[Path], source_config: Optional[dict] = None) -> bool:
    """Whether ``tokenizer`` is the one ``source``'s own tokenizer files load (same vocabulary, special tokens, chat
    template): then the export copies those files byte for byte, the form the family's published stack reads
    (``models.export.write_published_tokenizer``). ``source_config``: its config.json, if already read."""
    if not tokenizer_files(source):
        return False
    try:
        cfg_file = Path(source) / "config.json"  # the family's fix-ups (Dream's native twin of its remote class)
        cfg = source_config or (json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else None)
        again = load_tokenizer(source, family=family_for_config(cfg) if cfg is not None else None)
        return tokenizer_signature(again) == tokenizer_signature(tokenizer)
    except (UserError, OSError, ValueError):
        return False  # the saved tokenizer is written anew: nothing is claimed about the source's files


def save_checkpoint(out: Path, saver: Saver, optimizer, record: RunRecord, state: TrainState, history: list,
                    lora: LoraSection, keep: int) -> Path:
    """Write checkpoint ``step-N`` of run folder ``out`` (a temporary folder, fsynced and renamed): a full disk is
    one error naming the checkpoint, and the half-written folder is removed by the next run. ``keep``: how many
    checkpoints stay."""
    with disk_errors(out / CHECKPOINTS / f"step-{state.step}", "write checkpoint"):
        return _save_checkpoint(out, saver, optimizer, record, state, history, lora, keep)


def _save_checkpoint(out: Path, saver: Saver, optimizer, record: RunRecord, state: TrainState, history: list,
                     lora: LoraSection, keep: int) -> Path:
    acc, main = saver.accelerator, saver.main
    root = out / CHECKPOINTS
    final = root / f"step-{state.step}"
    tmp = root / f".tmp-step-{state.step}"
    if main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    acc.wait_for_everyone()
    # every rank writes into the folder rank 0 just made (its RNG state, its optimizer shard): on a network
    # filesystem the other nodes may see it late, so they wait for it (bounded) before writing
    check_all_see(tmp, "checkpoint folder")
    if lora.enabled:
        # what trains: the adapters (with the optimiser's state below), never the frozen base, which resuming
        # reads from the model the recipe names
        adapter = adapter_state(saver)
        if main:
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER))
            (tmp / "adapter_config.json").write_text(json.dumps(lora.model_dump(), indent=2))
    elif saver.fsdp and getattr(acc, "is_fsdp2", False):
        save_model_shards(tmp, saver)  # every process writes its part: none gathers the whole model
    else:
        sd = state_dict_of(saver)
        if main:
            export(saver, tmp, sd, lora, record.model)
    if main:
        faults.at("kill_in_checkpoint", state.step)
    opt_sd = _local_tensors(optimizer.state_dict())
    if saver.fsdp:
        torch.save(opt_sd, tmp / f"optimizer-rank{saver.rank}.pt")
    elif main:
        torch.save(opt_sd, tmp / "optimizer.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / f"rng-rank{saver.rank}.safetensors"))
    acc.wait_for_everyone()
    if main:
        r = asdict(record)
        doc = {
            "version": STATE_VERSION,
            "model": r["model"],
            "objective": r["objective"],
            "step": state.step,
            "total_steps": r["total_steps"],
            "epoch": state.step // record.steps_per_epoch,
            "batch_in_epoch": state.step % record.steps_per_epoch,
            "global_batch_size": r["global_batch_size"],
            "seed": r["seed"],
            "group_by_length": r["group_by_length"],
            "units_digest": r["units_digest"],
            "world_size": r["world_size"],
            "fsdp": r["fsdp"],
            "lora": r["lora"],
            "examples_seen": state.examples_seen,
            "tokens_seen": state.tokens_seen,
            "elapsed_seconds": state.elapsed,
            "margin_watch": state.margin_watch.state(),
            "recipe": r["recipe"],
            "last_metrics": history[-1] if history else None,
        }

        (tmp / STATE).write_text(json.dumps(doc, indent=2))
        write_checksums(tmp)  # last: a folder whose checksums verify is complete
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        kept = sorted(
            (p for p in root.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
        for old in kept[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def load_state(folder: Path, record: RunRecord, optimizer, *, rank: int, main: bool, margin_window: int) -> TrainState:
    """Continue from checkpoint ``folder``: refuse one written by another run than ``record``'s, load the
    optimiser's and this rank's RNG state, and return the state to continue from."""
    st = read_state(folder)
    checks = [
        ("global batch size", st["global_batch_size"], record.global_batch_size),
        ("train.seed", st["seed"], record.seed),
        ("data.group_by_length", st["group_by_length"], record.group_by_length),
        ("the training rows", st["units_digest"], record.units_digest),
        ("train.lora.enabled", st["lora"], record.lora),
    ]
    for what, was, now in checks:
        if was != now:
            raise UserError(
                f"cannot resume from {folder}: {what} differs from the interrupted run ({was!r} then, {now!r} now)",
                hint="resume with the same recipe and data, or start a new run with --overwrite",
            )
    if st["fsdp"] != record.fsdp or (record.fsdp and st["world_size"] != record.world_size):
        raise UserError(
            f"cannot resume from {folder}: it was written by {st['world_size']} process(es) "
            f"{'with' if st['fsdp'] else 'without'} FSDP; resume with the same launch configuration"
        )
    name = f"optimizer-rank{rank}.pt" if record.fsdp else "optimizer.pt"
    opt_sd = torch.load(folder / name, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt_sd)
    _reshard_optimizer_state(optimizer)
    rng_file = folder / f"rng-rank{rank}.safetensors"
    if not rng_file.exists():
        rng_file = folder / "rng-rank0.safetensors"
    rng = load_file(str(rng_file))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    state = TrainState(
        margin_watch=MarginWatch.from_state(st["margin_watch"], margin_window),
        step=int(st["step"]),
        examples_seen=int(st["examples_seen"]),
        tokens_seen=int(st["tokens_seen"]),
        elapsed=float(st["elapsed_seconds"]),
    )
    if st["total_steps"] != record.total_steps and main:
        info(f"train: the interrupted run planned {st['total_steps']} steps; this one plans {record.total_steps}")
    if main:
        info(f"train: resuming from {folder} (step {state.step} of {record.total_steps})")
    return state


def prepare_output(recipe, resume: bool, overwrite: bool) -> Optional[Path]:
    """Check the run folder; returns the checkpoint to resume from (or None)."""
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
        fsync_dir(out)
        info(f"train: finished the final export that an interrupted run had written ({out / FINAL})")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def clear_previous(out: Path) -> None:
    """Remove what an earlier run left in ``out`` that a fresh run makes again: its checkpoints (partial ones
    too), its final export (finished or not) and its metrics."""
    _remove_partial_checkpoints(out)
    if (out / TMP_FINAL).exists():
        shutil.rmtree(out / TMP_FINAL)
    for name in (CHECKPOINTS, FINAL):
        if (out / name).exists():
            shutil.rmtree(out / name)
    for name in (METRICS,):
        if (out / name).exists():
            (out / name).unlink()

