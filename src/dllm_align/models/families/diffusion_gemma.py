"""DiffusionGemma (``google/diffusiongemma-26B-A4B-it``): uniform-noise block diffusion with an encoder
over the clean context and a bidirectional decoder over a canvas, loaded into transformers' own classes.

* **Layout**: ``architectures: [DiffusionGemmaForBlockDiffusion]``, ``model_type: diffusion_gemma``; the
  checkpoint is in transformers' own layout (``models/diffusion_gemma``, transformers >= 5.11), so it
  loads with ``from_pretrained`` and no renaming, remote code never. The encoder (causal, over the prompt
  and finished canvases) writes a KV cache; the decoder (bidirectional over ``canvas_length`` tokens) reads
  it; encoder and decoder share every weight (``_tied_weights_keys``), each stack keeps its own
  ``layer_scalar`` buffers.
* **Text only**: the class always builds the vision tower and the published checkpoint holds its weights;
  it is loaded (so the checkpoint loads whole and exports unchanged), frozen and never run: dllm-align
  feeds text, and ``pixel_values`` never reach the model.
* **Noise**: uniform, not absorbing: the family's likelihood is ``"uniform"``
  (``dllm_align.objective.uniform``). The tokenizer's ``<mask>`` (id 4) is only the id the shared
  predictor interface asks for; no draw uses it.
* **Scoring** (:func:`canvas_logits`): the clean context is encoded once per example and its cache
  shared by the K noisy canvases of every draw; a completion longer than one canvas appends each clean
  canvas to the cache with one more encoder call (the clean stream of block diffusion). Examples of the same
  shape run as one batch (nothing is padded).
* **Generation**: transformers' own ``generate`` with the published generation config (``generate.rules``).
* **LoRA** (:func:`lora_modules`, :func:`share_adapters`): adapters go on the decoder's modules and the
  encoder's twins are pointed at the same adapted modules, so the tied weights stay tied through training
  and a merge updates both stacks identically.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional

import torch
from packaging.version import Version

from dllm_align.core.errors import RunFailure, UserError
from dllm_align.models.families.base import (Family, build_seeded, byte_level_tokenizer, check_weight_files,
                                             from_pretrained_checked, refuse_oversized)

# lazy imports: transformers: imported inside the builders: the family records are read (which family claims a
# config, the memory estimate) without building anything, and transformers takes longer to import than torch

# The first release that ships the classes (``DiffusionGemmaForBlockDiffusion``).
MIN_TRANSFORMERS = "5.11"

# Special tokens of the built-in tokenizer, named as in the published tokenizer (Gemma 4's turns).
PAD, EOS, BOS, MASK = "<pad>", "<eos>", "<bos>", "<mask>"
TURN_OPEN, TURN_CLOSE, TOOL_RESPONSE = "<|turn>", "<turn|>", "<|tool_response>"
SPECIAL_TOKENS = [PAD, EOS, BOS, MASK, TURN_OPEN, TURN_CLOSE, TOOL_RESPONSE]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + (message['content'] | trim) + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)

# The published generation_config.json (google/diffusiongemma-26B-A4B-it), where it sets what
# transformers' defaults leave unset (eos and pad) or could change; followed by ``generate``.
PUBLISHED_GENERATION = {
    "max_new_tokens": 256, "max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
    "stability_threshold": 1, "confidence_threshold": 0.005, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
}


def require_classes() -> None:
    """Refuse a transformers release without the DiffusionGemma classes, by name."""
    import transformers

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise UserError(f"DiffusionGemma needs transformers >= {MIN_TRANSFORMERS} (its DiffusionGemmaForBlockDiffusion "
                        f"class); this is {transformers.__version__}",
                        hint=f"pip install 'transformers>={MIN_TRANSFORMERS},<6'")


def check_config(cfg: dict) -> None:
    """Refuse what the text-only scoring path does not reproduce, by name."""
    no = []
    text = cfg.get("text_config") or {}
    if text.get("use_bidirectional_attention", "vision") not in ("vision", None):
        no.append(f"text_config.use_bidirectional_attention={text['use_bidirectional_attention']!r} (the encoder "
                  "must be causal over text: the clean stream assumes it)")
    if float(text.get("attention_dropout", 0.0) or 0.0) != 0.0:
        no.append(f"text_config.attention_dropout={text['attention_dropout']} (the objectives assume a deterministic body)")
    if no:
        raise UserError(f"DiffusionGemma config options not supported: {', '.join(no)}")


def freeze_vision(model) -> None:
    """The vision tower and its embedder: loaded, frozen, never run (text only)."""
    enc = model.model.encoder
    for mod in (enc.vision_tower, enc.embed_vision):
        for p in mod.parameters():
            p.requires_grad_(False)


def load_native(folder: Path, cfg: dict, dtype: torch.dtype):
    """The published layout is transformers' own: ``from_pretrained`` with safetensors only, no remote code."""
    require_classes()
    check_config(cfg)
    from transformers import DiffusionGemmaForBlockDiffusion

    refuse_oversized(folder, check_weight_files(folder, cfg), lambda: DiffusionGemmaForBlockDiffusion(
        DiffusionGemmaForBlockDiffusion.config_class.from_dict(cfg)))
    try:
        model = from_pretrained_checked(DiffusionGemmaForBlockDiffusion.from_pretrained, folder, "DiffusionGemma",
                                        dtype=dtype, use_safetensors=True, trust_remote_code=False)
    except OSError as e:
        raise UserError(f"{folder}: could not load the DiffusionGemma weights ({str(e).splitlines()[0][:200]})") from None
    model.config.dllm_align_family = "diffusion_gemma"
    model.config.mask_token_id = cfg.get("mask_token_id", 4)
    freeze_vision(model)
    return model.eval()


