"""LLaDA2.0's mixture-of-experts body (``model_type: llada2_moe``), which transformers has no twin of.

Written for dllm-align from the facts of the published modeling code (the dllm library's
``pipelines/llada2/models/modeling_llada2_moe.py``, the same arithmetic as the copies shipped by
inclusionAI's dInfer and dFactory) and checked against it on tiny random checkpoints
(``tests/test_llada2_body.py``). Weight names are the published checkpoint's, so its safetensors load
with no renaming. What the body computes:

* **attention**: one fused ``query_key_value`` projection split into ``heads`` query, ``kv`` key and
  ``kv`` value heads (grouped-query attention); per-head RMSNorm of queries and keys on ``head_dim``
  (``query_layernorm`` / ``key_layernorm``, ``use_qk_norm``); rotary embedding on the first
  ``int(head_dim * partial_rotary_factor)`` dimensions only (rotate-half, base ``rope_theta``, the rest
  passes through); scale ``head_dim ** -0.5``; output projection ``dense`` (bias: ``use_bias``).
* **MLP**: SwiGLU (``gate_proj``, ``up_proj``, ``down_proj``); layers below ``first_k_dense_replace``
  are dense (``intermediate_size``), the others a sparse MoE: the router (``mlp.gate``) takes sigmoid
  scores of float32 logits; the *selection* uses the scores plus ``expert_bias`` (a buffer), limited to
  the best ``topk_group`` of ``n_group`` expert groups (a group's score: the sum of its two best), then
  the best ``num_experts_per_tok`` experts; the *weights* are the unbiased scores of the chosen
  experts, normalised over them when more than one is chosen, times ``routed_scaling_factor``; the
  weighted expert outputs are summed in float32, and the shared experts (one SwiGLU of
  ``moe_intermediate_size * num_shared_experts``) are added.
* pre-norm residual blocks (``input_layernorm``, ``post_attention_layernorm``), a final ``norm``, an
  untied ``lm_head``; logits are returned in float32, as the published forward returns them.

Attention is **mask-driven and bidirectional**: ``attention_mask`` is a 4D boolean mask (True: attend)
or additive float mask, a 2D key-padding mask [B, keys] (1: a real token), or None (full attention).
The published forward builds a *causal* mask from a 2D mask or from None under eager attention; its
samplers and trainers always pass 4D masks, so these two readings never meet there. Attention runs
through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` (eager: the function below), and
extra keyword arguments of the model's forward reach it unchanged (dllm-align's streams attention
reads ``dllm_streams``). A transformers cache (``DynamicCache``) is filled whenever one is passed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class Llada2MoeConfig(PretrainedConfig):
    """The published configuration class's fields, names and defaults (``LLaDA2MoeConfig``).

    ``use_qk_norm`` defaults to True as in the dllm library's copy (the hub copy has no such switch and
    always normalises); ``head_dim`` None means ``hidden_size // num_attention_heads``.
    """

    model_type = "llada2_moe"

    def __init__(self, vocab_size=30592, hidden_size=1024, intermediate_size=None, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=0, hidden_act="silu", use_qkv_bias=False,
                 use_qk_norm=True, use_bias=True, rms_norm_eps=1e-05, norm_head=False, tie_word_embeddings=False,
                 embedding_dropout=0.1, attention_dropout=0.1, output_dropout=0.1, initializer_range=0.02,
                 max_position_embeddings=16384, rope_theta=10000.0, use_cache=True, use_sliding_window=False,
                 sliding_window=4096, max_window_layers=28, rope_scaling=None, pad_token_id=126081, num_experts=16,
                 num_shared_experts=0, num_experts_per_tok=2, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                 moe_intermediate_size=None, first_k_dense_replace=0, head_dim=None, output_router_logits=False,
                 partial_rotary_factor=0.5, **kwargs):
        if rope_scaling is not None:
            raise ValueError(f"rope_scaling={rope_scaling!r} is not reproduced by the native LLaDA2.0 body")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_qk_norm = use_qk_norm
        self.use_bias = use_bias
        self.rms_norm_eps = rms_norm_eps
        self.norm_head = norm_head
        self.embedding_dropout = embedding_dropout
        self.attention_dropout = attention_dropout
        self.output_dropout = output_dropout
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.use_cache = use_cache
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        self.num_experts = num_experts
        self.num_shared_experts = num_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.output_router_logits = output_router_logits
        self.partial_rotary_factor = partial_rotary_factor
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def rope_dim(self) -> int:
        """How many leading dimensions of each head the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)


