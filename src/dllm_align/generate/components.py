"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

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


class OpenAIBackendSettings(ComponentSettings):
    """``generate.openai``: an OpenAI-compatible server to generate through (``dllm-align serve``, SGLang,
    vLLM, LMDeploy; docs/serving.md)."""

    base_url: str = Field("http://127.0.0.1:8000/v1", description="The server's OpenAI-compatible root (…/v1); the only host contacted.")
    model: Optional[str] = Field(None, description="The model name requests use (default: the one the server lists).")
    api_key_env: str = Field("", description="Environment variable holding the server's API key ('' for a server without one); never logged.")
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


def _openai_serves(settings: Optional[OpenAIBackendSettings]) -> Optional[str]:
    # a served engine reaches each round's folder only through a load-a-folder endpoint of its own
    if settings is None:
        return None
    return "reload" if settings.engine in ("dllm_align", "sglang") else "fixed"


register(Component(
    kind="backend", name="openai", target="dllm_align.serve.client:make_openai_generator",
    settings=OpenAIBackendSettings,
    summary="an OpenAI-compatible server (dllm-align serve, SGLang, vLLM, LMDeploy) asked per prompt",
    traits={"serves": _openai_serves, "reads": "rule", "loads_here": False},
))