def fix_tokenizer(tok, folder: Path):
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    return tok


def build_tokenizer():
    """A byte-level tokenizer with DiffusionGemma's special tokens and Gemma 4's chat turns; pads with ``<pad>``."""
    tok = byte_level_tokenizer(SPECIAL_TOKENS, bos=BOS, eos=EOS, mask=MASK, extra=[TURN_OPEN, TURN_CLOSE, TOOL_RESPONSE],
                               chat_template=CHAT_TEMPLATE)
    tok.pad_token = PAD
    return tok


# The published config.json (google/diffusiongemma-26B-A4B-it) field for field; ``tiny_config`` shrinks the sizes.
PUBLISHED_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "dtype": "bfloat16", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2816, "initializer_range": 0.02, "intermediate_size": 2112,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5, "max_position_embeddings": 262144,
    "model_type": "diffusion_gemma_text", "moe_intermediate_size": 704, "num_attention_heads": 16, "num_experts": 128,
    "num_global_key_value_heads": 2, "num_hidden_layers": 30, "num_key_value_heads": 8, "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8, "use_bidirectional_attention": "vision",
    "vocab_size": 262144,
}
PUBLISHED_VISION = {"model_type": "gemma4_vision", "hidden_size": 1152, "num_hidden_layers": 27}
PUBLISHED = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "boi_token_id": 255999, "canvas_length": 256,
    "eoi_token_id": 258882, "eos_token_id": [1, 106], "image_token_id": 258880, "model_type": "diffusion_gemma",
    "text_config": PUBLISHED_TEXT, "tie_word_embeddings": True, "vision_config": PUBLISHED_VISION,
    "vision_soft_tokens_per_image": 280,
}
# The vision tower, shrunk to a few thousand weights: the class always builds one.
TINY_VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8,
               "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 64, "rms_norm_eps": 1e-06,
               "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}, "standardize": True,
               "use_clipped_linears": False, "default_output_length": 280}


