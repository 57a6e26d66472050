"""Block-diffusion families: SDAR (JetLM), LLaDA2.0 and LLaDA2.1 (inclusionAI).

They are recognised so that a checkpoint of theirs is refused with its reason instead of being trained
with the whole-sequence likelihood, which is the wrong one for them: the commands do not run their block
ELBO or block sampler yet (docs/block_diffusion.md; the masks and the block ELBO are in
``dllm_align.objective.block``).

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

from dllm_align.models.families.base import Family, load_mapped, refuse, special_ids, tag_config, transformers_key

_NOT_YET = ("block-diffusion checkpoints (block {b}) are recognised but not yet trained, scored or sampled by "
            "dllm-align: its block ELBO and block sampler are not wired into the commands (see "
            "docs/block_diffusion.md)")


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


SDAR = Family(
    name="sdar",
    model_types=("sdar",),
    architectures=("SDARForCausalLM", "SDARMoeForCausalLM"),
    mask_token_id=151669,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    load_native=load_sdar_native,
    block_size=4,
    refuse_reason=_NOT_YET.format(b=4),
)

LLADA2 = Family(
    name="llada2",
    model_types=("llada2_moe",),
    mask_token_id=156895,
    stop_tokens=("<|role_end|>", "<|endoftext|>"),
    block_size=32,
    refuse_reason=_NOT_YET.format(b=32),
)

LLADA21 = Family(
    name="llada21",
    model_types=("llada21_moe",),
    mask_token_id=156895,
    block_size=32,
    refuse_reason=("LLaDA2.1 decodes with token editing (tokens already decoded can be replaced), which is not "
                   "an absorbing-mask likelihood: dllm-align's ELBO would train it wrongly, so it is refused"),
)
