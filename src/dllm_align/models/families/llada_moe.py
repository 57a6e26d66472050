"""LLaDA-MoE (``inclusionAI/LLaDA-MoE-7B-A1B-Base`` / ``-Instruct``: ``architectures: [LLaDAMoEModelLM]``,
``model_type: llada`` on the hub, ``lladamoe`` after dllm's rewrite).

Facts from the published configuration class and modeling code (and the
inference code that serves it):

* LLaDA's masking (no logit shift, mask id 156895, ``<|endoftext|>`` 156892)
  with a mixture-of-experts body: RMSNorm pre-norm blocks, per-head RMSNorm on
  queries and keys (``qk_layernorm``), non-causal attention, and an MoE MLP
  whose router takes a float32 softmax over the experts, keeps the top
  ``num_experts_per_tok`` weights *without* renormalising them, and sums the
  chosen SwiGLU experts (``experts.{j}.gate_proj / up_proj / down_proj``);
  layers whose ``moe_layer_freq`` entry is 0 use a dense SwiGLU of
  ``dense_intermediate_size``;
* a turn ends with ``<|role_end|>``; decoding is LLaDA's sampler.

That block is exactly transformers' Qwen3-MoE block (per-head q/k norm on the
head dimension, softmax top-k router with ``norm_topk_prob = False``, experts
stored as stacked ``gate_up_proj`` / ``down_proj``), so the checkpoint loads
natively into ``Qwen3MoeForCausalLM`` with ``is_causal = False``; the
per-expert matrices are stacked on load. Options the published code has but
Qwen3-MoE does not reproduce (a shared expert, an expert bias in the router,
partial rotary embeddings, q/k/v clipping, RoPE scaling) are refused by name;
such checkpoints run through their own code with ``trust_remote_code``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dllm_align.models.families.base import (
    Family,
    PublishedLayout,
    load_mapped,
    refuse,
    special_ids,
    tag_config,
    transformers_key,
)

# lazy imports: transformers: imported inside the builders: the family records are read (which family claims a
# config, the memory estimate) without building anything, and transformers takes longer to import than torch

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def lladamoe_config_to_qwen3moe(cfg: dict):
    """Translate a LLaDA-MoE ``config.json`` into a bidirectional ``Qwen3MoeConfig`` (unsupported options named)."""
    from transformers import Qwen3MoeConfig

    unsupported = []
    if not cfg.get("qk_layernorm", True):
        unsupported.append("qk_layernorm=false")
    if cfg.get("shared_expert_intermediate_size") not in (None, 0):
        unsupported.append(f"shared_expert_intermediate_size={cfg['shared_expert_intermediate_size']}")
    if cfg.get("moe_router_enable_expert_bias"):
        unsupported.append("moe_router_enable_expert_bias=true")
    # Fields whose published default is surprising: the configuration class applies no rotary
    # embedding without ``partial_rotary_factor`` and has rope_theta -1; the published checkpoints
    # set both, so a config that omits one is refused rather than given another model's default.
    for key, published in (("partial_rotary_factor", "no rotary embedding"), ("rope_theta", "-1, not a usable base")):
        if key not in cfg:
            unsupported.append(f"{key} missing (the published default is {published}; set it explicitly)")
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        unsupported.append(f"partial_rotary_factor={cfg['partial_rotary_factor']}")
    if cfg.get("clip_qkv") is not None:
        unsupported.append(f"clip_qkv={cfg['clip_qkv']}")
    if cfg.get("rope_scaling"):
        unsupported.append(f"rope_scaling={cfg['rope_scaling']!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']!r}")
    refuse("LLaDA-MoE", unsupported)
    layers = cfg["num_hidden_layers"]
    freq = cfg.get("moe_layer_freq") or [1] * layers
    heads = cfg["num_attention_heads"]
    q = Qwen3MoeConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("dense_intermediate_size") or cfg["expert_intermediate_size"],
        moe_intermediate_size=cfg["expert_intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rope_theta"])},
        attention_bias=bool(cfg.get("attention_bias", False)),
        num_experts=cfg["num_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        norm_topk_prob=False,  # the published router never renormalises the kept weights
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, f in enumerate(freq) if not f],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        use_sliding_window=False,
        **special_ids(cfg),
    )
    return tag_config(q, cfg, "llada_moe", 156895)



def stack_experts(state: dict) -> dict:
    """Per-expert gate/up/down matrices -> Qwen3-MoE's stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    out: dict = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
            continue
        experts.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
    for layer, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))) or any(len(by_expert[j]) != 3 for j in ids):
            continue  # left incomplete: the missing-weight check names the layer
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([by_expert[j]["gate"], by_expert[j]["up"]], 0) for j in ids])
        out[p + "down_proj"] = torch.stack([by_expert[j]["down"] for j in ids])
    return out