def tiny_config(vocab_size: int, hidden_size: int = 64, layers: int = 6, heads: int = 4, intermediate_size: int = 96,
                max_position_embeddings: int = 4096, canvas_length: int = 8, sliding_window: int = 16,
                special: Optional[dict] = None) -> dict:
    """The published config.json with the sizes shrunk: the same fields, layer pattern (5 sliding : 1 full, cut
    to ``layers``), head-dim ratio, MoE routing (4 experts, top 2) and soft-cap."""
    head_dim = hidden_size // heads
    text = {**PUBLISHED_TEXT, "hidden_size": hidden_size, "head_dim": head_dim, "global_head_dim": 2 * head_dim,
            "intermediate_size": intermediate_size, "moe_intermediate_size": max(8, intermediate_size // 3),
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "num_global_key_value_heads": 1,
            "num_experts": 4, "top_k_experts": 2, "num_hidden_layers": layers,
            "layer_types": [("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(layers)],
            "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
            "sliding_window": sliding_window, "dtype": "float32", **(special or {})}
    return {**PUBLISHED, "canvas_length": canvas_length, "text_config": text, "vision_config": dict(TINY_VISION),
            **({"eos_token_id": [special["eos_token_id"], special["end_of_turn_id"]]} if special else {})}


def build_model(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                max_position_embeddings: int, seed: int):
    """A random tiny DiffusionGemma (the published config shrunk, :func:`tiny_config`), deterministic by seed.
    At least 6 layers so the 5:1 sliding/full pattern has a full-attention layer."""
    require_classes()
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    eot = tokenizer.convert_tokens_to_ids(TURN_CLOSE)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id, "end_of_turn_id": eot}
    d = tiny_config(len(tokenizer), hidden_size, max(6, layers), heads, intermediate_size, max_position_embeddings,
                    special=special)
    d["text_config"].pop("end_of_turn_id")
    config = DiffusionGemmaConfig(**copy.deepcopy(d))
    config.dllm_align_family = "diffusion_gemma"
    config.mask_token_id = tokenizer.mask_token_id
    model = build_seeded(DiffusionGemmaForBlockDiffusion, config, seed)
    # Random init leaves every router scale and layer scalar at 1 and the self-conditioning gate at 0:
    # perturb them (seeded) so that no path of the tiny model is degenerate.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" not in name and ("scale" in name or "self_conditioning" in name):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    freeze_vision(model)
    return model.eval()


# --------------------------------------------------------------------------- scoring: the clean stream
def _new_cache(model):
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _repeated(cache, k: int):
    """A copy of ``cache`` with each row repeated ``k`` times (the original is left as it is, so more clean
    canvases can be appended to it)."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    new.batch_repeat_interleave(k)
    return new


def canvas_logits(model, context: torch.Tensor, canvases: list[torch.Tensor], noisy: list[torch.Tensor],
                  self_conditioning: str = "none") -> list[torch.Tensor]:
    """Decoder logits of the noisy versions of one example's canvases (or of G examples of the same shape), each
    conditioned on the clean context before it; the clean sequence goes through the encoder once.

    ``context`` [S]: the prompt; ``canvases``: the clean canvases [C_b] in order; ``noisy``: for each canvas
    its K noisy versions [K, C_b]. Returns for each canvas fp32 logits [K, C_b, V] (soft-capped, the model's own
    head). With a leading batch dimension (``context`` [G, S], ``canvases`` [G, C_b], ``noisy`` [G, K, C_b]) the
    G examples, which must have the same lengths (nothing is padded), run in one encoder and one decoder call per
    canvas and the result is [G, K, C_b, V] per canvas. ``self_conditioning``: ``none`` (zero signal, one pass)
    or ``detached`` (a first pass without gradient whose logits condition the second, the published training
    convention).
    """
    if self_conditioning not in ("none", "detached"):
        raise ValueError(f"self_conditioning must be 'none' or 'detached', got {self_conditioning!r}")
    single = context.dim() == 1
    if single:
        context, canvases, noisy = context[None], [c[None] for c in canvases], [x[None] for x in noisy]
    G = context.shape[0]
    cache = model.model.encoder(input_ids=context, cache=_new_cache(model)).cache
    out = []
    for b, xt in enumerate(noisy):
        if b:
            cache = model.model.encoder(input_ids=canvases[b - 1], cache=cache).cache
        K, C = xt.shape[1], xt.shape[2]
        rep = _repeated(cache, K)  # row g's cache repeated K times in a row: the order of xt's [G, K] rows
        flat = xt.reshape(G * K, C)
        sc = None
        if self_conditioning == "detached":
            with torch.no_grad():
                sc = model(cache=rep, decoder_input_ids=flat).logits.detach()
        logits = model(cache=rep, decoder_input_ids=flat, self_conditioning_logits=sc).logits
        out.append(logits.view(G, K, C, logits.shape[-1]))
    return [o[0] for o in out] if single else out


# --------------------------------------------------------------------------- LoRA on tied stacks
def lora_modules(model, names: list[str]) -> list[str]:
    """The decoder's module names whose last part is in ``names`` (the recipe's ``target_modules``): the
    adapters go on the decoder; :func:`share_adapters` gives the encoder the same ones."""
    found = [n for n, _ in model.named_modules() if ".decoder.layers." in n and n.rsplit(".", 1)[-1] in names]
    if not found:
        raise UserError(f"train.lora.target_modules: none of {names} names a DiffusionGemma decoder module",
                        hint="e.g. q_proj, k_proj, v_proj, o_proj (sliding layers only have v_proj)")
    return found


def share_adapters(model) -> int:
    """Point every encoder module whose decoder twin carries a LoRA adapter at that adapted module (the
    weights are tied, so the encoder then computes with the same base weight and the same adapter); returns
    how many were shared."""
    mods = dict(model.named_modules())
    shared = 0
    for name, mod in list(mods.items()):
        if ".decoder.layers." not in name or not hasattr(mod, "lora_A"):
            continue
        twin = name.replace(".decoder.layers.", ".encoder.language_model.layers.")
        parent, attr = twin.rsplit(".", 1)
        if parent in mods and getattr(mods[parent], attr, None) is not None:
            setattr(mods[parent], attr, mod)
            shared += 1
    return shared


# --------------------------------------------------------------------------- FSDP2 units
def fsdp_units(model) -> list[list[torch.nn.Module]]:
    """Encoder layer i with decoder layer i, one FSDP2 group each: the two share every weight, so one unit
    must hold both (a parameter in two units is refused by FSDP2, and would be gathered twice)."""
    mods = dict(model.named_modules())
    pairs = []
    for name, mod in mods.items():
        if name.endswith(".decoder.layers") and isinstance(mod, torch.nn.ModuleList):
            twins = mods.get(name[: -len(".decoder.layers")] + ".encoder.language_model.layers")
            if twins is None or len(twins) != len(mod):
                raise RunFailure(f"FSDP2: {name} has no encoder twin of {len(mod)} layers to shard it with")
            pairs = [[twins[i], mod[i]] for i in range(len(mod))]
    if not pairs:
        raise RunFailure("FSDP2: no DiffusionGemma decoder layers found to shard")
    return pairs


def tied_copy(key: str) -> bool:
    """An encoder text weight: the decoder's, tied (``_tied_weights_keys``); the published checkpoint holds only
    the decoder's, plus each encoder layer's own ``layer_scalar`` buffer."""
    return key.startswith("model.encoder.language_model.") and not key.endswith("layer_scalar")


def write_generation_config(folder: Path, config, tokenizer, source: Optional[Path]) -> None:
    """``generation_config.json`` of an exported model: the source checkpoint's, with every sampler setting it leaves
    unset filled from the published one (:data:`PUBLISHED_GENERATION`; the stop and pad ids from this tokenizer).
    transformers' ``save_pretrained`` writes those settings as null (its ``generate`` fills its defaults at call
    time), but vLLM's DiffusionGemma sampler reads them from the file: ``sampler_config`` (an EntropyBound one, by
    class name), ``t_min``, ``t_max``, ``stability_threshold``, ``confidence_threshold``, ``max_denoising_steps``."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (DiffusionGemmaGenerationConfig,
                                                                                EntropyBoundSamplerConfig)

    gen = None if source is None else Path(source) / "generation_config.json"
    # The file is data: read as JSON here, so nothing in the source folder is a loading hook.
    cfg = (DiffusionGemmaGenerationConfig.from_dict(json.loads(gen.read_text(encoding="utf-8")))
           if gen is not None and gen.is_file() else DiffusionGemmaGenerationConfig())
    pub = PUBLISHED_GENERATION
    # the published stop ids in the published order: <eos> 1, <turn|> 106, <|tool_response> 50
    stops = [i for i in (tokenizer.convert_tokens_to_ids(t) for t in (EOS, TURN_CLOSE, TOOL_RESPONSE))
             if isinstance(i, int) and i != tokenizer.unk_token_id]
    fill = {"max_new_tokens": pub["max_new_tokens"], "max_denoising_steps": pub["max_denoising_steps"],
            "sampler_config": EntropyBoundSamplerConfig(entropy_bound=pub["entropy_bound"]), "t_min": pub["t_min"],
            "t_max": pub["t_max"], "stability_threshold": pub["stability_threshold"],
            "confidence_threshold": pub["confidence_threshold"], "eos_token_id": stops,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else pub["pad_token_id"]}
    for key, value in fill.items():
        if getattr(cfg, key, None) is None:
            setattr(cfg, key, value)
    cfg.save_pretrained(str(folder))


