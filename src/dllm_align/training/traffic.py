"""What the gradient and weight collectives move per optimiser step, from the model's shape, the recipe and
the launch alone (``dllm-align doctor``): the bytes each node sends over its link to the other nodes.

The collectives of our launches (N processes on M nodes of G GPUs each):

* FSDP, full shard over all N processes: every micro-batch all-gathers every parameter before its forward
  and, with ``reshard_after_forward`` (the shipped configs), again before its backward, in the dtype the units
  hold (``model.dtype``; decoder layers in bf16 under ``train.fsdp_gather: bf16_layers``); then it
  reduce-scatters the gradients, in fp32, of the parameters that have them (frozen ones have none: under
  LoRA only the adapters). Every micro-batch, not every step: the loop reduce-scatters each one
  (``training.loop.Run.sync``), and a frozen weight is gathered for every forward all the same.
* DDP: one all-reduce of the trainable parameters' fp32 gradients per step (the other micro-batches skip it).

Bytes on the link: in the ring algorithm (NCCL's for all-gather and reduce-scatter, and one of its all-reduce
algorithms) a collective over a tensor of S bytes moves (N-1)/N x S over every link of the ring (an
all-reduce twice that: a reduce-scatter then an all-gather). With the ranks of a node next to each other,
M of the ring's links cross between nodes, one leaving each node: each node sends (N-1)/N x S per
all-gather or reduce-scatter to the next node, and receives as much. A hierarchical algorithm can bring a
byte into a node once, (M-1)/M x S: the lower bound, shown too. On one node nothing crosses a node
boundary; the per-GPU volume over NVLink is shown instead.
"""

from __future__ import annotations

import math

from dllm_align.core.errors import UserError
from dllm_align.objective.base import objective_for
from dllm_align.objective.elbo import get_likelihood
from dllm_align.training.memory import Launch, ModelShape
from dllm_align.training.plan import grad_accum_for

