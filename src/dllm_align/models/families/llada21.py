"""LLaDA2.1 (inclusionAI: LLaDA2.1-mini 16B, LLaDA2.1-flash 100B): LLaDA2.0's body, decoded with token editing.

What the published files say (docs/llada21.md has the sources):

* **The body is LLaDA2.0's.** The published modeling code of LLaDA2.1 differs from LLaDA2.0's only in how it turns a
  2D or missing attention mask into a 4D one (dllm-align's body reads those its own way and every caller passes a 4D
  mask), in ``num_key_value_heads: 0`` meaning "as many as the query heads" (the 2.0 class keeps 0, which it cannot
  run), and in ``generate``. So the checkpoint loads into ``llada2_body.Llada2MoeModelLM`` with the published weight
  names, through LLaDA2.0's config reading (``block.llada2_config``), tagged ``llada21``.
* **The decoder edits** (``generate.llada21``): mask-to-token above one threshold, token-to-token replacement above a
  second, a bounded number of editing rounds once a block is mask-free.
* **The hub's config.json is LLaDA2.0's**: ``model_type: llada2_moe``, ``architectures: [LLaDA2MoeModelLM]``, the
  same ``auto_map`` file names. Only the dllm library's renamed copy says ``model_type: llada21_moe``. How a folder
  is told to be LLaDA2.1 (:func:`ships_editing_code`, strongest first):

  1. ``dllm_align_family: llada21`` in config.json (dllm-align writes it into every folder it saves; a user may add it);
  2. ``model_type: llada21_moe`` (dllm's copy);
  3. the shipped remote code: the modeling file ``auto_map`` names, beside config.json, read as text (never
     imported), defines the editing threshold of LLaDA2.1's ``generate`` (``editing_threshold``), which LLaDA2.0's
     file has no trace of.

  Anything else with ``model_type: llada2_moe`` is LLaDA2.0, as before (a hub LLaDA2.1 download without its
  ``modeling_llada2_moe.py`` included: add ``"dllm_align_family": "llada21"`` to its config.json).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dllm_align.models.families.base import Family, load_mapped
from dllm_align.models.families.block import LLADA2, build_llada2_model, llada2_config

# lazy imports: dllm_align.models.families.llada2_body: it subclasses transformers' classes, and the family records are
# read (which family claims a config, the memory estimate) without building anything.

# What LLaDA2.1's published modeling file has and LLaDA2.0's has not: the token-to-token threshold of its generate.
EDITING_MARK = "editing_threshold"
# The published modeling file's size is ~60 kB; a file far bigger than any modeling file is not read whole.
_MAX_CODE_BYTES = 4 << 20


def llada21_config(cfg: dict):
    """A LLaDA2.1 ``config.json`` as the native body's config: LLaDA2.0's reading, plus the 2.1 configuration class's
    one difference (``num_key_value_heads`` 0 means one key/value head per query head)."""
    cfg = dict(cfg)
    if cfg.get("num_key_value_heads") == 0:
        cfg["num_key_value_heads"] = cfg.get("num_attention_heads")
    return llada2_config(cfg, family="llada21", label="LLaDA2.1")


def load_llada21_native(folder: Path, cfg: dict, dtype: torch.dtype):
    """A LLaDA2.1 checkpoint in the native body: the published weight names, no renaming."""
    from dllm_align.models.families.llada2_body import Llada2MoeModelLM

    return load_mapped(folder, Llada2MoeModelLM, llada21_config(cfg), dtype, lambda key: key, "LLaDA2.1")


def build_tiny_llada21(tokenizer, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                       max_position_embeddings: int, seed: int):
    """The built-in LLaDA2.1 models: LLaDA2.0's tiny layout (blocks of 8, so that short rows span several blocks)."""
    return build_llada2_model(tokenizer, hidden_size, layers, heads, intermediate_size, max_position_embeddings, seed,
                              block_size=8, translate=llada21_config)


def ships_editing_code(folder: Path, cfg: dict) -> bool:
    """Whether the modeling file ``cfg``'s ``auto_map`` names, in ``folder``, is LLaDA2.1's (it defines the editing
    threshold). Read as text; a folder without it (a hub download of the weights alone) says nothing."""
    auto_map = cfg.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        return False
    modules = set()
    for key in ("AutoModelForCausalLM", "AutoModel"):
        ref = auto_map.get(key)
        if isinstance(ref, str) and "." in ref:
            modules.add(ref.rsplit(".", 1)[0].split("--")[-1])
    for module in sorted(modules):
        path = Path(folder) / f"{module}.py"
        try:
            if path.is_file() and path.stat().st_size <= _MAX_CODE_BYTES and EDITING_MARK in path.read_text(
                    encoding="utf-8", errors="replace"):
                return True
        except OSError:
            continue
    return False


LLADA21 = Family(
    name="llada21",
    # dllm's renamed copy first (the family's own name for itself); the hub's type is LLaDA2.0's, which a config
    # goes to only with the evidence above (families/__init__.py: a shared model_type is settled by
    # dllm_align_family, which ships_editing_code sets for the folder's reading)
    model_types=("llada21_moe", "llada2_moe"),
    mask_token_id=156895,
    stop_tokens=LLADA2.stop_tokens,
    load_native=load_llada21_native,
    sampler="llada21",
    likelihood="block",
    # The bound for the masked-plus-replaced corruption it is trained with, as an option
    # (docs/design.md#a-bound-for-masked-and-replaced-tokens); its published RL scores blocks as the block ELBO does.
    likelihood_options=("hybrid",),
    # The model card's recommended settings: blocks of 32, greedy, threshold 0.7 (quality mode; the decoder's own
    # settings carry the edit threshold and the post-edit rounds). steps is unused by the published generate.
    decoding={"gen_length": 512, "block_length": 32, "steps": 512, "temperature": 0.0},
    block_size=32,
    tiny_tokenizer=LLADA2.tiny_tokenizer,
    build_tiny=build_tiny_llada21,
    # The hub's layout is LLaDA2.0's: the same model_type, class and remote-code file names.
    published=LLADA2.published,
    # A folder exported with no published code beside it keeps dllm_align_family (the published code ignores the
    # extra key), so that it reads back as LLaDA2.1 and not as LLaDA2.0.
    published_fields=lambda trained: {k: v for k, v in trained.items() if k != "is_causal"},
    folder_claim=ships_editing_code,
    qk_norm=LLADA2.qk_norm,
)

__all__ = ["LLADA21", "build_tiny_llada21", "llada21_config", "load_llada21_native",
           "ships_editing_code"]
