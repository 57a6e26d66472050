"""The client backend against a test server that reproduces SGLang's documented request and response shapes
(``/v1/completions`` with token ids and ``return_token_ids``, ``/get_model_info``, ``/update_weights_from_disk``):
only the knobs SGLang takes per request are sent (no seed, no steps, no block length), its token ids are read back,
and a named checkpoint is loaded through its weight-update endpoint and proven by the version it then reports."""

from __future__ import annotations

import threading

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from dllm_align.config.schema import GenerateSection, ModelSection
from dllm_align.core.errors import UserError
from dllm_align.generate.backend import make_generator
from dllm_align.generate.settings import SamplerSettings, model_fingerprint
from dllm_align.serve.api import Running

WAIT = 60


class FakeSGLang:
    """SGLang's OpenAI routes as its protocol.py shapes them, decoding by a rule of its own (the prompt's ids
    reversed, cut to max_tokens), and its weight-update routes (model_path, weight_version)."""

    def __init__(self, model_path: str) -> None:
        self.model_path, self.weight_version = model_path, None
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/update_weights_from_disk", self.update, methods=["POST"]),
        ])
        self.engine = self  # Running stops an engine; this one has nothing to stop

    def close(self) -> None:
        pass

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.model_path, "object": "model", "created": 0,
                                                          "owned_by": "sglang", "root": self.model_path}]})

    async def completions(self, request: Request):
        body = await request.json()
        with self.lock:
            self.bodies.append(body)
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] <= 0:
            return JSONResponse({"object": "error", "message": "max_tokens must be positive", "type": "Bad Request",
                                 "param": None, "code": 400}, status_code=400)
        ids = list(reversed(body["prompt"]))[: body["max_tokens"]]
        choice = {"index": 0, "text": " ".join(map(str, ids)), "logprobs": None, "finish_reason": "stop",
                  "matched_stop": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = body["prompt"]
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": self.model_path,
                             "choices": [choice], "usage": {"prompt_tokens": len(body["prompt"]),
                                                             "completion_tokens": len(ids), "total_tokens": 0}})

    async def model_info(self, request: Request):
        return JSONResponse({"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": self.weight_version})

    async def update(self, request: Request):
        body = await request.json()
        self.model_path, self.weight_version = body["model_path"], body.get("weight_version")
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})


@pytest.fixture
def sglang():
    fake = FakeSGLang("builtin:tiny-llada2")
    run = Running(fake, "127.0.0.1", 0, start_timeout=WAIT)
    yield fake, run.url
    run.stop(timeout=WAIT)


# SGLang's LowConfidence at launch: block 8 (the tiny LLaDA2's), threshold 0.95; greedy
LAUNCH = {"block_length": 8, "threshold": 0.95}
GREEDY = dict(gen_length=8, block_length=8, threshold=0.95)


def _section(url: str, **own) -> GenerateSection:
    return GenerateSection(**GREEDY, backend="openai",
                           openai={"base_url": url + "/v1", "engine": "sglang", "fixed": LAUNCH, **own})


def test_sglang_gets_only_its_per_request_knobs_and_its_token_ids_are_read(sglang):
    fake, url = sglang
    gen = make_generator(_section(url), ModelSection(name_or_path="builtin:tiny-llada2"))
    assert gen.model == "builtin:tiny-llada2"  # the one /v1/models lists
    st = gen.settings_for(SamplerSettings(**GREEDY))
    got = gen.generate([[5, 6, 7], [8, 9]], st, [1, 2])
    assert [c.ids for c in got] == [[7, 6, 5], [9, 8]] and got[0].text == "7 6 5" and got[0].stopped
    for body in fake.bodies:
        assert body["max_tokens"] == 8 and body["temperature"] == 0.0 and body["return_token_ids"] is True
        assert not {"seed", "steps", "block_length", "threshold", "sampler"} & set(body)  # fixed at launch or absent
    assert gen.serving() == {"folder": "builtin:tiny-llada2", "fingerprint": None}
    gen.close()


def test_sglang_refuses_what_it_cannot_honour_before_a_request(sglang):
    fake, url = sglang
    with pytest.raises(UserError, match="temperature: sglang's dLLM decoders take the argmax"):
        make_generator(GenerateSection(**{**_section(url).model_dump(), "temperature": 0.7}),
                       ModelSection(name_or_path="builtin:tiny-llada2"))
    with pytest.raises(UserError, match=r"threshold: the server was started with 0\.95"):
        make_generator(GenerateSection(**{**_section(url).model_dump(), "threshold": 0.9}),
                       ModelSection(name_or_path="builtin:tiny-llada2"))
    assert fake.bodies == []


def test_sglang_loads_a_named_checkpoint_and_reports_its_version(sglang, tmp_path):
    from dllm_align.core.io import write_checksums
    from dllm_align.models.load import BUILTIN_SPECS, save_tiny

    fake, url = sglang
    folder = save_tiny(tmp_path / "final", BUILTIN_SPECS["builtin:tiny-llada2"])  # a family SGLang serves
    write_checksums(folder)
    fp = model_fingerprint(str(folder))
    gen = make_generator(_section(url), ModelSection(name_or_path="builtin:tiny-llada2"), name_or_path=str(folder))
    assert fake.model_path == str(folder) and fake.weight_version == fp
    assert gen.serving() == {"folder": str(folder), "fingerprint": fp}
    gen.close()