def decoder_layer_class(model) -> Optional[type]:
    for mod in model.modules():
        if type(mod).__name__ == "DiffusionGemmaDecoderTextLayer":
            return type(mod)
    return None


DIFFUSION_GEMMA = Family(
    name="diffusion_gemma",
    reads_by_name=False,  # its own loader reads the checkpoint whole
    model_types=("diffusion_gemma",),
    architectures=("DiffusionGemmaForBlockDiffusion",),
    mask_token_id=4,
    # <turn|> ends a turn, <eos> the text, <|tool_response> a tool call: the published generation config's stops
    stop_tokens=(TURN_CLOSE, EOS, TOOL_RESPONSE),
    sampler="diffusion_gemma",
    load_native=load_native,
    fix_tokenizer=fix_tokenizer,
    decoding={"gen_length": 256, "steps": 48},
    likelihood="uniform",
    tiny_tokenizer=build_tokenizer,
    build_tiny=build_model,
    score_canvases=canvas_logits,
    lora_modules=lora_modules,
    after_lora=share_adapters,
    export_skips=tied_copy,
    export_extras=write_generation_config,
    fsdp1_refusal=("encoder layer i and decoder layer i share every weight but are separate modules, and FSDP1 "
                   "wraps one module per unit, so one parameter would be sharded in two units; use FSDP2 "
                   "(fsdp_version: 2), which shards each pair as one unit"),
    fsdp_units=fsdp_units,
    fsdp_checkpointing_refusal=("a decoder layer's forward appends its canvas keys and values to the context's "
                                "cache, so the backward's recompute attends to them twice (shapes that do not match)"),
    tied_text_stack=True,
)
