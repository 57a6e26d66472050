"""Host memory while a training process loads its model, and while ``precompute-ref`` loads the reference
(``dllm-align doctor``'s host-RAM lines), from the model's ``config.json`` alone, as
:func:`dllm_align.training.policy.load_policy` and :func:`dllm_align.training.reference.load_reference` load them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_align.models.load import BUILTIN_SPECS
from dllm_align.objective.base import objective_for
from dllm_align.training.memory import GiB, Launch, ModelShape, reference_route


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
    * an online reference as :func:`host_reference` says: beside the policy where the policy is still on the host
      (FSDP before sharding, or a CPU run);
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
        ref, how = host_reference(shape, recipe, launch, gpu=gpu)
        terms.append(f"online {how}" + (" beside the policy" if policy_on_host else " after the policy moved to the device"))
    per = policy + ref if policy_on_host else max(policy, ref)
    k = launch.per_machine
    why = "; ".join(terms) + f"; x {k} process(es) per node"
    # final/'s model (a full fine-tune, or LoRA merged) is gathered on the main process's host and written; a merged
    # model in another dtype (train.lora.merged_dtype) is cast beside the gathered one
    trained = "float32" if recipe.model.dtype == "auto" else recipe.model.dtype
    m = merged_bytes(recipe)
    cast = P * m if t.lora.enabled and t.lora.merged_dtype not in ("trained", trained) else 0
    export = 0 if (t.lora.enabled and not t.lora.merge_on_export) else P * w + cast
    node = per * k
    if export > node:
        why += (f"; then final/'s model gathered on the main process: {export / GiB:.2f} GiB (P x {w}"
                + (f" + P x {m} cast to train.lora.merged_dtype" if cast else "") + "), the larger")
    return HostRam(per_process=per, per_node=max(node, export), processes_per_node=k, sharded_read=sharded, why=why)


def host_reference(shape: ModelShape, recipe, launch: Launch, *, gpu: bool) -> tuple[int, str]:
    """Peak host bytes of one process while the reference loads (``training.reference.load_reference``), and how
    (``memory.reference_route``):

    * sharded (FSDP2, several processes, read by name): the model is made with empty storage and each process reads
      its rows of each weight into its shard, kept at the weights' dtype (P x w / N; on a GPU it goes to the device),
      one weight's rows in transit (stored, mapped pages and the cast copy: largest x (2s + w) / N);
    * direct (read by name, one process or not FSDP2): the whole model read one weight at a time straight into the
      dtype it stays resident in (Linears at the compute dtype under autocast), on the device: the host holds one
      weight in transit (largest x (2s + w)); on a CPU run the model itself too;
    * whole (a family that transforms its weights as it reads them, a built-in model): the whole model at the
      weights' dtype (P x w) while one safetensors file is mapped (at most 5 GB).
    """
    P, N = shape.params, launch.processes
    w = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    has_files = recipe.model.name_or_path not in BUILTIN_SPECS
    s = stored_bytes(shape.config) if has_files else w
    big = largest_weight(shape)
    route = reference_route(shape, recipe, launch)
    if route == "sharded":
        shard, transit = (0 if gpu else P * w // N), big * (2 * s + w) // N
        return shard + transit, (f"reference: sharded read ({'no shard on the host' if gpu else f'{shard / GiB:.2f} GiB shard = P x {w} / {N}'}"
                                 f" + {transit / GiB:.2f} GiB one weight's rows in transit)")
    if route == "direct":
        mode = recipe.train.mixed_precision
        c = 2 if (mode in ("bf16", "fp16") or (mode == "auto" and gpu)) else w
        held = 0 if gpu else shape.linear_params * c + (P - shape.linear_params) * w
        transit = big * (2 * s + w)
        return held + transit, (f"reference: read weight by weight into its resident dtypes ("
                                + ("straight to the device" if gpu else f"{held / GiB:.2f} GiB model, Linears x {c}, rest x {w}")
                                + f" + {transit / GiB:.2f} GiB one weight in transit)")
    pages = min(P * s, FILE_BYTES) if has_files else 0
    return P * w + pages, (f"reference: whole model {P * w / GiB:.2f} GiB (P x {w}) + {pages / GiB:.2f} GiB one mapped "
                           "safetensors file")


def host_precompute(shape: ModelShape, recipe, launch: Launch, *, gpu: bool) -> HostRam:
    """Host memory of ``precompute-ref`` on ``launch``: each process loads the reference (:func:`host_reference`);
    the rows and their values are small beside it."""
    per, how = host_reference(shape, recipe, launch, gpu=gpu)
    k = launch.per_machine
    return HostRam(per_process=per, per_node=per * k, processes_per_node=k,
                   sharded_read=reference_route(shape, recipe, launch) == "sharded",
                   why=f"{how}; x {k} process(es) per node")


def merged_bytes(recipe) -> int:
    """Bytes per weight of final/'s merged model (``train.lora.merged_dtype``; trained: the weights' dtype)."""
    name = recipe.train.lora.merged_dtype
    return {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype if name == "trained" else name]
