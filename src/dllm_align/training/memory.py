"""Per-device training memory, estimated from the model's ``config.json`` alone (``dllm-align doctor``).

Nothing is downloaded or allocated: the shape (vocabulary, width, depth,
heads, MLP width, tied head) gives the parameter count, and the recipe and the
launch (accelerate config) give what each device holds. The terms, in bytes,
per device (N = processes sharding the model: FSDP's process count, else 1):

* weights: P x 4 / N (fp32 master copy; ``model.dtype`` pinned: its size);
* gradients and AdamW moments: T x 4 / N and T x 8 / N (T = trainable
  parameters: all, or the LoRA adapters);
* FSDP working copies: the root unit (embeddings, head, final norm) and two
  decoder layers (one computing, one prefetched) gathered in full, fp32 (the
  precision policy gathers fp32 shards: :mod:`dllm_align.models.precision`);
* an online reference: resident (its Linears in bf16 under autocast); under FSDP2 on several processes, a model
  read by name is sharded as the policy is (P x w / N and its gathered units: :func:`reference_device_bytes`);
* activations for one forward of ``tokens = rows x max_length`` (rows = the
  rows the micro-batch's draws put through the body, which the family's
  likelihood says (``Likelihood.footprint``: ``train.batch_size x n_mc`` for
  masked diffusion), or ``train.rows_per_forward``; every row taken at the
  full length): with
  activation checkpointing, each layer keeps its input (the residual stream:
  fp32 under autocast) and one layer at a time holds its full working set;
  without, every layer holds its working set. The working set per token is
  the tensors a Llama layer saves for the backward: 36 bytes x hidden + 10 x
  MLP width under bf16 autocast (norm inputs/outputs and rotary outputs in
  fp32, projections in bf16), 44 x hidden + 16 x MLP width in fp32; plus one
  fp32 MLP-wide gradient in the backward;
* the output head: the chunked scorer's [128, V] fp32 block (and its bf16
  product) plus the masked positions' hidden states and their gradients
  (half the tokens on average: l/L is uniform);
* under bf16 autocast, the bf16 weight copies autocast makes (with its weight
  cache off) and the backward keeps: without activation checkpointing every
  layer's Linear and expert weights, 2 bytes each (~14 GiB for LLaDA-8B); with
  it, one layer's at a time; plus the output head's bf16 copy (V x hidden x 2)
  the chunked scorer casts once per call;
* FSDP's unsharded gradients before their reduce-scatter: the root unit's
  (embeddings, head, final norm: the last unit reduced, ~3.9 GiB fp32 for
  LLaDA-8B) and one decoder layer's. Gradient accumulation adds nothing: FSDP
  reduce-scatters every micro-batch (``training.loop.Run.sync``), DDP's
  gradients are whole anyway;
* what the likelihood adds (its footprint), per attention implementation, in the bytes the kernel CUDA
  chooses for it needs (``dllm_align.models.attention_memory``). Masked diffusion: packed rows under
  SDPA or eager attention hold the [rows, 1, L, L] boolean block mask and its bf16 additive form (3 bytes
  per entry; flash and flex take sequence offsets instead); eager attention adds rows x heads x length^2
  x 4 bytes of scores, shown as its own line. Block diffusion: a row is K noisy streams and one shared
  clean stream, (K+1) x max_length tokens (``dllm_align.models.block_attention``), the clean stream never
  scored. Under SDPA its two masked 4-D calls run on the memory-efficient kernel, which keeps no score
  matrix: per layer it keeps the keys and values the streams attention concatenates per noisy stream, the
  masks' bias and a log-sum-exp per query; the streams' boolean masks (3 x max_length^2 bytes per row)
  live through the forward. Under eager attention the whole row's scores and probabilities, ((K+1) x
  max_length)^2 per head; under FlexAttention, compiled: a log-sum-exp per query and the BlockMask
  (uncompiled it is refused where its score matrix does not fit). What a layer's attention keeps for the
  backward is kept by one layer at a time with activation checkpointing, by every layer without;
* a runtime reserve of 2 GiB (CUDA context, NCCL buffers, allocator
  fragmentation).

The device's peak is the larger of those lines' sum (the steps) and the peak
while loading (``Estimate.loading``): an online reference that is read whole (a family that reads its checkpoint
whole, a built-in model; one read by name goes weight by weight into its resident dtypes, :func:`reference_route`)
under bf16 autocast is loaded at the weights' dtype (fp32: P x 4) and only then are its Linears
cast to bf16 (``models.precision.prepare_reference``), so for a moment the
device holds the policy's weights (on the CPU until FSDP shards them) and the
whole fp32 reference. For an 8B LoRA run with 576-token draws that moment is
the peak: measured 55.92 GB on an H100 against 55.85 GB of fp32 weights, two
copies, while the steps' lines sum to 46.4 GB.

Plain attention is memory-efficient on CUDA (SDPA's flash or memory-efficient
kernel, flash-attn: O(tokens), inside the layer's working set). Mixture-of-experts activations are counted at the top-k experts'
width in the compute dtype (experts run under autocast: :mod:`dllm_align.models.precision`).

Checked against measurements (``tests/test_doctor.py``): on the CPU, the bytes
a real forward of ``builtin:tiny`` / ``builtin:small`` saves for its backward
(every saved tensor's storage, counted once) are within 0.8-1.25x of the
activation, weight-copy and head lines, fp32 and bf16 autocast; and the
whole estimate (reserve left out) is within 0.85-1.15x of the peak of live
tensor bytes of a real LoRA smoke run with an online reference under bf16
autocast, measured as CUDA's ``max_memory_allocated`` counts, both where the
peak is while loading (1.00x) and where it is in a step (0.88x).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from dllm_align.config.recipe import load_yaml_file
from dllm_align.core.errors import UserError
from dllm_align.models.families import family_for_config, with_folder_evidence
from dllm_align.models.load import BUILTIN_SPECS, build_tiny_model, resolve_config_file
from dllm_align.objective.base import objective_for
from dllm_align.objective.elbo import get_likelihood

GiB = 1024**3
RESERVE = 2 * GiB
HEAD_CHUNK = 128


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool = False
    source: str = ""
    # Mixture-of-experts bodies (LLaDA-MoE, Qwen3-MoE layouts): ``moe_layers`` of the
    # ``layers`` hold ``experts`` SwiGLU experts of width ``expert_intermediate`` and a
    # router; each token runs ``active_experts`` of them. The rest are dense.
    experts: int = 0
    active_experts: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    # Shared experts (LLaDA2.0): one SwiGLU of this width every token runs in each MoE layer.
    shared_intermediate: int = 0
    # Per-head RMSNorm on queries and keys in every layer (Qwen3 / SDAR / LLaDA2 layouts).
    qk_norm: bool = False
    # An explicit head width when it is not hidden / heads (Gemma 4 layouts: ``head_dim`` 256 at width 2816); 0: derived.
    explicit_head_dim: int = 0
    # The family's likelihood (``dllm_align.objective.elbo.LIKELIHOODS``): what one unit's draws put through
    # the body (``Likelihood.footprint``).
    likelihood: str = "masked"
    # Block diffusion (SDAR, LLaDA2.x): the block size (the config's, else the family's); 0 for none.
    block_size: int = 0
    # The config.json as read: what a likelihood's footprint needs beyond these fields.
    config: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def attention_params(self) -> int:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv

    @property
    def layer_params(self) -> int:
        """A dense layer (attention, SwiGLU, two norms)."""
        return self.attention_params + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim * self.qk_norm

    @property
    def moe_layer_params(self) -> int:
        """A mixture-of-experts layer (attention, router, every expert, norms incl. per-head q/k)."""
        d = self.hidden
        return (self.attention_params + d * self.experts + self.experts * 3 * d * self.expert_intermediate + 2 * d
                + 2 * self.head_dim + 3 * d * self.shared_intermediate)

    @property
    def largest_layer_params(self) -> int:
        return max(self.layer_params if self.moe_layers < self.layers else 0, self.moe_layer_params if self.moe_layers else 0)

    @property
    def active_intermediate(self) -> int:
        """The widest per-token MLP activation: the dense width, or the active experts' summed width."""
        dense = self.intermediate if self.moe_layers < self.layers else 0
        return max(dense, self.active_experts * self.expert_intermediate + self.shared_intermediate if self.moe_layers else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def body_params(self) -> int:
        dense = self.layers - self.moe_layers
        return dense * self.layer_params + (self.moe_layers * self.moe_layer_params if self.moe_layers else 0)

    @property
    def params(self) -> int:
        return self.body_params + self.embedding_params + self.hidden

    @property
    def linear_params(self) -> int:
        """Parameters inside nn.Linear modules (stored in bf16 by an autocast reference)."""
        d = self.hidden
        norms = self.layers * 2 * d + (self.moe_layers * 2 * self.head_dim if self.moe_layers else 0)
        norms += (self.layers - self.moe_layers) * 2 * self.head_dim * self.qk_norm
        return self.body_params - norms + (0 if self.tied else self.vocab * d)

    def lora_params(self, r: int, targets: list[str]) -> int:
        """Adapter parameters for ``targets`` as peft matches them: a module whose dotted name is a target or
        ends with ``.target`` (``gate_proj`` hits the dense MLP, every routed expert and the shared expert;
        ``shared_experts.gate_proj`` the shared expert alone)."""
        d, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        attn = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
                "query_key_value": (d, d + 2 * kv), "dense": (d, d)}  # LLaDA2.0's fused names
        ei, si = self.expert_intermediate, self.shared_intermediate

        def mlp(width: int) -> dict:
            return {"gate_proj": (d, width), "up_proj": (d, width), "down_proj": (width, d)}

        def hit(path: str) -> bool:
            return any(path == t or path.endswith("." + t) for t in targets)

        def adapters(prefix: str, modules: dict) -> int:
            return sum(r * (x + y) for name, (x, y) in modules.items() if hit(f"{prefix}.{name}"))

        a = adapters("self_attn", attn)
        dense = adapters("mlp", mlp(i))
        moe = self.experts * adapters("mlp.experts.0", mlp(ei)) + (adapters("mlp.shared_experts", mlp(si)) if si else 0)
        return self.layers * a + (self.layers - self.moe_layers) * dense + self.moe_layers * moe


