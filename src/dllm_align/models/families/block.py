"""Block-diffusion families: SDAR (JetLM), LLaDA2.0 and LLaDA2.1 (inclusionAI).

SDAR and LLaDA2.0 (and LLaDA2.1, whose record is ``families/llada21.py``) are trained, scored and sampled by
every command: the block ELBO (``dllm_align.objective.block``) runs the K noisy streams and one shared clean
stream through the streams attention (``dllm_align.models.block_attention``), which every block family is loaded
with; the sampler is ``dllm_align.generate.block`` with each family's published rule (LLaDA2.1's token editing:
``dllm_align.generate.llada21``).

* **SDAR** (``architectures: [SDARForCausalLM]``, ``model_type: sdar``; the published config.json of
  SDAR-1.7B-Chat): a Qwen3 body (per-head RMSNorm on queries and keys, GQA, SwiGLU, RMSNorm pre-norm,
  rotary base ``rope_theta``) with the same weight names, so it loads natively into
  ``Qwen3ForCausalLM``; ``block_size`` 4, ``mask_token_id`` 151669 (both in its config.json). The
  published training forward masks each sample at ``p = (1 - 1e-3) t + 1e-3`` and divides a masked
  token's loss by ``p``. The MoE variant (``SDARMoeForCausalLM``) is refused by the native loader.
* **LLaDA2.0** (``model_type: llada2_moe``, ``LLaDA2MoeModelLM``): an MoE body transformers has no
  twin of (fused ``query_key_value``, partial rotary 0.5 by default, a sigmoid router with an expert
  bias, grouped top-k over ``n_group`` / ``topk_group`` groups, ``routed_scaling_factor``, shared
  experts), so dllm-align carries its own (``families/llada2_body.py``) and loads the checkpoint into
  it with the published weight names; block 32, mask id 156895.

LLaDA2.1 publishes the same class and ``model_type`` as LLaDA2.0: ``families/llada21.py`` says how the two are told
apart.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import torch

from dllm_align.models.families.base import (Family, PublishedLayout, build_seeded, load_mapped, qwen_fields, refuse,
                                             special_ids, tag_config, transformers_key)
from dllm_align.models.families.dream import build_dream_tokenizer
from dllm_align.models.families.llada import build_llada_tokenizer

# lazy imports: transformers, dllm_align.models.families.llada2_body: imported inside the builders (llada2_body
# subclasses transformers' classes): the family records are read (which family claims a config, the memory
# estimate) without building anything, and transformers takes longer to import than torch


def sdar_config_to_qwen3(cfg: dict):
    """Translate an SDAR ``config.json`` into a ``Qwen3Config`` (unsupported options named)."""
    from transformers import Qwen3Config

    unsupported, fields = qwen_fields(cfg)
    if "num_experts" in cfg or "SDARMoeForCausalLM" in (cfg.get("architectures") or []):
        unsupported.insert(0, "the MoE variant (SDARMoeForCausalLM)")
    refuse("SDAR", unsupported)
    q = Qwen3Config(**fields, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                    attention_bias=bool(cfg.get("attention_bias", False)))
    q.block_size = int(cfg.get("block_size", 4))
    return tag_config(q, cfg, "sdar", 151669)


def load_sdar_native(folder: Path, cfg: dict, dtype: torch.dtype):
    from transformers import Qwen3ForCausalLM

    return load_mapped(folder, Qwen3ForCausalLM, sdar_config_to_qwen3(cfg), dtype, transformers_key, "SDAR")


def build_sdar_model(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                     max_position_embeddings: int, seed: int, block_size: int = 4):
    """A random tiny SDAR-format model (Qwen3 body, GQA, per-head q/k norms), deterministic by seed; its
    config is translated from an SDAR-shaped config.json, so it goes through the same checks as a checkpoint."""
    from transformers import Qwen3ForCausalLM

    cfg = sdar_config_to_qwen3({
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", "vocab_size": len(tokenizer),
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": hidden_size // heads,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "block_size": block_size, "mask_token_id": tokenizer.mask_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
    })
    return build_seeded(Qwen3ForCausalLM, cfg, seed)


# --------------------------------------------------------------------------- LLaDA2.0
def llada2_config(cfg: dict, family: str = "llada2", label: str = "LLaDA2.0"):
    """A LLaDA2.0 ``config.json`` as the native body's config (every option it does not reproduce named).

    Fields a config.json omits take the published configuration class's defaults, as its own code would.
    ``family`` / ``label``: the family the config is tagged with and the name refusals use (LLaDA2.1 reads the
    same fields: ``families/llada21.py``).
    """
    from dllm_align.models.families.llada2_body import Llada2MoeConfig, check_shapes

    no = []
    if cfg.get("use_qk_norm", True) is False:
        no.append("use_qk_norm=false (the hub's modeling code normalises queries and keys regardless, the dllm "
                  "library's copy skips it: the checkpoint's meaning is ambiguous)")
    for key in ("rope_scaling", "use_sliding_window", "tie_word_embeddings", "norm_head", "norm_softmax",
                "using_split_qkv_in_self_attention", "output_router_logits"):
        if cfg.get(key):
            no.append(f"{key}={cfg[key]!r}")
    for key, want in (("use_rmsnorm", True), ("norm_topk_prob", True), ("moe_router_enable_expert_bias", True)):
        if key in cfg and cfg[key] is not want:
            no.append(f"{key}={cfg[key]!r}")
    if cfg.get("score_function", "sigmoid") != "sigmoid":
        no.append(f"score_function={cfg['score_function']!r}")
    if str(cfg.get("router_dtype", "fp32")) not in ("fp32", "float32"):
        no.append(f"router_dtype={cfg['router_dtype']!r}")
    # Training-time attention dropout (the published class's default is 0.1; the published checkpoints
    # say 0.0): dllm-align's objectives and its streams attention assume a deterministic body.
    if float(cfg.get("attention_dropout", 0.1)) != 0.0:
        no.append(f"attention_dropout={cfg.get('attention_dropout', '0.1 (the published default; missing)')}")
    published = [n for n in inspect.signature(Llada2MoeConfig.__init__).parameters if n not in ("self", "kwargs")]
    fields = {k: cfg[k] for k in published if k in cfg and k not in ("rope_scaling", "pad_token_id")}
    ids = {**special_ids(cfg), "pad_token_id": cfg.get("pad_token_id", 126081)}
    if no:
        refuse(label, no)
    config = Llada2MoeConfig(**fields, **ids)
    if cfg.get("rotary_dim") is not None and cfg["rotary_dim"] != config.rope_dim:
        no.append(f"rotary_dim={cfg['rotary_dim']} (the published code rotates int(head_dim * "
                  f"partial_rotary_factor) = {config.rope_dim} dimensions)")
    pad = config.pad_token_id
    if pad is not None and not 0 <= pad < config.vocab_size:
        no.append(f"pad_token_id={pad} outside the vocabulary ({config.vocab_size}; the embedding's padding row)")
    refuse(label, no + check_shapes(config))
    config.block_size = int(cfg.get("block_size", 32))
    return tag_config(config, cfg, family, 156895)


def load_llada2_native(folder: Path, cfg: dict, dtype: torch.dtype):
    """A LLaDA2.0 checkpoint in the native body: the published weight names, no renaming."""
    from dllm_align.models.families.llada2_body import Llada2MoeModelLM

    return load_mapped(folder, Llada2MoeModelLM, llada2_config(cfg), dtype, lambda key: key, "LLaDA2.0")


def build_llada2_model(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                       max_position_embeddings: int, seed: int, num_experts: int = 4,
                       num_key_value_heads: Optional[int] = None, num_experts_per_tok: int = 2,
                       n_group: int = 2, topk_group: int = 1, moe_intermediate_size: Optional[int] = None,
                       num_shared_experts: int = 1, first_k_dense_replace: int = 1, block_size: int = 32,
                       translate=llada2_config):
    """A random tiny LLaDA2.0 model (the published layout: first layer dense, then MoE layers with a
    shared expert; GQA, partial rotary 0.5, base 600000), deterministic by seed. ``translate``: the family's
    config.json reading (LLaDA2.1's for its built-in models)."""
    kv = num_key_value_heads or next(k for k in (heads // 4, heads // 2, heads, 1) if k and heads % k == 0)
    config = translate({
        "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hidden_size // heads, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_theta": 600000, "partial_rotary_factor": 0.5, "use_bias": False,
        "use_qkv_bias": False, "use_qk_norm": True, "attention_dropout": 0.0, "embedding_dropout": 0.0,
        "output_dropout": 0.0, "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
        "n_group": n_group, "topk_group": topk_group, "num_shared_experts": num_shared_experts,
        "moe_intermediate_size": moe_intermediate_size or max(1, intermediate_size // 2),
        "first_k_dense_replace": first_k_dense_replace, "routed_scaling_factor": 2.5, "use_cache": False,
        "mask_token_id": tokenizer.mask_token_id, "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "block_size": block_size,
    })
    from dllm_align.models.families.llada2_body import Llada2MoeModelLM

    return build_seeded(Llada2MoeModelLM, config, seed)


def build_tiny_llada2(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                      max_position_embeddings: int, seed: int):
    """The built-in LLaDA2.0 models: blocks of 8 (the published block is 32) so that short rows span several blocks."""
    return build_llada2_model(tokenizer, hidden_size, layers, heads, intermediate_size, max_position_embeddings, seed,
                              block_size=8)


SDAR = Family(
    name="sdar",
    model_types=("sdar",),
    architectures=("SDARForCausalLM", "SDARMoeForCausalLM"),
    mask_token_id=151669,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    load_native=load_sdar_native,
    sampler="block",
    likelihood="block",
    # SDAR's serving defaults (block 4, low_confidence_dynamic at 0.9); steps = one per token of a block
    decoding={"gen_length": 512, "block_length": 4, "steps": 512, "temperature": 1.0, "threshold": 0.9},
    block_size=4,
    # SDAR is Qwen-tokenised as Dream is: <|im_start|> / <|im_end|> turns
    tiny_tokenizer=build_dream_tokenizer,
    build_tiny=build_sdar_model,
    published=PublishedLayout(
        "sdar", ("SDARForCausalLM",),
        {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
         "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        # modeling_sdar.py reads it in every forward (``config.fuse_cross_entropy and self.training``); SDARConfig
        # has no such field, the published SDAR-1.7B/4B/8B-Chat config.json say true
        defaults={"fuse_cross_entropy": True}),
    qk_norm=lambda cfg, experts: not experts,  # Qwen3's per-head norms; the MoE variant has none
)

LLADA2 = Family(
    name="llada2",
    model_types=("llada2_moe",),
    mask_token_id=156895,
    stop_tokens=("<|role_end|>", "<|endoftext|>"),
    load_native=load_llada2_native,
    sampler="block",
    likelihood="block",
    block_rule="llada2",
    # LLaDA2's published generate: blocks of 32, 32 rounds per block, threshold 0.95, greedy
    decoding={"gen_length": 512, "block_length": 32, "steps": 512, "temperature": 0.0, "threshold": 0.95},
    block_size=32,
    tiny_tokenizer=build_llada_tokenizer,
    build_tiny=build_tiny_llada2,
    published=PublishedLayout(
        "llada2_moe", ("LLaDA2MoeModelLM",),
        {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig", "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
         "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}),
    qk_norm=lambda cfg, experts: cfg.get("use_qk_norm", True) is not False,
)
