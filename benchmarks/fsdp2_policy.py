"""Is a cheaper FSDP2 precision policy faithful? (measurement, 2 gloo processes on the CPU)

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp2_policy.py [--model builtin:small] [--json OUT]

Compares the bf16-autocast target log-probabilities of one batch (4 rows x 96 tokens, half scored)
under three FSDP2 precision policies with the single-process reference (its Linears stored in bf16,
dllm_align.models.precision.prepare_reference: the values the cache holds):

* ``current``: every unit gathered in fp32 (``param_dtype=None``), reduction fp32 (what training uses);
* ``layers_bf16``: decoder layers gathered in bf16 with fp32 reduction and no input casting
  (``MixedPrecisionPolicy(bf16, fp32, cast_forward_inputs=False)``), embeddings / final norm / head fp32;
* ``layers_bf16_norms_fp32``: the same, with each decoder layer's norms their own fp32 units;
* ``all_bf16``: every unit gathered in bf16 with the inputs cast (FSDP2's usual bf16 policy).

Each is measured twice: on the model's own weights (every value on the bf16 grid: norm weights 1.0,
as in a bf16-distributed checkpoint such as LLaDA's) and after moving every weight off the bf16 grid
(fp32 noise of 1e-3 relative: what fp32 master weights look like after some optimiser steps). It also
reports the bytes each rank all-gathers per forward under each policy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DLLM_ALIGN_NO_PROGRESS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv=None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dllm_align.models.load import load_model
    from dllm_align.models.precision import Precision, prepare_reference
    from dllm_align.training.policy import PolicyScorer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    prec = Precision(torch.float32, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    R, T = 4, 96
    ids = torch.randint(0, 250, (R, T), generator=g)
    rows = torch.arange(R).repeat_interleave(T // 2)
    cols = torch.cat([torch.randperm(T, generator=g)[: T // 2] for _ in range(R)])
    tg = ids[rows, cols]
    f32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    layers_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    all_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policies = {"current": (f32, f32), "layers_bf16": (layers_bf16, f32), "layers_bf16_norms_fp32": (layers_bf16, f32),
                "all_bf16": (all_bf16, all_bf16)}
    out: dict = {"model": a.model, "rows": R, "tokens": T, "results": {}}
    for weights in ("on_bf16_grid", "off_bf16_grid"):
        base = load_model(a.model, dtype="float32")
        if weights == "off_bf16_grid":
            gw = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in base.model.parameters():
                    p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gw))
        ref = copy.deepcopy(base)
        prepare_reference(ref.model, prec)
        ref.set_precision(prec)
        with torch.no_grad():
            want = ref.target_logprobs(ids, None, rows, cols, tg)
        for name, (layer_pol, root_pol) in policies.items():
            mp = copy.deepcopy(base)
            mp.set_precision(prec)
            layers = mp.model.model.layers
            n_layer = sum(p.numel() for p in layers.parameters())
            n_root = sum(p.numel() for p in mp.model.parameters()) - n_layer
            for layer in layers:
                if name == "layers_bf16_norms_fp32":  # each norm its own fp32 unit inside the bf16 layer
                    for m in layer.modules():
                        if "Norm" in type(m).__name__:
                            fully_shard(m, mp_policy=f32)
                fully_shard(layer, mp_policy=layer_pol)
            scorer = PolicyScorer(mp)  # the root unit, as training wraps it
            fully_shard(scorer, mp_policy=root_pol)
            with torch.no_grad():
                got = scorer(ids, None, rows, cols, tg)
            n_norm = sum(p.numel() for m in layers.modules() if "Norm" in type(m).__name__ for p in m.parameters(recurse=False))
            lb = 2 if layer_pol.param_dtype == torch.bfloat16 else 4
            rb = 2 if root_pol.param_dtype == torch.bfloat16 else 4
            out["results"].setdefault(weights, {})[name] = {
                "max_abs_delta_per_position": float((got - want).abs().max()),
                "max_abs_delta_row_sum": float(torch.zeros(R).index_add(0, rows, (got - want).double().float()).abs().max()),
                "gathered_bytes_per_forward": n_layer * lb + n_root * rb + (n_norm * 2 if name == "layers_bf16_norms_fp32" else 0),
                "all_gathers_per_forward": len(layers) * (1 + (2 if name == "layers_bf16_norms_fp32" else 0)) + 1,
            }
    if rank == 0:
        text = json.dumps(out, indent=1)
        print(text)
        if a.json:
            Path(a.json).write_text(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
