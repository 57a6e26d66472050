"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.

Model families: the target is the family's :class:`dllm_align.models.families.base.Family` record. A family's
built-in tiny models (``builtin:*``, random weights built from code by its ``build_tiny``) are its declaration's
``builtin_models`` trait: name -> the shape ``models.load.TinySpec`` takes (hidden_size, layers, heads,
intermediate_size, ...), so ``models/load.py`` lists no model of its own.
"""

from __future__ import annotations

from dllm_align.config.components import Component, register

_SMALL = {"hidden_size": 128, "layers": 4, "heads": 4, "intermediate_size": 256}

register(Component("family", "llada", "dllm_align.models.families.llada:LLADA", summary="LLaDA-8B", traits={
    "builtin_models": {
        "builtin:tiny": {},  # 2 x 64: tests; a training step takes milliseconds
        "builtin:small": _SMALL,  # the toy demo's base
    }}))
register(Component("family", "dream", "dllm_align.models.families.dream:DREAM", summary="Dream-7B", traits={
    "builtin_models": {"builtin:tiny-dream": {}, "builtin:small-dream": _SMALL}}))  # Dream's layout and manners
register(Component("family", "llada_moe", "dllm_align.models.families.llada_moe:LLADA_MOE", summary="LLaDA-MoE"))
register(Component("family", "sdar", "dllm_align.models.families.block:SDAR", summary="SDAR (block diffusion)", traits={
    # block diffusion (SDAR's Qwen3 layout, block 4)
    "builtin_models": {"builtin:tiny-sdar": {}, "builtin:small-sdar": _SMALL}}))
register(Component("family", "llada2", "dllm_align.models.families.block:LLADA2", summary="LLaDA2.0 (block diffusion)",
                   traits={
    # LLaDA2.0's MoE layout (first layer dense, then 4 experts + a shared one, grouped top-2) at the tiny size,
    # with blocks of 8 (families/block.py's build_tiny_llada2)
    "builtin_models": {"builtin:tiny-llada2": {}}}))
register(Component("family", "llada21", "dllm_align.models.families.llada21:LLADA21",
                   summary="LLaDA2.1 (block diffusion, decoded with token editing)", traits={
    # LLaDA2.0's tiny layout under LLaDA2.1's family (its decoder, its published identity)
    "builtin_models": {"builtin:tiny-llada21": {}}}))
register(Component("family", "diffusion_gemma", "dllm_align.models.families.diffusion_gemma:DIFFUSION_GEMMA",
                   summary="DiffusionGemma (uniform noise over canvases)", traits={
    "builtin_models": {
        # the published config shrunk (6 layers in its 5:1 sliding/full pattern, 4 experts top-2, canvas 8;
        # families/diffusion_gemma.py's tiny_config)
        "builtin:tiny-diffusiongemma": {"layers": 6, "intermediate_size": 96},
        # the same layout a little wider: the DiffusionGemma demo's base (recipe toy_sort_base_gemma)
        "builtin:small-diffusiongemma": {"hidden_size": 96, "layers": 6, "heads": 4, "intermediate_size": 96},
    }}))