def qwen3moe_config_to_lladamoe(cfg: dict) -> dict:
    """The inverse of :func:`lladamoe_config_to_qwen3moe`: a trained (Qwen3-MoE) config dict as LLaDA-MoE's published
    config fields."""
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    dense = set(cfg.get("mlp_only_layers") or [])
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    return {
        "hidden_size": cfg["hidden_size"], "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads, "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096), "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": float(rope), "partial_rotary_factor": 1.0, "rope_scaling": None,
        "attention_bias": bool(cfg.get("attention_bias", False)), "attention_dropout": 0.0, "clip_qkv": None,
        "qk_layernorm": True, "hidden_act": "silu", "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "num_experts": cfg["num_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
        "expert_intermediate_size": cfg["moe_intermediate_size"], "dense_intermediate_size": cfg["intermediate_size"],
        "moe_layer_freq": [0 if i in dense else 1 for i in range(layers)], "norm_topk_prob": False,
        "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
        "shared_expert_intermediate_size": None, "use_cache": False,
        **{k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")},
    }


def unstack_experts(state: dict) -> dict:
    """The inverse of :func:`stack_experts`: Qwen3-MoE's stacked expert tensors -> the published per-expert matrices."""
    out: dict = {}
    for k, v in state.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for j in range(v.shape[0]):
                out[f"{p}{j}.gate_proj.weight"] = v[j, :inter]
                out[f"{p}{j}.up_proj.weight"] = v[j, inter:]
        elif k.endswith(".mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for j in range(v.shape[0]):
                out[f"{p}{j}.down_proj.weight"] = v[j]
        else:
            out[k] = v
    return out


def load_lladamoe_native(folder: Path, cfg: dict, dtype: torch.dtype):
    from transformers import Qwen3MoeForCausalLM

    return load_mapped(folder, Qwen3MoeForCausalLM, lladamoe_config_to_qwen3moe(cfg), dtype, transformers_key,
                       "LLaDA-MoE", combine=stack_experts)


LLADA_MOE = Family(
    name="llada_moe",
    reads_by_name=False,  # its experts are stacked as they load
    # The published hub config says "llada" (shared with LLaDA-8B); dllm's README has users rewrite it
    # to "lladamoe". Both are recognised: the class name and the MoE fields tell the two apart.
    model_types=("lladamoe", "llada_moe", "llada"),
    architectures=("LLaDAMoEModelLM",),
    signature=("num_experts",),
    logit_shift=0,
    mask_token_id=156895,
    stop_tokens=("<|role_end|>", "<|endoftext|>"),
    sampler="llada",
    load_native=load_lladamoe_native,
    decoding={"gen_length": 512, "block_length": 32, "steps": 512, "remasking": "low_confidence"},
    published_fields=qwen3moe_config_to_lladamoe,
    published_state=unstack_experts,
    published=PublishedLayout(
        "llada", ("LLaDAMoEModelLM",),
        {"AutoConfig": "configuration_lladamoe.LLaDAConfig", "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"}),
)
