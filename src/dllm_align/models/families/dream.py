"""Dream (``Dream-org/Dream-v0-Instruct-7B``, ``model_type: Dream``) and models built on it (DiffuCoder).

Facts from the published config and code (docs/design.md#model-families):

* the body is a Qwen2 block (q/k/v with bias, o_proj without, RMSNorm, SwiGLU,
  rotary base 1e6) with non-causal attention and an untied head; its weight
  names are exactly transformers' ``Qwen2ForCausalLM`` names, so the
  checkpoint loads natively into a Qwen2 model with ``is_causal = False``;
* **logits are shifted**: the token at position j is scored by the output at
  j - 1, and position 0 by its own output (``cat([logits[:, :1],
  logits[:, :-1]])`` in the published sampler and likelihood code);
* mask id 151666 ``<|mask|>`` (config.json), bos = eos = pad = 151643
  ``<|endoftext|>``, a turn ends with ``<|im_end|>``;
* its own decoding rule (``diffusion_generate``): see ``dllm_align.generate.dream``;
* rotary frequencies are computed here in fp32 from the config (the published
  code leaves ``inv_freq`` uninitialised under transformers 5).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dllm_align.models.families.base import (
    Family,
    PublishedLayout,
    build_seeded,
    byte_level_tokenizer,
    load_mapped,
    qwen_fields,
    refuse,
    tag_config,
    transformers_key,
)

# lazy imports: transformers: imported inside the builders: the family records are read (which family claims a
# config, the memory estimate) without building anything, and transformers takes longer to import than torch

# Specials of the built-in Dream-format tokenizer, named as in Dream's (Qwen2.5) tokenizer.
DREAM_EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DREAM_MASK = "<|mask|>"
DREAM_SPECIALS = [DREAM_EOS, IM_START, IM_END, DREAM_MASK]

# Qwen2.5's chat format with its default system prompt, as Dream's tokenizer renders it.
DREAM_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def dream_config_to_qwen2(cfg: dict):
    """Translate a Dream ``config.json`` into a bidirectional ``Qwen2Config`` (unsupported options named)."""
    from transformers import Qwen2Config

    unsupported, fields = qwen_fields(cfg)
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
        unsupported.append(f"head_dim={cfg['head_dim']}")
    refuse("Dream", unsupported)
    q = Qwen2Config(**fields)
    return tag_config(q, cfg, "dream", 151666)



def load_dream_native(folder: Path, cfg: dict, dtype: torch.dtype):
    from transformers import Qwen2ForCausalLM

    return load_mapped(folder, Qwen2ForCausalLM, dream_config_to_qwen2(cfg), dtype, transformers_key, "Dream")


def fix_dream_tokenizer(tok, path: Path):
    """Dream's tokenizer files name a remote-code class; its vocabulary is Qwen2's, which loads natively."""
    if tok is not None:
        return tok
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(str(path), trust_remote_code=False)


def build_dream_tokenizer():
    """A byte-level tokenizer with Dream's special tokens and chat template (for the built-in Dream models)."""
    return byte_level_tokenizer(DREAM_SPECIALS, bos=DREAM_EOS, eos=DREAM_EOS, mask=DREAM_MASK,
                                extra=[IM_START, IM_END], chat_template=DREAM_CHAT_TEMPLATE)


def build_dream_model(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                      max_position_embeddings: int, seed: int):
    """A random tiny Dream-format model (Qwen2 body, bidirectional, shifted logits); deterministic by seed."""
    from transformers import Qwen2ForCausalLM

    cfg = dream_config_to_qwen2({
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),  # grouped-query attention, as Dream-7B (28 / 4)
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "mask_token_id": tokenizer.mask_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    })
    return build_seeded(Qwen2ForCausalLM, cfg, seed)


DREAM = Family(
    name="dream",
    model_types=("Dream", "dream"),
    architectures=("DreamModel",),
    logit_shift=1,
    mask_token_id=151666,
    # DiffuCoder's published code also stops at its padding token <|dlm_pad|> (absent from Dream's vocabulary).
    stop_tokens=(IM_END, DREAM_EOS, "<|dlm_pad|>"),
    decode_keeps_special=True,
    sampler="dream",
    load_native=load_dream_native,
    fix_tokenizer=fix_dream_tokenizer,
    # The model card's example: 512 new tokens, 512 steps, temperature 0.2, top_p 0.95, entropy order.
    decoding={"gen_length": 512, "steps": 512, "temperature": 0.2, "top_p": 0.95, "alg": "entropy", "alg_temp": 0.0},
    tiny_tokenizer=build_dream_tokenizer,
    build_tiny=build_dream_model,
    published=PublishedLayout(
        "Dream", ("DreamModel",),
        {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}),
)
