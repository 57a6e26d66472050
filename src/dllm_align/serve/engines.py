"""What each OpenAI-compatible engine takes per request, fixes when it starts, and cannot honour: the facts the
client backend (:mod:`dllm_align.serve.client`) maps a recipe's ``generate`` section onto, and refuses by.

Where each fact comes from (the engines' source, read at pinned commits; docs/serving.md lists them): no engine
takes a dLLM's block length, steps or thresholds per request (SGLang: ``--dllm-algorithm-config``; LMDeploy:
``--dllm-*`` flags of ``lmdeploy serve api_server``; vLLM: the server's diffusion config and the checkpoint's
generation config); SGLang's released dLLM decoders take the argmax whatever the temperature and use no seed;
vLLM's DiffusionGemma sampler draws from the global generator (a request's seed does not reproduce it) and anneals
its own temperature; LMDeploy passes a request's seed to its sampler. SGLang loads a folder's weights through
``/update_weights_from_disk``; LMDeploy and vLLM have no endpoint that loads a folder outside development modes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dllm_align.config.schema import GenerateSection
from dllm_align.core.errors import UserError
from dllm_align.generate.components import ENGINE_FAMILIES

# the generate keys that organise a run or are sent as a request's seed, never mapped onto an engine's knobs
NOT_MAPPED = frozenset({"backend", "batch_size", "split", "limit", "seed", "sampler"})


@dataclass(frozen=True)
class EngineFacts:
    name: str
    # generate key -> the request field that carries it ("*": every key, as top-level fields)
    request: dict[str, str]
    # generate key -> how the server is told at launch (the recipe's value must equal the server's)
    launch: dict[str, str] = field(default_factory=dict)
    seeds: bool = True          # a request's seed reproduces its sample
    greedy_only: bool = False   # the temperature is ignored (argmax)
    reload: Optional[str] = None  # the endpoint that loads a checkpoint folder into the running server
    families: tuple[str, ...] = ()  # the model families it serves
    token_ids: bool = True      # /v1/completions takes a token-id prompt and returns the completion's ids


ENGINES: dict[str, EngineFacts] = {e.name: e for e in (
    EngineFacts("dllm_align", {"*": "*"}, seeds=True, reload="/v1/load",
                families=ENGINE_FAMILIES["dllm_align"]),
    EngineFacts("sglang", {"gen_length": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"},
                launch={"block_length": "--dllm-algorithm-config (block_size)",
                        "threshold": "--dllm-algorithm-config (threshold)"},
                seeds=False, greedy_only=True, reload="/update_weights_from_disk", families=ENGINE_FAMILIES["sglang"]),
    EngineFacts("lmdeploy", {"gen_length": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"},
                launch={"block_length": "--dllm-block-length", "steps": "--dllm-denoising-steps",
                        "threshold": "--dllm-confidence-threshold"},
                seeds=True, families=ENGINE_FAMILIES["lmdeploy"], token_ids=False),
    EngineFacts("vllm", {"gen_length": "max_tokens", "top_p": "top_p", "top_k": "top_k"},
                launch={"steps": "the server's diffusion config (max_denoising_steps)"},
                seeds=False, families=ENGINE_FAMILIES["vllm"]),
)}

_DEFAULTS = {k: f.default for k, f in GenerateSection.model_fields.items()}


def stochastic(settings) -> bool:
    """Whether a prompt's tokens depend on its seed under ``settings`` (DiffusionGemma's rule always draws)."""
    return settings.temperature > 0 or settings.sampler == "diffusion_gemma" or settings.remasking == "random" \
        or settings.alg == "origin" and settings.sampler == "dream"


def refusals(engine: str, settings, fixed: dict[str, Any], accept_unseeded: bool = False) -> list[str]:
    """Every setting of ``settings`` that ``engine`` cannot honour, one line each naming the key and why (empty:
    it can). ``fixed``: the server's launch-time values the user declared (``generate.openai.fixed``)."""
    facts = ENGINES[engine]
    if "*" in facts.request:
        return []
    out = []
    values = settings.model_dump()
    for key, value in ((k, values[k]) for k in type(settings).model_fields):
        if key in NOT_MAPPED:
            continue
        if key in facts.request:
            if key == "temperature" and facts.greedy_only and value > 0:
                out.append(f"temperature: {engine}'s dLLM decoders take the argmax and ignore the temperature "
                           f"({value:g} asked); every sample of a prompt would be the same")
            continue
        if key in facts.launch:
            if key not in fixed:
                out.append(f"{key}: {engine} fixes it when the server starts ({facts.launch[key]}); declare the "
                           f"server's value as generate.openai.fixed.{key} (the recipe's is {value!r})")
            elif fixed[key] != value:
                out.append(f"{key}: the server was started with {fixed[key]!r} ({facts.launch[key]}), the recipe asks "
                           f"for {value!r}")
            continue
        if value != _DEFAULTS[key]:
            out.append(f"{key}: {engine} has no such setting (the recipe asks for {value!r}; its default "
                       f"{_DEFAULTS[key]!r} is what an engine's own rule is taken to do)")
    if stochastic(settings) and not facts.seeds and not accept_unseeded:
        out.append(f"seed: {engine} does not reproduce a request's seed, so these samples are no function of "
                   "generate.seed (set generate.openai.accept_unseeded: true to take them anyway; it is recorded)")
    return out


def check(engine: str, settings, fixed: dict[str, Any], accept_unseeded: bool = False) -> None:
    problems = refusals(engine, settings, fixed, accept_unseeded)
    if problems:
        raise UserError(f"generate.backend: openai ({engine}) cannot decode these settings: " + "; ".join(problems),
                        hint="docs/serving.md lists what each engine takes per request and what it fixes at launch")


__all__ = ["ENGINES", "EngineFacts", "check", "refusals", "stochastic"]
