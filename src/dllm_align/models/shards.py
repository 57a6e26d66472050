"""Loading without a full copy per process: a model made with empty host storage (allocated, never written) and,
once FSDP2 has sharded it, each process reading only its own rows of each weight from the safetensors files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from dllm_align.core.errors import UserError
from dllm_align.models.families.base import WeightSources, rebuild_rotary, safetensors_files


def empty_transformers_model(path: Path, cls, conf, kw: dict) -> tuple[Any, Optional[WeightSources]]:
    """``(model, sources)``: a transformers model with empty weights (storage allocated, never written) and where each
    lies in ``path``'s safetensors, when the files name exactly the model's weights in its own layout; else
    ``(None, None)`` (loaded as usual). Every buffer outside the files must be one the load rebuilds (rotary)."""
    sources: WeightSources = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                sources[k] = (f, k)
    with torch.device("meta"):
        model = cls.from_config(conf, dtype=kw["dtype"], **{k: v for k, v in kw.items() if k == "attn_implementation"})
    names = set(model.state_dict())
    tied = {"lm_head.weight"} if getattr(conf, "tie_word_embeddings", False) else set()
    loose = {n for n, _ in model.named_buffers() if n not in names and not n.endswith("inv_freq")}
    if names - tied != set(sources) - tied or loose:
        return None, None
    model.to_empty(device="cpu")  # read later, each process its shard (read_weight_shards)
    if tied:
        model.tie_weights()
    rebuild_rotary(model)
    return model, sources


def read_weight_shards(module: torch.nn.Module, sources: WeightSources, prefix: str = "") -> int:
    """Fill a model loaded with empty weights, its parameters sharded (FSDP2: each a DTensor split along dim 0), from
    the files ``sources`` names: each process reads only its own rows of each weight, in the stored dtype, and casts
    them into its shard, so no process holds a full copy at any point. ``prefix``: where the loaded model sits in
    ``module`` (the scorer's ``model.``); peft's ``.base_layer`` and activation checkpointing's wrapper are seen
    through. Returns the bytes read here; a weight the files lack is an error."""
    read = 0
    done = set()
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            key = _native_name(name, prefix)
            if key not in sources or key in done:
                if key not in sources and ".lora_" not in name and not name.endswith("inv_freq"):
                    raise UserError(f"no weight for {key} in the model's files")
                continue
            done.add(key)
            f, k = sources[key]
            local = p.to_local() if hasattr(p, "to_local") else p
            start, stop = 0, local.shape[0] if local.dim() else None
            if hasattr(p, "to_local"):
                if len(p.placements) != 1 or getattr(p.placements[0], "dim", None) != 0:
                    raise UserError(f"{key}: sharded as {p.placements}, expected rows (dim 0)")
                chunk = -(-p.shape[0] // p.device_mesh.size())
                start = p.device_mesh.get_local_rank() * chunk
                stop = start + local.shape[0]
            if local.numel() == 0:
                continue
            # the file is opened per weight: its mapped pages stay resident only while this weight is read
            with safe_open(str(f), framework="pt") as sf:
                part = sf.get_slice(k)[start:stop] if local.dim() else sf.get_tensor(k)
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                # the whole-model check (families.base.check_finite) cannot read empty storage: each shard here
                raise UserError(f"{f}: weight {k!r} holds NaN or infinite values",
                                hint="the weights were damaged or modified; use an earlier checkpoint")
            local.copy_(part.to(local.dtype))
            read += part.numel() * part.element_size()
    missing = set(sources) - done - {"lm_head.weight"}
    if missing:
        raise UserError(f"weights never placed in the model: {sorted(missing)[:3]}")
    return read


def _native_name(name: str, prefix: str) -> str:
    """A parameter's name in the loaded model: ``prefix`` (the wrapping module's attribute) and the wrappers' parts
    (activation checkpointing's, peft's base layer) removed."""
    name = name.replace("_checkpoint_wrapped_module.", "").replace(".base_layer.", ".")
    return name.removeprefix(prefix)
