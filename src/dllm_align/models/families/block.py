"""Block-diffusion families: SDAR (JetLM), LLaDA2.0 and LLaDA2.1 (inclusionAI).

SDAR is trained, scored and sampled by every command: its block ELBO (``dllm_align.objective.block``)
runs the K noisy streams and one shared clean stream through the streams attention
(``dllm_align.models.block_attention``), which every block family is loaded with; its sampler is
``dllm_align.generate.block``. The LLaDA2 families are recognised and refused with their reason
(docs/block_diffusion.md).

* **SDAR** (``architectures: [SDARForCausalLM]``, ``model_type: sdar``; the published config.json of
  SDAR-1.7B-Chat): a Qwen3 body (per-head RMSNorm on queries and keys, GQA, SwiGLU, RMSNorm pre-norm,
  rotary base ``rope_theta``) with the same weight names, so it loads natively into
  ``Qwen3ForCausalLM``; ``block_size`` 4, ``mask_token_id`` 151669 (both in its config.json). The
  published training forward masks each sample at ``p = (1 - 1e-3) t + 1e-3`` and divides a masked
  token's loss by ``p``. The MoE variant (``SDARMoeForCausalLM``) is refused by the native loader.
* **LLaDA2.0** (``model_type: llada2_moe``, ``LLaDA2MoeModelLM``): an MoE body transformers has no
  twin of (fused ``query_key_value``, partial rotary 0.5 by default, a sigmoid router with an expert
  bias, grouped top-k over ``n_group`` / ``topk_group`` groups, ``routed_scaling_factor``, shared
  experts); block 32, mask id 156895.
* **LLaDA2.1** (``model_type: llada21_moe``, the same class name): adds token editing (already decoded
  tokens can be replaced), which is not an absorbing-mask likelihood: refused by name.

The LLaDA2 families are told apart by ``model_type`` only, since both publish ``LLaDA2MoeModelLM``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dllm_align.models.families.base import (Family, build_seeded, load_mapped, refuse, special_ids, tag_config,
                                             transformers_key)

_NOT_YET = ("block-diffusion checkpoints (block {b}) are recognised but not yet trained, scored or sampled by "
            "dllm-align: transformers has no body for its MoE layers and dllm-align's own is not in this release "
            "(see docs/block_diffusion.md)")


def sdar_config_to_qwen3(cfg: dict):
    """Translate an SDAR ``config.json`` into a ``Qwen3Config`` (unsupported options named)."""
    from transformers import Qwen3Config

    unsupported = []
    if "num_experts" in cfg or "SDARMoeForCausalLM" in (cfg.get("architectures") or []):
        unsupported.append("the MoE variant (SDARMoeForCausalLM)")
    if cfg.get("rope_scaling"):
        unsupported.append(f"rope_scaling={cfg['rope_scaling']!r}")
    if cfg.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true")
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']!r}")
    refuse("SDAR", unsupported)
    heads = cfg["num_attention_heads"]
    q = Qwen3Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))},
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        use_sliding_window=False,
        **special_ids(cfg),
    )
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


SDAR = Family(
    name="sdar",
    model_types=("sdar",),
    architectures=("SDARForCausalLM", "SDARMoeForCausalLM"),
    mask_token_id=151669,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    load_native=load_sdar_native,
    sampler="block",
    # SDAR's serving defaults (block 4, low_confidence_dynamic at 0.9); steps = one per token of a block
    decoding={"gen_length": 512, "block_length": 4, "steps": 512, "temperature": 1.0, "threshold": 0.9},
    block_size=4,
)

LLADA2 = Family(
    name="llada2",
    model_types=("llada2_moe",),
    mask_token_id=156895,
    stop_tokens=("<|role_end|>", "<|endoftext|>"),
    sampler="block",
    block_rule="llada2",
    # LLaDA2's published generate: blocks of 32, 32 rounds per block, threshold 0.95, greedy
    decoding={"gen_length": 512, "block_length": 32, "steps": 512, "temperature": 0.0, "threshold": 0.95},
    block_size=32,
    refuse_reason=_NOT_YET.format(b=32),
)

LLADA21 = Family(
    name="llada21",
    model_types=("llada21_moe",),
    mask_token_id=156895,
    sampler="block",
    block_rule="llada2",
    block_size=32,
    refuse_reason=("LLaDA2.1 decodes with token editing (tokens already decoded can be replaced), which is not "
                   "an absorbing-mask likelihood: dllm-align's ELBO would train it wrongly, so it is refused"),
)
