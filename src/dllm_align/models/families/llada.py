"""LLaDA and LLaDA-1.5 (``model_type: llada``), and the built-in tiny models, which share their manners.

Native loading (docs/design.md#model-families): LLaDA's blocks are Llama blocks with
other weight names, so the checkpoint maps onto a transformers
``LlamaForCausalLM`` with ``is_causal = False`` (no remote code; gradient
checkpointing, SDPA / flash attention and the sampler's key/value cache come
with it). Logits are not shifted; mask id 126336; a turn ends with
``<|eot_id|>``; decoding is LLaDA's semi-autoregressive sampler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from dllm_align.models.families.base import (
    Family,
    PublishedLayout,
    build_seeded,
    byte_level_tokenizer,
    load_mapped,
    refuse,
    special_ids,
    tag_config,
)

# lazy imports: transformers: imported inside the builders: the family records are read (which family claims a
# config, the memory estimate) without building anything, and transformers takes longer to import than torch

# Special tokens of the built-in tokenizer, named as in LLaDA's tokenizer.
BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
EOT = "<|eot_id|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
MASK = "<|mdm_mask|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT, MASK]

# LLaDA's chat format: role headers, content, end-of-turn; the generation
# prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

LLADA_RENAMES = [
    # (LLaDA suffix, Llama suffix) for the weights inside each block
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ff_norm.weight", "post_attention_layernorm.weight"),
    ("q_proj.weight", "self_attn.q_proj.weight"),
    ("k_proj.weight", "self_attn.k_proj.weight"),
    ("v_proj.weight", "self_attn.v_proj.weight"),
    ("q_proj.bias", "self_attn.q_proj.bias"),
    ("k_proj.bias", "self_attn.k_proj.bias"),
    ("v_proj.bias", "self_attn.v_proj.bias"),
    ("attn_out.weight", "self_attn.o_proj.weight"),
    ("ff_proj.weight", "mlp.gate_proj.weight"),
    ("up_proj.weight", "mlp.up_proj.weight"),
    ("ff_out.weight", "mlp.down_proj.weight"),
]


def llada_config_to_llama(cfg: dict):
    """Translate a LLaDA ``config.json`` into a bidirectional ``LlamaConfig``.

    Raises UserError naming the field for LLaDA options the mapping does not
    reproduce (so a silent numerical difference is impossible).
    """
    from transformers import LlamaConfig

    unsupported = []
    checks = {
        "block_type": ("llama",),
        "layer_norm_type": ("rms",),
        "activation_type": ("silu", "swiglu"),
    }
    for key, ok in checks.items():
        if key in cfg and cfg[key] not in ok:
            unsupported.append(f"{key}={cfg[key]!r}")
    for key in ("input_emb_norm", "scale_logits", "alibi", "include_bias"):
        if cfg.get(key):
            unsupported.append(f"{key}=true")
    if cfg.get("rope") is False:
        unsupported.append("rope=false")
    if cfg.get("clip_qkv") is not None:
        unsupported.append(f"clip_qkv={cfg['clip_qkv']}")
    refuse("LLaDA", unsupported)
    d = cfg["d_model"]
    n_heads = cfg["n_heads"]
    mlp = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d)
    vocab = cfg.get("embedding_size") or cfg["vocab_size"]
    theta = float(cfg.get("rope_theta", 10000.0))
    llama = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=mlp,
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("n_kv_heads") or n_heads,
        max_position_embeddings=cfg.get("max_sequence_length", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=bool(cfg.get("weight_tying", False)),
        attention_bias=bool(cfg.get("include_qkv_bias", False)),
        **special_ids(cfg),
    )
    return tag_config(llama, cfg, "llada", 126336)


def llada_key_to_llama(key: str) -> Optional[str]:
    """Map one LLaDA weight name onto the Llama name (None: not a weight we keep)."""
    k = key
    for prefix in ("model.transformer.", "transformer."):
        if k.startswith(prefix):
            k = k[len(prefix):]
            break
    else:
        return None
    if k == "wte.weight":
        return "model.embed_tokens.weight"
    if k == "ln_f.weight":
        return "model.norm.weight"
    if k == "ff_out.weight":
        return "lm_head.weight"
    if k.startswith("blocks."):
        _, idx, rest = k.split(".", 2)
        for src, dst in LLADA_RENAMES:
            if rest == src:
                return f"model.layers.{idx}.{dst}"
    return None


def llama_config_to_llada(cfg: dict) -> dict:
    """The inverse of :func:`llada_config_to_llama`: a trained (Llama) config dict as LLaDA's published config fields
    (the ones ``configuration_llada.LLaDAConfig`` reads; the switches set to the only values the mapping allows)."""
    heads = cfg["num_attention_heads"]
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    return {
        "d_model": cfg["hidden_size"], "n_heads": heads, "n_kv_heads": cfg.get("num_key_value_heads") or heads,
        "n_layers": cfg["num_hidden_layers"], "mlp_hidden_size": cfg["intermediate_size"],
        "mlp_ratio": max(1, cfg["intermediate_size"] // cfg["hidden_size"]),
        "vocab_size": cfg["vocab_size"], "embedding_size": cfg["vocab_size"],
        "max_sequence_length": cfg.get("max_position_embeddings", 4096), "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": float(rope), "rope": True, "rope_full_precision": True, "alibi": False,
        "weight_tying": bool(cfg.get("tie_word_embeddings", False)),
        "include_qkv_bias": bool(cfg.get("attention_bias", False)), "include_bias": False, "bias_for_layer_norm": False,
        "block_type": "llama", "block_group_size": 1, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True, "activation_type": "silu",
        "input_emb_norm": False, "scale_logits": False, "multi_query_attention": None, "flash_attention": False,
        "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0, "use_cache": False,
        **{k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")},
    }


_LLAMA_TO_LLADA = {dst: src for src, dst in LLADA_RENAMES}


def llama_key_to_llada(key: str) -> str:
    """The inverse of :func:`llada_key_to_llama` (the published names under ``model.transformer.``); KeyError for a
    name the mapping does not produce."""
    top = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "ln_f.weight", "lm_head.weight": "ff_out.weight"}
    if key in top:
        return "model.transformer." + top[key]
    if key.startswith("model.layers."):
        _, _, idx, rest = key.split(".", 3)
        if rest in _LLAMA_TO_LLADA:
            return f"model.transformer.blocks.{idx}.{_LLAMA_TO_LLADA[rest]}"
    raise KeyError(f"no LLaDA name for weight {key!r}")


def llama_state_to_llada(state: dict) -> dict:
    return {llama_key_to_llada(k): v for k, v in state.items()}


def _no_output_bias(model) -> None:
    """LLaDA's include_qkv_bias puts biases on q, k and v only; Llama's attention_bias would
    add one to o_proj too (and then ask the checkpoint for it)."""
    if model.config.attention_bias:
        for layer in model.model.layers:
            layer.self_attn.o_proj.register_parameter("bias", None)


def load_llada_native(folder: Path, cfg: dict, dtype: torch.dtype):
    """Load a LLaDA checkpoint folder into a bidirectional LlamaForCausalLM (no remote code)."""
    from transformers import LlamaForCausalLM

    return load_mapped(folder, LlamaForCausalLM, llada_config_to_llama(cfg), dtype, llada_key_to_llama, "LLaDA",
                       prepare=_no_output_bias)


def build_llada_tokenizer():
    """A byte-level tokenizer with LLaDA's special tokens and chat template (for the built-in LLaDA models)."""
    return byte_level_tokenizer(SPECIAL_TOKENS, bos=BOS, eos=EOS, mask=MASK, extra=[START_HEADER, END_HEADER, EOT],
                                chat_template=CHAT_TEMPLATE)


def build_llada_model(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                      max_position_embeddings: int, seed: int):
    """A random tiny bidirectional Llama with LLaDA's manners; deterministic by seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        is_causal=False,
    )
    cfg.mask_token_id = tokenizer.mask_token_id
    cfg.dllm_align_family = "llada"
    return build_seeded(LlamaForCausalLM, cfg, seed)


LLADA = Family(
    name="llada",
    model_types=("llada",),
    architectures=("LLaDAModelLM",),
    signature=("d_model",),
    logit_shift=0,
    mask_token_id=126336,
    # The same stop list the sampler always used (a trained tiny model may emit any of them).
    stop_tokens=("<|eot_id|>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>"),
    sampler="llada",
    load_native=load_llada_native,
    decoding={"gen_length": 512, "block_length": 32, "steps": 512, "remasking": "low_confidence"},
    tiny_tokenizer=build_llada_tokenizer,
    build_tiny=build_llada_model,
    published_fields=llama_config_to_llada,
    published_state=llama_state_to_llada,
    published=PublishedLayout(
        "llada", ("LLaDAModelLM",),
        {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
         "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}),
)