# Sizes a config.json may give: positive whole numbers, and none past what any model has.
_MAX_SIZE = 2**31


def _whole(cfg: dict, key: str, value, *, low: int = 1, source: str = "") -> int:
    """A config size as an int, refused by name when it is not a whole number in [low, 2^31)."""
    ok = isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float) and value.is_integer())
    if not ok or not low <= int(value) < _MAX_SIZE:
        raise UserError(f"{source or 'config.json'}: {key} must be a whole number >= {low}, got {value!r}")
    return int(value)


def shape_from_config(cfg: dict, source: str = "") -> ModelShape:
    """Read a Llama-style or LLaDA-style ``config.json`` (both spellings of each field), refusing by name
    a field that is not a positive whole number or a shape that cannot exist (heads not dividing the width,
    more experts per token than experts)."""
    if not isinstance(cfg, dict):
        raise UserError(f"{source or 'config.json'}: expected a JSON object of model settings, got {type(cfg).__name__}")

    def pick(*keys, default=None, low: int = 1):
        for k in keys:
            if cfg.get(k) is not None:
                return _whole(cfg, k, cfg[k], low=low, source=source)
        if default is not None:
            return default
        raise UserError(f"{source or 'config.json'}: no {keys[0]} (or {', '.join(keys[1:]) or 'equivalent'}): cannot size the model")

    fam = family_for_config(cfg)
    if fam.tied_text_stack and isinstance(cfg.get("text_config"), dict):
        return _tied_text_stack_shape(cfg, source, fam.likelihood)
    if fam.refuse_reason:  # as loading it would (train, generate): refused by name, not sized
        raise UserError(f"{source or 'config.json'}: {fam.name} checkpoint: {fam.refuse_reason}")
    block_problem = fam.block_size_problem(cfg)
    if block_problem:
        raise UserError(f"{source or 'config.json'}: {block_problem}")
    d = pick("hidden_size", "d_model")
    heads = pick("num_attention_heads", "n_heads")
    layers = pick("num_hidden_layers", "n_layers")
    if d % heads:
        raise UserError(f"{source or 'config.json'}: hidden size {d} is not a multiple of num_attention_heads {heads}")
    routed = any(cfg.get(k) is not None for k in ("num_experts_per_tok", "moe_topk", "n_group"))
    # A config that routes tokens to experts has at least one (0 is a dense model only where nothing routes).
    experts = pick("num_experts", "n_routed_experts", default=0, low=1 if routed else 0)
    for k in ("n_group", "topk_group"):
        if cfg.get(k) is not None:
            _whole(cfg, k, cfg[k], low=1, source=source)
    moe = {}
    if experts:
        # LLaDA-MoE: expert_intermediate_size, dense_intermediate_size and a per-layer
        # moe_layer_freq list (0 = dense); Qwen3-MoE: moe_intermediate_size,
        # decoder_sparse_step and mlp_only_layers.
        ei = pick("expert_intermediate_size", "moe_intermediate_size")
        freq = cfg.get("moe_layer_freq")
        if isinstance(freq, list):
            moe_layers = sum(1 for f in freq[:layers] if f)
        elif cfg.get("first_k_dense_replace") is not None:  # LLaDA2.0: the first k layers dense
            moe_layers = max(0, layers - int(cfg["first_k_dense_replace"]))
        else:
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = sum(1 for j in range(layers) if j not in dense_only and (j + 1) % step == 0)
        top_k = pick("num_experts_per_tok", "moe_topk")
        if top_k > experts:
            raise UserError(f"{source or 'config.json'}: num_experts_per_tok {top_k} is more than num_experts {experts}")
        moe = dict(experts=experts, active_experts=top_k, expert_intermediate=ei, moe_layers=moe_layers,
                   shared_intermediate=ei * int(cfg.get("num_shared_experts") or 0))
        mlp = cfg.get("dense_intermediate_size") or cfg.get("intermediate_size") or ei
    else:
        mlp = cfg.get("intermediate_size") or cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d)
    kv = pick("num_key_value_heads", "n_kv_heads", default=heads)
    if heads % kv:
        raise UserError(f"{source or 'config.json'}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return ModelShape(
        vocab=pick("embedding_size", "vocab_size"),
        hidden=d,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        intermediate=_whole(cfg, "intermediate_size", mlp, source=source),
        tied=bool(cfg.get("tie_word_embeddings", cfg.get("weight_tying", False))),
        source=source,
        qk_norm=fam.qk_norm(cfg, experts) if fam.qk_norm else (cfg.get("model_type") == "qwen3" and not experts),
        likelihood=fam.likelihood,
        block_size=fam.block_size_in(cfg) or 0,
        config=cfg,
        **moe,
    )