def check_shapes(config) -> list[str]:
    """What about a config's sizes the published code cannot run (empty: it can)."""
    bad = []
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if not kv or heads % kv:
        bad.append(f"num_key_value_heads={kv!r} (must divide num_attention_heads={heads})")
    if config.rope_dim % 2:
        bad.append(f"rotary dimensions int(head_dim * partial_rotary_factor)={config.rope_dim} (must be even)")
    moe_layers = config.num_experts is not None and config.num_hidden_layers > config.first_k_dense_replace
    dense_layers = config.num_experts is None or config.first_k_dense_replace > 0
    if dense_layers and not config.intermediate_size:
        bad.append("intermediate_size missing (the dense layers need it)")
    if moe_layers:
        e, g, tg, k = config.num_experts, config.n_group, config.topk_group, config.num_experts_per_tok
        if not config.moe_intermediate_size:
            bad.append("moe_intermediate_size missing")
        if not g or e % g or e // g < 2:
            bad.append(f"num_experts={e} in n_group={g} groups (needs at least two experts per group)")
        elif not 0 < tg <= g or not 0 < k <= tg * (e // g):
            bad.append(f"topk_group={tg}, num_experts_per_tok={k} (more than the kept groups hold)")
    return bad


# --------------------------------------------------------------------------- pieces
class Llada2RMSNorm(nn.Module):
    """RMSNorm over the last dimension, the variance taken in float32, scaled after casting back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


class Llada2RotaryEmbedding(nn.Module):
    """cos/sin tables for the rotary dimensions, computed in float32 and returned in the input's dtype."""

    def __init__(self, config: Llada2MoeConfig, device=None):
        super().__init__()
        dim = config.rope_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        self.register_buffer("inv_freq", 1.0 / (float(config.rope_theta) ** exponents), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        device_type = x.device.type if x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate the first ``cos.shape[-1]`` dimensions of q and k [B, H, T, D]; the others pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    d = cos.shape[-1]

    def turn(x):
        rot, keep = x[..., :d], x[..., d:]
        return torch.cat([rot * cos + _rotate_half(rot) * sin, keep], dim=-1)

    return turn(q), turn(k)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """Plain softmax attention (float32 softmax); a boolean mask becomes the published additive one."""
    key, value = _repeat_kv(key, module.num_key_value_groups), _repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=scores.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(scores.dtype).min)
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class Llada2Attention(nn.Module):
    is_causal = False

    def __init__(self, config: Llada2MoeConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        width = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, width, bias=config.use_qkv_bias)
        if config.use_qk_norm:
            self.query_layernorm = Llada2RMSNorm(self.head_dim, config.rms_norm_eps)
            self.key_layernorm = Llada2RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, t, -1, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_key_value_heads, self.num_key_value_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.config.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        cos, sin = position_embeddings
        q, k = apply_partial_rotary(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        # (calling ``get_interface`` is also what lets transformers' set_attn_implementation switch this body)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation or "sdpa", eager_attention_forward)
        out, _ = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                        scaling=self.scaling, **kwargs)
        return self.dense(out.reshape(b, t, -1).contiguous())


class Llada2MLP(nn.Module):
    def __init__(self, config: Llada2MoeConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def group_limited_topk(scores: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """The experts [N, top_k] with the highest ``scores`` [N, E] among the ``topk_group`` best of
    ``n_group`` equal, contiguous groups, a group scored by the sum of its two highest scores."""
    n, e = scores.shape
    group_scores = scores.view(n, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(e // n_group, dim=1)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices


class Llada2Router(nn.Module):
    """Sigmoid router with a selection-only expert bias (see the module docstring)."""

    def __init__(self, config: Llada2MoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor):
        """x [N, H] -> (expert ids [N, k], float32 weights [N, k], float32 logits [N, E])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        chosen = group_limited_topk(scores + self.expert_bias, self.n_group, self.topk_group, self.top_k)
        weights = scores.gather(1, chosen)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.routed_scaling_factor, logits


class Llada2SparseMoe(nn.Module):
    def __init__(self, config: Llada2MoeConfig):
        super().__init__()
        self.experts = nn.ModuleList(
            [Llada2MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)])
        self.gate = Llada2Router(config)
        if config.num_shared_experts is not None:
            self.shared_experts = Llada2MLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights, _ = self.gate(flat)
        out = torch.zeros(flat.shape, dtype=weights.dtype, device=flat.device)
        # Only the experts some token picked, unless gradients are being recorded: then every expert runs
        # (an expert no token picked on zero rows: nothing is added), so that each one has a gradient, of
        # zeros, on every process, as DistributedDataParallel requires of every parameter.
        every = torch.is_grad_enabled()
        for e in (range(len(self.experts)) if every else torch.unique(chosen).tolist()):
            tok, slot = torch.where(chosen == e)
            out.index_add_(0, tok, self.experts[e](flat[tok]).to(weights.dtype) * weights[tok, slot, None])
        y = out.to(x.dtype).view(x.shape)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y


class Llada2DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: Llada2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = Llada2Attention(config, layer_idx)
        sparse = config.num_experts is not None and layer_idx >= config.first_k_dense_replace
        self.mlp = Llada2SparseMoe(config) if sparse else Llada2MLP(config, config.intermediate_size)
        self.input_layernorm = Llada2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Llada2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                use_cache=None, **kwargs):
        h = hidden_states + self.attention(self.input_layernorm(hidden_states), position_embeddings,
                                           attention_mask, past_key_values, **kwargs)
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------- models
class Llada2PreTrainedModel(PreTrainedModel):
    config_class = Llada2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Llada2DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, Llada2RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, Llada2Router):
            module.weight.normal_(mean=0.0, std=std)
            module.expert_bias.zero_()


def _as_attention_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """None, a 4D boolean / additive mask, or a 2D key-padding mask, as the attention functions take it."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.bool()[:, None, None, :]
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be 2D [batch, keys] or 4D [batch, 1, queries, keys], "
                         f"got shape {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask.to(dtype)


class Llada2Model(Llada2PreTrainedModel):
    def __init__(self, config: Llada2MoeConfig):
        bad = check_shapes(config)
        if bad:
            raise ValueError("LLaDA2.0 config cannot be run: " + "; ".join(bad))
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([Llada2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Llada2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Llada2RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and not (self.gradient_checkpointing and self.training):
            past_key_values = DynamicCache()
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen)[None]
        mask = _as_attention_mask(attention_mask, inputs_embeds.dtype)
        hidden = inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden),
                                       past_key_values=past_key_values if use_cache else None)


class Llada2MoeModelLM(Llada2PreTrainedModel):
    """The body with its untied head: ``model.*`` and ``lm_head.weight``, as the published checkpoint names them."""

    def __init__(self, config: Llada2MoeConfig):
        super().__init__(config)
        self.model = Llada2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def set_input_embeddings(self, value):
        self.model.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
        logits = self.lm_head(out.last_hidden_state).float()
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)
