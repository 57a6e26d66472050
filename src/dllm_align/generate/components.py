"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.
"""

from __future__ import annotations

from typing import Literal, Optional, Union
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from dllm_align.config.components import Component, ComponentSettings, register

# --------------------------------------------------------------------------- generation backends
# A backend's traits, read without loading it (dllm_align.generate.backend):
#   serves: how a new model reaches it: "load" (it loads the folder it is given), "reload" (a running server
#           is told to load new weights) or "fixed" (it serves one model and cannot change it);
#   reads:  the keys of the generate section that decide its tokens ("rule": every key the decoding rule
#           reads, as the in-process samplers do); only these are recorded beside its outputs;
#   loads_here: it loads the weights in this process, at model.dtype (recorded then, not otherwise).
register(Component(
    kind="backend", name="in_process", target="dllm_align.generate.in_process:InProcessGenerator.load",
    summary="the model loaded in this process, decoded by the samplers of dllm_align.generate",
    traits={"serves": "load", "reads": "rule", "loads_here": True},
))


# the generate keys an engine fixes when it starts (the launch facts of dllm_align.serve.engines, which the
# declarations cannot import: it reads the recipe schema; tests/test_reliability_round6.py holds the two equal)
FIXABLE = ("block_length", "steps", "threshold")


class OpenAIBackendSettings(ComponentSettings):
    """``generate.openai``: an OpenAI-compatible server to generate through (``dllm-align serve``, SGLang,
    vLLM, LMDeploy; docs/serving.md)."""

    base_url: str = Field("http://127.0.0.1:8000/v1", description="The server's OpenAI-compatible root (…/v1); the only host contacted.")
    model: Optional[str] = Field(None, min_length=1, description="The model name requests use (default: the one the server lists).")
    api_key_env: str = Field("", pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$",
                             description="Environment variable holding the server's API key ('' for a server without one); never logged.")
    engine: Literal["dllm_align", "sglang", "vllm", "lmdeploy"] = Field(
        "dllm_align", description="Which engine serves: decides which settings are sent per request, which must equal the "
        "server's launch settings (fixed) and which are refused.")
    concurrency: int = Field(8, ge=1, le=256, description="Requests in flight at once.")
    timeout: float = Field(600.0, gt=0, description="Seconds to wait for one completion before retrying.")
    max_retries: int = Field(3, ge=0, le=20, description="Retries of one request on 429, 5xx, timeouts and dropped connections.")
    fixed: dict[str, Union[int, float, str, None]] = Field(
        default_factory=dict, description="The server's launch-time decoding settings as generate keys (e.g. block_length, "
        "threshold): an engine that fixes a key at launch is used only when the recipe's value equals the server's.")
    accept_unseeded: bool = Field(False, description="Take samples from an engine that does not reproduce a request's seed "
                                  "(they are then no function of generate.seed).")

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        # the one address contacted: http(s) with a host; a user or password in it would reach logs and records
        # (the key goes in api_key_env), and a query or fragment would be cut off every path the client appends
        url = urlsplit(v)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{v[:80]!r} is not an http(s) address with a host (e.g. http://127.0.0.1:8000/v1)")
        if url.username is not None or url.password is not None:
            raise ValueError("a user or password in the address is not kept secret: give the key in api_key_env")
        if url.query or url.fragment:
            raise ValueError(f"{v[:80]!r}: an address without ?query or #fragment")
        return v

    @field_validator("fixed")
    @classmethod
    def _fixed(cls, v: dict) -> dict:
        unknown = sorted(k for k in v if k not in FIXABLE)
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a decoding setting a server fixes at launch (one of {', '.join(FIXABLE)})")
        return v


# The model families each engine serves (the engines' model support, read at the commits docs/serving.md pins;
# dllm_align.serve.engines keeps each engine's other facts). LLaDA2.1 is LLaDA2.0's architecture with another
# decoding rule: an engine serving LLaDA2.0 loads it.
ENGINE_FAMILIES: dict[str, tuple[str, ...]] = {
    "dllm_align": ("llada", "dream", "llada_moe", "sdar", "llada2", "llada21", "diffusion_gemma"),
    "sglang": ("llada2", "llada21", "sdar", "diffusion_gemma"),
    "lmdeploy": ("sdar",),
    "vllm": ("diffusion_gemma",),
}


def engine_family_problem(settings: Optional[OpenAIBackendSettings], family: str) -> Optional[str]:
    """Why ``generate.openai.engine`` cannot serve a ``family`` model (None: it can), asked where the model's
    family is known before anything is sent."""
    if settings is None or family in ENGINE_FAMILIES[settings.engine]:
        return None
    return (f"generate.openai.engine: {settings.engine} serves {', '.join(ENGINE_FAMILIES[settings.engine])} models, "
            f"not {family}")


def _openai_serves(settings: Optional[OpenAIBackendSettings]) -> Optional[str]:
    # a served engine reaches each round's folder only through a load-a-folder endpoint of its own
    if settings is None:
        return None
    return "reload" if settings.engine in ("dllm_align", "sglang") else "fixed"


register(Component(
    kind="backend", name="openai", target="dllm_align.serve.client:make_openai_generator",
    settings=OpenAIBackendSettings,
    summary="an OpenAI-compatible server (dllm-align serve, SGLang, vLLM, LMDeploy) asked per prompt",
    traits={"serves": _openai_serves, "reads": "rule", "loads_here": False, "family_problem": engine_family_problem,
            "records": ("model", "engine", "fixed", "accept_unseeded")},
))


# --------------------------------------------------------------------------- decoding rules
# A rule (``generate.sampler``) is a ``generate.rules.DecodingRule`` in its own module. Its ``ignores`` are the
# shared ``generate`` keys it never reads (refused when set away from their defaults); its ``check`` receives
# the ``generate`` section (the samplers' settings carry no recipe) and returns (key, message) problems. Both
# run when the recipe names the rule and again once ``sampler: auto`` is resolved to the model family's rule
# (``config.schema.rule_problems``). Its ``decodes`` trait names the likelihoods (noise processes) of the models it
# can decode: a model of another is refused by name before any prompt is decoded (``generate.rules.settings_for``).


def block_shapes(generate) -> list[tuple[str, str]]:
    """The semi-autoregressive blocks: gen_length in whole blocks, steps dealt evenly over them."""
    g, b, s = generate.gen_length, generate.block_length, generate.steps
    if g % b:
        return [("gen_length", f"{g} is not a multiple of block_length ({b}): the rule decodes whole blocks")]
    if s % (g // b):
        return [("steps", f"{s} is not a multiple of the number of blocks ({g // b}, gen_length / block_length)")]
    return []


register(Component(
    "rule", "llada", "dllm_align.generate.sampler:RULE", ignores=("top_p", "top_k"), check=block_shapes,
    traits={"decodes": ("masked",)},
    summary="LLaDA's semi-autoregressive block sampler (low-confidence or random remasking, cfg, fast mode)"))
register(Component(
    "rule", "dream", "dllm_align.generate.dream:RULE", ignores=("cache", "threshold", "cfg"),
    traits={"decodes": ("masked",)},
    summary="Dream's diffusion_generate over one canvas (alg, alg_temp, top_p, top_k, eps)"))
register(Component(
    "rule", "block", "dllm_align.generate.block:RULE", ignores=("cfg",), check=block_shapes,
    summary="block diffusion's rule (SDAR, LLaDA2): block by block with a cache of the finished blocks",
    traits={"fast_cache": "prefix", "decodes": ("block",)}))
register(Component(
    "rule", "diffusion_gemma", "dllm_align.generate.gemma:RULE",
    # temperature: the published sampler anneals its own (t_max 0.8 -> t_min 0.4) over canvases of random tokens,
    # so its tokens depend on the seed at any setting; 0 (the default) means that schedule, any other is refused
    ignores=("cache", "threshold", "cfg", "top_p", "top_k", "remasking", "alg", "alg_temp", "temperature"),
    traits={"decodes": ("uniform",)},
    summary="DiffusionGemma's published generate (reads gen_length and steps; its own temperature schedule)"))


class Llada21Settings(ComponentSettings):
    """LLaDA2.1's joint-threshold decoding (``generate.llada21.<key>``; the model card's modes, the published bound
    on post-edit rounds)."""

    mode: Literal["quality", "speed"] = Field(
        "quality", description="The model card's modes: quality (mask-to-token threshold 0.7, editing threshold 0.5) "
        "or speed (0.5, 0.0); threshold / edit_threshold set here override the mode's.")
    threshold: Optional[float] = Field(
        None, ge=0, le=1, description="Mask to token: unmask every masked position of the block whose confidence "
        "exceeds this (at least the most confident one per round); null: the mode's.")
    edit_threshold: Optional[float] = Field(
        None, ge=0, le=1, description="Token to token: replace a decoded (non-prompt) token of the block whose new "
        "draw differs and whose confidence exceeds this; null: the mode's.")
    max_post_steps: int = Field(
        16, ge=0, le=1024, description="Editing rounds once the block has no mask left (published default 16; the "
        "block also ends at the first round that edits nothing).")


register(Component(
    "rule", "llada21", "dllm_align.generate.llada21:RULE", settings=Llada21Settings,
    # its thresholds are its own (generate.llada21.*); the published generate never reads steps
    ignores=("cfg", "remasking", "threshold", "steps", "alg", "alg_temp", "eps"),
    summary="LLaDA2.1's published decoding: mask-to-token and token-to-token editing thresholds, block by block",
    traits={"fast_cache": "prefix", "decodes": ("block",)}))