GB = 1e9
# What one node of 8 H100s usually has towards the other nodes: 8 x 400 Gb/s InfiniBand / RoCE NICs.
NODE_LINK_BYTES_PER_S = 8 * 400e9 / 8


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def traffic(shape: ModelShape, recipe, launch: Launch) -> dict:
    """Bytes per optimiser step over the inter-node link of each node, with the arithmetic (module docstring)."""
    t = recipe.train
    N, M, G = launch.processes, launch.machines, launch.per_machine
    P = shape.params
    T = shape.lora_params(t.lora.r, list(t.lora.target_modules)) if t.lora.enabled else P
    wbytes = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    try:
        accum = grad_accum_for(t, N)
    except UserError as e:  # the launch cannot run this recipe at all: said, as a problem of the report
        return {"processes": N, "machines": M, "gpus_per_machine": G, "problem": e.message, "collectives": []}
    # forward calls per micro-batch: train.rows_per_forward splits a micro-batch's rows (as the memory estimate counts
    # them) into several forwards, and FSDP gathers every unit again for each call and its backward
    foot = get_likelihood(recipe.reference.likelihood or shape.likelihood).footprint(shape, recipe.train_n_mc(), recipe.data.max_length, 2)
    rows = t.batch_size * objective_for(t).rows_per_unit * foot.rows
    forwards = math.ceil(rows / t.rows_per_forward) if t.rows_per_forward else 1
    ring = (N - 1) / N
    out: dict = {"processes": N, "machines": M, "gpus_per_machine": G, "micro_batches_per_step": accum,
                 "forwards_per_micro_batch": forwards,
                 "trainable": T, "params": P, "collectives": [], "method": "ring: (N-1)/N x S per all-gather / "
                 "reduce-scatter, 2 (N-1)/N x S per all-reduce, leaving each node (lower bound (M-1)/M x S)"}
    lines = out["collectives"]
    if N == 1:
        out.update(per_node_bytes=0, per_gpu_bytes=0, lower_bound_bytes=0, seconds_at_node_link=0.0,
                   note="one process: no collectives")
        return out
    if launch.fsdp:
        bf16_layers = t.fsdp_gather == "bf16_layers" and launch.fsdp_version == 2 and _autocast(recipe, launch)
        root = shape.embedding_params + shape.hidden
        body = P - root
        gathered = root * wbytes + body * (2 if bf16_layers else wbytes)
        how = f"{P / 1e9:.2f}B params x {wbytes} B" if not bf16_layers else \
            f"root {root / 1e9:.2f}B x {wbytes} B + layers {body / 1e9:.2f}B x 2 B (bf16_layers)"
        gathers = 2 if launch.reshard_after_forward else 1
        per_fwd = f" x {forwards} forwards (train.rows_per_forward)" if forwards > 1 else ""
        lines.append({"what": "all-gather of the weights" + (" (forward and backward)" if gathers == 2 else " (forward)"),
                      "tensor_bytes": gathered, "times": gathers * forwards * accum, "factor": ring,
                      "how": f"{how} = {_gb(gathered)}, x {gathers} per forward{per_fwd} x {accum} micro-batch(es)"})
        lines.append({"what": "reduce-scatter of the gradients (fp32" + (", LoRA adapters only)" if t.lora.enabled else ")"),
                     "tensor_bytes": T * 4, "times": accum, "factor": ring,
                     "how": f"{T / 1e9:.4g}B trainable x 4 B = {_gb(T * 4)}, x {accum} micro-batch(es)"})
    else:
        lines.append({"what": "all-reduce of the gradients (fp32" + (", LoRA adapters only)" if t.lora.enabled else ")"),
                     "tensor_bytes": T * 4, "times": 1, "factor": 2 * ring,
                     "how": f"{T / 1e9:.4g}B trainable x 4 B = {_gb(T * 4)}, once per step"})
    per_gpu = 0.0
    for r in lines:
        r["bytes_per_step"] = r["tensor_bytes"] * r["times"] * r["factor"]
        per_gpu += r["bytes_per_step"]
    volume = sum(r["tensor_bytes"] * r["times"] * r["factor"] / ring for r in lines)  # the S x times of every row
    if M == 1:
        out.update(per_node_bytes=0, lower_bound_bytes=0, per_gpu_bytes=per_gpu, seconds_at_node_link=0.0,
                   note=f"one node: nothing crosses a node boundary; each GPU sends {_gb(per_gpu)} per step over NVLink")
        return out
    lower = volume * (M - 1) / M
    out.update(per_node_bytes=per_gpu, lower_bound_bytes=lower, per_gpu_bytes=per_gpu,
               seconds_at_node_link=per_gpu / NODE_LINK_BYTES_PER_S,
               note=f"{_gb(per_gpu)} leave (and enter) each node per step; at {NODE_LINK_BYTES_PER_S / GB:.0f} GB/s per node "
                    f"(8 x 400 Gb/s NICs) that is {per_gpu / NODE_LINK_BYTES_PER_S:.2f} s per step, unless overlapped with compute")
    return out


def _autocast(recipe, launch: Launch) -> bool:
    mode = recipe.train.mixed_precision
    return mode in ("bf16", "fp16") or (mode == "auto" and launch.source != Launch().source)


def render(tr: dict) -> list[str]:
    """The report's lines (``doctor``'s text output)."""
    N, M, G = tr["processes"], tr["machines"], tr["gpus_per_machine"]
    if "problem" in tr:
        return [f"traffic per optimiser step ({M} node(s) x {G} GPU(s))", f"  ! {tr['problem']}"]
    lines = [f"traffic per optimiser step ({M} node(s) x {G} GPU(s), {tr['micro_batches_per_step']} micro-batch(es) per step)"]
    if N == 1:
        return lines + [f"  {tr['note']}"]
    ring = f"({N}-1)/{N}"
    for r in tr["collectives"]:
        f = ring if r["factor"] < 1 else f"2 x {ring}"
        lines.append(f"  {r['what']}: {r['how']}")
        lines.append(f"    x {r['times']} x {f} = {_gb(r['bytes_per_step'])}")
    if M > 1:
        lines.append(f"  per node over the inter-node link: {_gb(tr['per_node_bytes'])} each way "
                     f"(lower bound, hierarchical: {_gb(tr['lower_bound_bytes'])})")
    lines.append(f"  {tr['note']}")
    return lines
