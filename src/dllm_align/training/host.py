"""Host memory while a training process loads its model (``dllm-align doctor``'s host-RAM line), from the model's
``config.json`` alone, as :func:`dllm_align.training.policy.load_policy` and the reference load it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_align.objective.base import objective_for
from dllm_align.training.memory import GiB, Launch, ModelShape


# Published checkpoints are split into safetensors files of at most this size (transformers' default shard size).
FILE_BYTES = 5 * 10**9
_STORED = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class HostRam:
    """Host memory while the model loads, per process and per node (``doctor``'s host-RAM line), with the arithmetic."""

    per_process: int
    per_node: int
    processes_per_node: int
    sharded_read: bool  # each process reads its own shard of each weight (FSDP2, a family that reads by name)
    why: str


def stored_bytes(cfg: dict) -> int:
    """Bytes per weight as the checkpoint stores them (config.json's dtype; 4 where it does not say)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    return _STORED.get(str(name).removeprefix("torch."), 4)


def largest_weight(shape: ModelShape) -> int:
    """Elements of the largest single weight a checkpoint stores (the embedding, an MLP or expert matrix, a fused
    attention projection)."""
    d = shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return max(shape.vocab * d, d * shape.intermediate, d * (shape.expert_intermediate or 0), d * (q + 2 * kv))


def host_loading(shape: ModelShape, recipe, launch: Launch, *, reads_by_name: bool, has_files: bool,
                 gpu: bool) -> HostRam:
    """Peak host bytes while a training process loads (``training.policy.load_policy``, the reference, the wrap),
    as the code does it:

    * FSDP2 on several processes, a family that reads by name: the model is made with empty storage (no page
      resident) and, once sharded, each process reads its rows of each weight from the files
      (``models.load.read_weight_shards``): its shard (P x w / N; on a GPU it goes to the device, so the host holds
      none) and one weight's rows at a time in transit (stored, mapped file pages and the cast copy);
    * otherwise each process reads the whole model at the weights' dtype (each tensor in its stored dtype, cast
      one at a time: P x w) while one safetensors file is mapped (at most 5 GB), and under FSDP holds it until it
      is sharded;
    * an online reference is read whole on the host (P x w) before it moves to the device: beside the policy
      where the policy is still on the host (FSDP before sharding, or a CPU run);
    * at the end, final/'s model (a full fine-tune's, or LoRA merged) is gathered whole on the main process's host
      (P x w); a LoRA run that keeps the adapters alone gathers none. The node needs the larger of the two moments.
    """
    t = recipe.train
    P, N = shape.params, launch.processes if launch.fsdp else 1
    w = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    s = stored_bytes(shape.config) if has_files else w
    big = largest_weight(shape)
    file_pages = min(P * s, FILE_BYTES) if has_files else 0
    T = shape.lora_params(t.lora.r, list(t.lora.target_modules)) if t.lora.enabled else 0
    sharded = launch.fsdp and launch.fsdp_version == 2 and launch.processes > 1 and reads_by_name and has_files
    terms: list[str] = []
    if sharded:
        shard = 0 if gpu else P * w // N
        transit = big * (2 * s + w) // N
        policy = shard + transit + T * 4
        terms.append(f"policy: sharded read ({'no shard on the host' if gpu else f'{shard / GiB:.2f} GiB shard = P x {w} / {N}'}"
                     f" + {transit / GiB:.2f} GiB one weight's rows in transit + {T * 4 / GiB:.2f} GiB LoRA adapters)")
        policy_on_host = not gpu
    else:
        policy = P * w + file_pages + T * 4
        terms.append(f"policy: whole model {P * w / GiB:.2f} GiB (P x {w}) + {file_pages / GiB:.2f} GiB one mapped "
                     f"safetensors file + {T * 4 / GiB:.2f} GiB LoRA adapters")
        policy_on_host = launch.fsdp or not gpu
    ref = 0
    if objective_for(t).needs_reference and recipe.reference.mode == "online":
        ref = P * w + file_pages
        terms.append(f"online reference read whole: {ref / GiB:.2f} GiB"
                     + (" beside the policy" if policy_on_host else " after the policy moved to the device"))
    per = policy + ref if policy_on_host else max(policy, ref)
    k = launch.per_machine
    why = "; ".join(terms) + f"; x {k} process(es) per node"
    # final/'s model (a full fine-tune, or LoRA merged) is gathered on the main process's host and written
    export = 0 if (t.lora.enabled and not t.lora.merge_on_export) else P * w
    node = per * k
    if export > node:
        why += f"; then final/'s model gathered on the main process: {export / GiB:.2f} GiB (P x {w}), the larger"
    return HostRam(per_process=per, per_node=max(node, export), processes_per_node=k, sharded_read=sharded, why=why)