def _tied_text_stack_shape(cfg: dict, source: str, likelihood: str) -> ModelShape:
    """A text stack nested under ``text_config`` (``Family.tied_text_stack``), encoder and decoder one set of tied
    weights, counted once; DiffusionGemma's is Gemma 4 MoE layers, each with a dense gated MLP
    (``intermediate_size``, run by every token: counted as a shared expert)
    beside ``num_experts`` experts of ``moe_intermediate_size`` (``top_k_experts`` active). Attention is sized
    as the sliding layers (``head_dim``, ``num_key_value_heads``; five layers in six); the vision tower is not
    counted (loaded frozen, never run)."""
    t = cfg["text_config"]
    d = _whole(t, "hidden_size", t.get("hidden_size"), source=source)
    heads = _whole(t, "num_attention_heads", t.get("num_attention_heads"), source=source)
    hd = _whole(t, "head_dim", t.get("head_dim") or d // heads, source=source)
    layers = _whole(t, "num_hidden_layers", t.get("num_hidden_layers"), source=source)
    experts = int(t.get("num_experts") or 0)
    ei = _whole(t, "moe_intermediate_size", t.get("moe_intermediate_size"), source=source) if experts else 0
    inter = _whole(t, "intermediate_size", t.get("intermediate_size"), source=source)
    return ModelShape(
        vocab=_whole(t, "vocab_size", t.get("vocab_size"), source=source), hidden=d, layers=layers, heads=heads,
        kv_heads=_whole(t, "num_key_value_heads", t.get("num_key_value_heads") or heads, source=source),
        intermediate=inter, tied=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", True))), source=source, qk_norm=True,
        explicit_head_dim=hd, experts=experts, active_experts=int(t.get("top_k_experts") or 0) if experts else 0,
        expert_intermediate=ei, moe_layers=layers if experts else 0, shared_intermediate=inter if experts else 0,
        likelihood=likelihood, config=cfg)


def model_shape(recipe) -> ModelShape:
    """The recipe model's shape from its config.json only (built-in models: from their spec)."""
    name = recipe.model.name_or_path
    if name in BUILTIN_SPECS:
        # Built (tiny, milliseconds) rather than read off the spec: each family's tiny model
        # has its own tokenizer specials and attention layout.
        return shape_from_config(build_tiny_model(spec=BUILTIN_SPECS[name]).config.to_dict(), name)
    path = resolve_config_file(name, recipe.model.revision)
    try:
        cfg = with_folder_evidence(json.loads(Path(path).read_text(encoding="utf-8")), Path(path).parent)
        return shape_from_config(cfg, str(path))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: cannot read the model shape ({type(e).__name__}: {e})") from None


@dataclass
class Launch:
    """What the accelerate config says about where the model runs."""

    distributed_type: str = "NO"  # NO, MULTI_GPU, FSDP, ...
    processes: int = 1
    mixed_precision: Optional[str] = None
    fsdp_version: int = 1
    activation_checkpointing: bool = False
    offload_params: bool = False
    source: str = "this machine (no --config)"
    machines: int = 1  # num_machines: the nodes the processes are spread over
    reshard_after_forward: bool = True  # FSDP: gather the weights again for the backward (full shard)

    @property
    def fsdp(self) -> bool:
        return self.distributed_type == "FSDP"

    @property
    def per_machine(self) -> int:
        return self.processes // self.machines


_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU", "XLA")


def read_launch(path: Optional[str]) -> Launch:
    if path is None:
        return Launch()
    p = Path(path)
    try:
        raw = load_yaml_file(p, "accelerate config")  # bounded like a recipe: size, nesting, aliases
    except FileNotFoundError:
        raise UserError(f"accelerate config not found: {p}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{p}: expected a mapping of accelerate settings")
    # Validated like a recipe: each value where it is read, refused by key with what is allowed.
    problems = []
    dist = raw.get("distributed_type", "NO")
    if not isinstance(dist, str) or dist not in _DISTRIBUTED:
        problems.append(f"distributed_type must be one of {', '.join(_DISTRIBUTED)}, got {dist!r}")
    n = raw.get("num_processes", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 20:
        problems.append(f"num_processes must be a whole number >= 1, got {n!r}")
    machines = raw.get("num_machines", 1)
    machines = 1 if machines is None else machines
    if isinstance(machines, bool) or not isinstance(machines, int) or not 1 <= machines <= 1 << 16:
        problems.append(f"num_machines must be a whole number >= 1, got {machines!r}")
        machines = 1
    elif isinstance(n, int) and not isinstance(n, bool) and n % machines:
        problems.append(f"num_processes ({n}: all processes of all machines) must be a multiple of num_machines ({machines})")
    fsdp = raw.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        problems.append(f"fsdp_config must be a mapping of fsdp_* settings, got {type(fsdp).__name__}")
        fsdp = {}
    version = fsdp.get("fsdp_version", 1)
    if version not in (1, 2) or isinstance(version, bool):
        problems.append(f"fsdp_config.fsdp_version must be 1 or 2, got {version!r}")
    for key in ("fsdp_activation_checkpointing", "fsdp_offload_params"):
        if not isinstance(fsdp.get(key, False), bool):
            problems.append(f"fsdp_config.{key} must be true or false, got {fsdp.get(key)!r}")
    reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", True))
    if isinstance(reshard, str):  # FSDP1 names its strategies
        reshard = reshard.upper() not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2", "2", "NO_SHARD", "3")
    elif isinstance(reshard, int) and not isinstance(reshard, bool):
        reshard = reshard not in (2, 3)  # FSDP1's numbered strategies: 2 SHARD_GRAD_OP, 3 NO_SHARD
    mp = raw.get("mixed_precision")
    mp = "no" if mp is False else mp
    if mp not in (None, "no", "bf16", "fp16", "fp8"):
        problems.append(f"mixed_precision must be no, bf16, fp16 or fp8, got {mp!r}")
    if problems:
        raise UserError(f"{p}: " + "; ".join(problems), hint="see recipes/accelerate/*.yaml for valid configs")
    return Launch(
        distributed_type=dist,
        processes=n,
        mixed_precision=mp,
        fsdp_version=version,
        activation_checkpointing=fsdp.get("fsdp_activation_checkpointing", False),
        offload_params=fsdp.get("fsdp_offload_params", False),
        source=str(p),
        machines=machines,
        reshard_after_forward=bool(reshard),
    )


@dataclass
class Estimate:
    lines: dict = field(default_factory=dict)  # name -> bytes (the chosen checkpointing setting)
    total: int = 0  # max(steps, loading)
    steps: int = 0  # the lines' sum: the peak of a training step
    loading: int = 0  # the peak while the policy and reference load (module docstring), reserve included
    total_with_checkpointing: int = 0
    total_without_checkpointing: int = 0
    checkpointing: bool = False
    tokens: int = 0
    params: int = 0
    trainable: int = 0
    notes: list = field(default_factory=list)

    def as_json(self) -> dict:
        d = asdict(self)
        d["lines_gib"] = {k: round(v / GiB, 2) for k, v in self.lines.items()}
        for k in ("total", "steps", "loading", "total_with_checkpointing", "total_without_checkpointing"):
            d[k + "_gib"] = round(getattr(self, k) / GiB, 2)
        return d


def estimate(shape: ModelShape, recipe, launch: Launch, autocast: bool) -> Estimate:
    """Per-device bytes for training ``recipe`` on ``launch`` (module docstring)."""
    t = recipe.train
    P = shape.params
    T = shape.lora_params(t.lora.r, list(t.lora.target_modules)) if t.lora.enabled else P
    n = launch.processes if launch.fsdp else 1
    wbytes = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    d, i, L = shape.hidden, shape.active_intermediate, shape.layers
    k = recipe.train_n_mc()
    objective = objective_for(t)
    units = t.batch_size * objective.rows_per_unit
    foot = get_likelihood(recipe.reference.likelihood or shape.likelihood).footprint(shape, k, recipe.data.max_length, 2 if autocast else wbytes,
                                                      attn=recipe.model.attn_implementation or "sdpa",
                                                      packed=recipe.data.padding == "packed")
    rows = units * foot.rows
    if t.rows_per_forward:
        rows = min(rows, t.rows_per_forward)
    tokens = rows * recipe.data.max_length
    lines: dict[str, int] = {}
    lines["weights"] = P * wbytes // n if not launch.offload_params else 0
    lines["gradients"] = T * 4 // n
    lines["optimizer (AdamW)"] = T * 8 // n
    if launch.fsdp:
        layer_bytes = 2 if (autocast and t.fsdp_gather == "bf16_layers" and launch.fsdp_version == 2) else wbytes
        lines["FSDP gathered units (root + 2 layers)"] = (shape.embedding_params + shape.hidden) * wbytes + 2 * shape.largest_layer_params * layer_bytes
    route = reference_route(shape, recipe, launch)
    if objective.needs_reference and recipe.reference.mode == "online":
        lines["online reference (resident)"] = reference_device_bytes(shape, recipe, launch, autocast)
    act = 4 if (autocast or wbytes == 4) else 2
    per_token_layer = (36 * d + 10 * i) if autocast else (44 * d + 16 * i)
    working = tokens * per_token_layer + tokens * i * 4
    ckpt_inputs = L * tokens * d * act
    scored = tokens * foot.scored_rows // foot.rows  # a clean context row is never scored
    head = HEAD_CHUNK * shape.vocab * (4 + 2) + (scored // 2) * d * 4 * 2
    with_ckpt = ckpt_inputs + working + head
    without_ckpt = L * tokens * per_token_layer + tokens * i * 4 + head
    ckpt = launch.activation_checkpointing or recipe.model.gradient_checkpointing
    lines["activations" + (" (checkpointed layer inputs)" if ckpt else " (every layer)")] = ckpt_inputs if ckpt else L * tokens * per_token_layer
    lines["activations (one layer working set + backward)"] = working if ckpt else tokens * i * 4
    lines["output head (chunked)"] = head
    if foot.attention_saved:  # per unit and layer; a forward of fewer draws than a unit keeps its share
        kv = scored * foot.attention_saved // (foot.scored_rows * recipe.data.max_length)
        lines[foot.attention_line] = kv if ckpt else L * kv
        with_ckpt += kv
        without_ckpt += L * kv
    if autocast:
        body_linear = shape.linear_params - (0 if shape.tied else shape.vocab * d)
        lines["autocast bf16 weight copies (saved for backward)"] = (shape.largest_layer_params if ckpt else body_linear) * 2
        lines["output head bf16 copy"] = shape.vocab * d * 2
    if launch.fsdp:
        lines["FSDP unsharded gradients before reduce-scatter (root + 1 layer)"] = (
            (shape.embedding_params + d + shape.largest_layer_params) * 4 if not t.lora.enabled else 0)
    for name, per_row in foot.row_lines:
        lines[name] = rows * per_row
    if foot.mask_bytes:
        lines[foot.mask_line] = min(units, rows) * foot.mask_bytes  # a forward row holds at most one unit's draws
    notes = list(foot.notes)
    for name, per_unit in foot.unit_lines.items():
        lines[name] = units * per_unit
    lines["runtime reserve (CUDA context, NCCL, fragmentation)"] = RESERVE
    copies = "autocast bf16 weight copies (saved for backward)"
    fixed = sum(v for kk, v in lines.items()
                if not kk.startswith(("activations", "output head (chunked)", copies, foot.attention_line)))
    steps = sum(lines.values())
    if autocast:
        body_linear = shape.linear_params - (0 if shape.tied else shape.vocab * d)
        with_ckpt += shape.largest_layer_params * 2
        without_ckpt += body_linear * 2
    loading = 0
    if "online reference (resident)" in lines and route == "whole":
        # the policy is loaded first (on the CPU under FSDP, sharded later), then the reference at the weights'
        # dtype, whose Linears are cast to bf16 only once it is whole on the device
        policy = 0 if launch.fsdp or launch.offload_params else P * wbytes + (T * 4 if t.lora.enabled else 0)
        loading = policy + P * wbytes + RESERVE
        if loading > steps:
            notes.append(f"the peak is while loading: the policy's weights and the whole reference at {wbytes * 8}-bit "
                         f"before its Linears are cast to bf16 ({loading / GiB:.1f} GiB with the reserve; the steps "
                         f"need {steps / GiB:.1f} GiB)")
    return Estimate(
        lines=lines, total=max(steps, loading), steps=steps, loading=loading,
        total_with_checkpointing=max(fixed + with_ckpt, loading), total_without_checkpointing=max(fixed + without_ckpt, loading),
        checkpointing=ckpt, tokens=tokens, params=P, trainable=T, notes=notes,
    )


def reference_route(shape: ModelShape, recipe, launch: Launch) -> str:
    """How the reference loads (:mod:`dllm_align.training.reference_model`): ``sharded`` (an FSDP2 launch of several
    processes, a model read by name from its files: each process reads its rows, kept at the weights' dtype),
    ``direct`` (read by name, whole, each weight straight into its resident dtype on the device) or ``whole`` (read
    whole at the weights' dtype on the host, moved, then its Linears cast: a family that transforms its weights as
    they load, or a built-in model)."""
    fam = family_for_config(shape.config) if shape.config else None
    if not (fam is None or fam.reads_by_name) or recipe.model.name_or_path in BUILTIN_SPECS:
        return "whole"
    return "sharded" if launch.fsdp and launch.fsdp_version == 2 and launch.processes > 1 else "direct"


def reference_device_bytes(shape: ModelShape, recipe, launch: Launch, autocast: bool) -> int:
    """The reference's weights on one device: sharded, P x w / N plus the units FSDP2 gathers in full (the root and
    two layers, at w); else whole, its Linears at the compute dtype under autocast (``prepare_reference``)."""
    P, lin = shape.params, shape.linear_params
    w = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    if reference_route(shape, recipe, launch) == "sharded":
        return P * w // launch.processes + (shape.embedding_params + shape.hidden) * w + 2 * shape.largest_layer_params * w
    return lin * (2 if autocast else w) + (P - lin) * w


def precompute_estimate(shape: ModelShape, recipe, launch: Launch, autocast: bool) -> dict:
    """Per-device bytes of ``precompute-ref`` (``lines``, ``total``): the reference's weights
    (:func:`reference_device_bytes`), one no-grad forward of a training micro-batch (precompute scores in training's
    call shapes: the residual stream and one layer's working set), the chunked head and the reserve; where the
    reference is read whole at the weights' dtype, the moment before its Linears are cast (``loading``)."""
    P = shape.params
    w = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[recipe.model.dtype]
    d, i = shape.hidden, shape.active_intermediate
    est = estimate(shape, recipe, launch, autocast)
    tokens = est.tokens
    route = reference_route(shape, recipe, launch)
    lines = {f"reference weights ({route} read)": reference_device_bytes(shape, recipe, launch, autocast)}
    act = 4 if (autocast or w == 4) else 2
    lines["one no-grad forward (residual stream + one layer's working set)"] = (
        tokens * d * act + tokens * ((36 * d + 10 * i) if autocast else (44 * d + 16 * i)))
    lines["output head (chunked)"] = HEAD_CHUNK * shape.vocab * (4 + 2)
    # what the likelihood adds to a forward of these shapes (its masks, canvases' logits, attention), as training
    training_only = ("weights", "gradients", "optimizer", "FSDP", "online reference", "activations", "output head",
                     "autocast bf16", "runtime reserve")
    lines.update({k: v for k, v in est.lines.items() if not k.startswith(training_only)})
    lines["runtime reserve (CUDA context, NCCL, fragmentation)"] = RESERVE
    steps = sum(lines.values())
    loading = P * w + RESERVE if route == "whole" else 0
    return {"lines": lines, "total": max(steps, loading), "loading": loading, "route": route, "tokens": tokens}


def advice(est: Estimate, shape: ModelShape, recipe, launch: Launch, capacity: int) -> list[str]:
    """What to change when the estimate does not fit ``capacity`` bytes."""
    out = []
    if not launch.fsdp and not recipe.train.lora.enabled:
        per = est.lines["weights"] + est.lines["gradients"] + est.lines["optimizer (AdamW)"]
        out.append(
            f"a full fine-tune holds fp32 weights + gradients + AdamW moments on every device: "
            f"{per / GiB:.0f} GiB for {shape.params / 1e9:.2f}B parameters before activations; "
            "shard them with FSDP (recipes/accelerate/fsdp_8gpu.yaml) or train LoRA adapters (train.lora.enabled: true)"
        )
    if not est.checkpointing and est.total_with_checkpointing < est.total:
        out.append(f"turn on activation checkpointing (fsdp_activation_checkpointing or model.gradient_checkpointing): "
                   f"{est.total_with_checkpointing / GiB:.1f} GiB")
    if est.tokens and est.total > capacity:
        out.append("lower train.rows_per_forward (draws scored per forward) to cut activation memory")
    if recipe.reference.mode == "online" and objective_for(recipe.train).needs_reference:
        out.append("use reference.mode: cached (precompute-ref) so the reference is not resident")
    return out
