"""DiffusionGemma's published sampler, for families whose rule is "diffusion_gemma": transformers' own
``DiffusionGemmaForBlockDiffusion.generate``, called as it is (not rewritten).

What it does (transformers' code): canvas after canvas of ``canvas_length`` tokens, each started from uniform
random tokens and refined for at most ``max_denoising_steps`` decoder passes with self-conditioning, the
logits divided by a temperature annealed linearly from ``t_max`` to ``t_min``, the entropy-bound sampler
accepting the lowest-entropy positions and re-noising the rest; a canvas stops when its argmax is stable and
confident; the argmax canvas is appended; generation stops at an end-of-turn token or at the length.

The settings are the published ``generation_config.json`` (``families.diffusion_gemma.PUBLISHED_GENERATION``)
where it sets what transformers' defaults leave unset: the stop ids (the family's stop tokens by name: the
published ids 1, 106, 50 in the published tokenizer) and the pad id. The recipe gives ``gen_length``
(``max_new_tokens``) and ``steps`` (``max_denoising_steps``, an upper bound: the sampler stops a canvas early);
``temperature`` is not read (the sampler's own schedule, ``t_min`` .. ``t_max``, is the published one), and the
settings of the other rules are refused by the recipe schema.

Randomness: transformers' sampler draws from the global torch generator, so each prompt is decoded by its own
call under ``torch.random.fork_rng`` seeded with the prompt's seed: a row's tokens depend on its seed only, not
on its batch, and the caller's generator is left as it was.
"""

from __future__ import annotations

import time

import torch

from dllm_align.core.errors import UserError
from dllm_align.generate.canvas import completion
from dllm_align.generate.rules import DecodingRule
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats
from dllm_align.models.families.diffusion_gemma import PUBLISHED_GENERATION

# lazy imports: transformers: imported where the DiffusionGemma generation config is built: it takes longer to
# import than torch, and the generator factory (generate/backend.py) imports this module for every backend


def generation_config(mp, settings: SamplerSettings):
    """transformers' ``DiffusionGemmaGenerationConfig`` for ``settings``: the published generation config, the
    stop ids of the model's own tokenizer, ``gen_length`` and ``steps`` from the recipe."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (DiffusionGemmaGenerationConfig,
                                                                                EntropyBoundSamplerConfig)

    pub = PUBLISHED_GENERATION
    pad = getattr(mp.tokenizer, "pad_token_id", None) if mp.tokenizer is not None else None
    return DiffusionGemmaGenerationConfig(
        max_new_tokens=settings.gen_length, max_denoising_steps=settings.steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=pub["entropy_bound"]),
        t_min=pub["t_min"], t_max=pub["t_max"], stability_threshold=pub["stability_threshold"],
        confidence_threshold=pub["confidence_threshold"],
        eos_token_id=list(mp.stop_token_ids) or None, pad_token_id=pub["pad_token_id"] if pad is None else pad,
    )


def generate_batch_gemma(mp, prompts, settings: SamplerSettings, seeds, stats, t0: float, stop_early: bool) -> list[Completion]:
    """One batch under DiffusionGemma's published sampler, one ``generate`` call per prompt with its seed."""
    dev = mp.device
    model = mp.model
    gc = generation_config(mp, settings)
    if not stop_early:
        gc.eos_token_id = None  # run every canvas (stop tokens still end the text)
    stops = torch.tensor(mp.stop_token_ids or [-1], device=dev)
    local = SamplerStats(prompts=len(prompts))
    calls = [0]
    hook = model.model.decoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out = []
    try:
        for prompt, seed in zip(prompts, seeds):
            calls[0] = 0
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.no_grad(), \
                    mp._autocast(dev.type):
                torch.manual_seed(int(seed))
                seq = model.generate(torch.tensor([list(prompt)], device=dev), generation_config=gc).sequences
            gen = seq[0, len(prompt): len(prompt) + settings.gen_length]
            local.forwards += calls[0]
            local.positions += calls[0] * int(model.config.canvas_length)
            out.append(completion(mp, gen, stops, calls[0], local))
    finally:
        hook.remove()
    local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(local)
    return out


def check_gemma_model(mp, settings: SamplerSettings) -> None:
    """The published sampler is DiffusionGemma's own ``generate``."""
    if not hasattr(mp.model, "config") or getattr(mp.model.config, "model_type", None) != "diffusion_gemma":
        raise UserError(f"generate.sampler: diffusion_gemma needs a DiffusionGemma model ({mp.family.name} is not one)")


RULE = DecodingRule("diffusion_gemma", generate_batch_gemma, check_gemma_model)
