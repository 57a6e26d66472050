"""The client backend (``generate.backend: openai``): prompts sent to an OpenAI-compatible server, one request
per prompt, ``concurrency`` at a time, through the judge's guarded transport (:class:`dllm_align.judge.client.ChatClient`:
the openai SDK over httpx2, only ``base_url`` contacted, bounded waits, retries with back-off, the key never in a
message).

A prompt goes as its token ids (so the server decodes exactly the ids ``generate`` encoded) with its own seed
(:func:`row_seed` of ``generate.seed`` and the prompt id, as the in-process backend seeds it) and the settings
the engine takes per request (:mod:`dllm_align.serve.engines`); settings an engine fixes at launch must equal
the server's (``generate.openai.fixed``) and settings it cannot honour are refused by name before anything is
written. Against ``dllm-align serve`` every key goes with the request, and the server checks them
(``/v1/settings``) and returns each completion's whole generated span, so a completion is the in-process one.

Resumable: ``on_batch`` is called as each prompt's answer arrives, so ``generate`` (which resumes by prompt id)
keeps every finished prompt of a killed run and asks only the rest again.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dllm_align.config import components as registry
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.generate.components import engine_family_problem
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats, model_fingerprint, row_seed
from dllm_align.judge.client import Cancelled, ChatClient, FatalApiError, JudgementFailed, run_pool
from dllm_align.models.families import family_for_config
from dllm_align.models.load import load_tokenizer, model_source, resolve_model_path
from dllm_align.serve import engines


def client_tokenizer(model, name_or_path: Optional[str] = None):
    """The tokenizer ``generate`` encodes prompts with for the recipe's model (no weights loaded)."""
    name = name_or_path or model.name_or_path
    path = resolve_model_path(name, model.revision)
    family = None
    cfg = Path(path) / "config.json" if not str(path).startswith("builtin:") else None
    if cfg is not None and cfg.is_file():
        try:
            family = family_for_config(json.loads(cfg.read_text(encoding="utf-8")))
        except Exception:  # noqa: BLE001 - no family: the tokenizer as transformers reads it
            family = None
    return load_tokenizer(model.tokenizer or path, model.trust_remote_code, family)


def decoding_keys(settings: SamplerSettings) -> dict:
    """The section's keys and its decoding rules' own settings (``generate.llada21``, ...); a backend's settings
    (this one's address, say) are left out."""
    dumped = settings.model_dump(mode="json")
    return {k: v for k, v in dumped.items() if k in SamplerSettings.model_fields or registry.find("backend", k) is None}


def api_key(env: str) -> Optional[str]:
    if not env:
        return None
    key = (os.environ.get(env) or "").strip()
    if not key:
        raise UserError(f"generate.openai.api_key_env: the environment variable {env} holding the server's API key is not set",
                        hint=f"export {env}=...; or generate.openai.api_key_env: '' for a server without a key")
    return key


# A reply's parts, read as what they must be: a server answering otherwise (token ids as text, a count as a
# string) fails that prompt naming the part, instead of writing a completion no sampler could have made.
def token_ids(reply: dict, key: str) -> list[int]:
    v = reply.get(key)
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ValueError(f"the reply's {key} is not a list of token ids (got {json.dumps(v)[:40]})")
    return list(v)


def reply_text(choice) -> str:
    if not isinstance(choice.text, str):
        raise ValueError(f"the reply's text is not a string (got {json.dumps(choice.text)[:40]})")
    return choice.text


def reply_flag(reply: dict, key: str) -> bool:
    if not isinstance(reply.get(key), bool):
        raise ValueError(f"the reply's {key} is not true or false (got {json.dumps(reply.get(key))[:40]})")
    return reply[key]


def reply_count(reply: dict, key: str) -> int:
    v = reply.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"the reply's {key} is not a count (got {json.dumps(v)[:40]})")
    return v


class OpenAIGenerator:
    """A :class:`dllm_align.generate.backend.Generator` over an OpenAI-compatible server."""

    name = "openai"

    def __init__(self, own, tokenizer, client: ChatClient, root: str) -> None:
        self.own = own
        self.root = root
        self.facts = engines.ENGINES[own.engine]
        self._tokenizer = tokenizer
        self.client = client
        self.stats_lock = threading.Lock()
        self._info: Optional[dict] = None
        self.model = own.model or self._listed_model()

    # -- asking the server
    def _get(self, path: str) -> Any:
        """GET ``path`` under the server's root (``base_url`` minus /v1 for the engines' own routes)."""
        return self.client.call(lambda sdk: sdk.get(path, cast_to=object), f"GET {path}")

    def _post(self, path: str, body: dict) -> Any:
        return self.client.call(lambda sdk: sdk.post(path, body=body, cast_to=object), f"POST {path}", retry=False)

    def _ask(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except FatalApiError as e:
            raise UserError(f"generate.openai.base_url: {e}") from None
        except JudgementFailed as e:
            raise UserError(f"generate.openai.base_url {self.client.base_url}: {e}") from None

    def _listed_model(self) -> str:
        listed = self._ask(lambda: self._get("/models"))
        data = listed.get("data") if isinstance(listed, dict) else None
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise UserError(f"generate.openai.base_url {self.client.base_url}: /models lists no model")
        return data[0]["id"]

    def info(self) -> dict:
        """The server's own report of what it serves (dllm-align serve's /v1/serving; {} for other engines)."""
        if self.facts.name != "dllm_align":
            return {}
        if self._info is None:
            self._info = self._ask(lambda: self._get("/serving"))
        return self._info

    # -- the Generator interface
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_positions(self) -> Optional[int]:
        n = self.info().get("max_positions")
        return n if isinstance(n, int) else None

    def settings_for(self, settings: SamplerSettings) -> SamplerSettings:
        settings = SamplerSettings.from_section(settings)
        if self.facts.name == "dllm_align":
            keys = {k: v for k, v in decoding_keys(settings).items() if k not in engines.NOT_MAPPED or k == "sampler"}
            try:
                got = self._post("/settings", keys)
            except JudgementFailed as e:  # the server's 400 names the key
                raise UserError(f"generate: the server at {self.client.base_url} refuses these settings: {e}") from None
            except FatalApiError as e:
                raise UserError(f"generate.openai.base_url: {e}") from None
            answered = got.get("settings") if isinstance(got, dict) else None
            if not isinstance(answered, dict) or not isinstance(answered.get("sampler"), str):
                raise RunFailure(f"generate.openai.base_url {self.client.base_url}: POST /settings answered no settings "
                                 f"(got {json.dumps(got)[:80]}); is it dllm-align serve (generate.openai.engine)?")
            return settings.replace(sampler=answered["sampler"])
        engines.check(self.facts.name, settings, dict(self.own.fixed), self.own.accept_unseeded)
        return settings

    def serving(self) -> Optional[dict]:
        """The folder and weights fingerprint the server reports (dllm-align serve), SGLang's model path and
        weight version; None where the engine cannot tell."""
        name = self.facts.name
        if name == "dllm_align":
            self._info = None
            info = self.info()
            return {"folder": info.get("folder"), "fingerprint": info.get("fingerprint")}
        if name == "sglang":
            got = self._ask(lambda: self._root_get("/get_model_info"))
            return {"folder": got.get("model_path"), "fingerprint": got.get("weight_version")}
        return None

    def _root_get(self, path: str) -> Any:
        return self.client.call(lambda sdk: sdk.get(self.root + path, cast_to=object), f"GET {path}")

    def reload(self, folder: str, fingerprint: Optional[str]) -> dict:
        """Tell the server to serve ``folder`` (``online``'s hand-off of each round's final/) and check that it
        reports ``fingerprint`` before a prompt is sampled."""
        name = self.facts.name
        if self.facts.reload is None:
            raise UserError(f"generate.openai.engine: {name} has no endpoint that loads a checkpoint folder")
        if name == "dllm_align":
            self._ask(lambda: self._post("/load", {"folder": str(folder)}))
        else:  # SGLang labels the weights with the version we give; it has no content hash of its own
            self._ask(lambda: self.client.call(lambda sdk: sdk.post(self.root + self.facts.reload, body={
                "model_path": str(folder), "weight_version": fingerprint}, cast_to=object), "weights update", retry=False))
        got = self.serving() or {}
        if fingerprint is not None and got.get("fingerprint") != fingerprint:
            raise RunFailure(f"the server at {self.client.base_url} was told to serve {folder} but reports weights "
                             f"{got.get('fingerprint')!r}, not {fingerprint!r}")
        return got

    # -- generating
    def request(self, ids: Sequence[int], settings: SamplerSettings, seed: int) -> dict:
        """The /v1/completions arguments for one prompt (``extra_body``: the fields outside the OpenAI API)."""
        args: dict[str, Any] = {"model": self.model, "prompt": [int(t) for t in ids], "max_tokens": settings.gen_length,
                                "seed": int(seed)}
        extra: dict[str, Any] = {"return_token_ids": True}
        if "*" in self.facts.request:
            for k, v in decoding_keys(settings).items():
                if k not in engines.NOT_MAPPED and k != "gen_length":
                    extra[k] = v
            extra["sampler"] = settings.sampler
            args["temperature"] = extra.pop("temperature")
        else:
            for k, field in self.facts.request.items():
                v = getattr(settings, k)
                if k != "gen_length" and v is not None:
                    (args if field in ("temperature", "top_p") else extra)[field] = v
            if not self.facts.seeds:
                args.pop("seed")
        args["extra_body"] = extra
        return args

    def _one(self, ids: Sequence[int], settings: SamplerSettings, seed: int) -> Completion:
        args = self.request(ids, settings, seed)

        def call(sdk):
            r = sdk.completions.create(**args)
            choice = r.choices[0]
            extra = choice.model_extra or {}
            own = extra.get("dllm_align")
            if isinstance(own, dict):
                return Completion(ids=token_ids(own, "token_ids"), text=reply_text(choice), raw=token_ids(own, "raw"),
                                  stopped=reply_flag(own, "stopped"), forwards=reply_count(own, "forwards"))
            toks = token_ids(extra, "token_ids")
            return Completion(ids=toks, text=reply_text(choice), raw=toks, stopped=choice.finish_reason == "stop", forwards=0)

        return self.client.call(call, f"completions for model {self.model!r}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        settings: SamplerSettings,
        seeds: Optional[Sequence[int]] = None,
        *,
        batch_size: int = 8,
        stop_early: bool = True,
        stats: Optional[SamplerStats] = None,
        on_batch: Optional[Callable[[list[int], list[Completion]], None]] = None,
    ) -> list[Completion]:
        """Each prompt is one request (``batch_size`` is the server's business: it batches what arrives
        together); answers are handed to ``on_batch`` as they arrive, in whatever order they finish."""
        if seeds is None:
            seeds = [row_seed(settings.seed, i) for i in range(len(prompts))]
        out: list[Optional[Completion]] = [None] * len(prompts)
        failed: list[str] = []
        for i, got in run_pool(list(range(len(prompts))), lambda i: self._one(prompts[i], settings, seeds[i]),
                               self.own.concurrency, self.client.stop):
            if isinstance(got, BaseException):
                if isinstance(got, (FatalApiError, Cancelled)):
                    self.client.abort()
                    raise RunFailure(f"generate through {self.client.base_url}: {got}") from None
                failed.append(f"prompt {i}: {got}")
                continue
            out[i] = got
            if stats is not None:
                with self.stats_lock:
                    stats.add(SamplerStats(forwards=got.forwards, decoded=len(got.ids), prompts=1))
            if on_batch is not None:
                on_batch([i], [got])
        if failed or any(c is None for c in out):
            raise RunFailure(f"generate through {self.client.base_url}: {len(failed) or 'some'} prompt(s) got no answer "
                             f"({failed[0] if failed else 'stopped'}); finished ones are kept: run again to ask the rest")
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.client.close()


def make_openai_generator(generate, settings, *, model=None, device=None, name_or_path: Optional[str] = None,
                          predictor=None) -> OpenAIGenerator:
    """The factory ``generate.backend: openai`` names: the tokenizer of the recipe's model on this side, the
    server at ``generate.openai.base_url`` for the rest (``device`` and ``predictor`` have no use here)."""
    name = name_or_path or (model.name_or_path if model is not None else None)
    if name is not None and (name.startswith("builtin:") or Path(name).expanduser().is_dir()):
        family = model_source(name, model.revision if model is not None else None).family
        problem = engine_family_problem(settings, family.name) if family is not None else None
        if problem is not None:
            raise UserError(problem, hint="docs/serving.md lists the families each engine serves")
    tok = predictor.tokenizer if predictor is not None else client_tokenizer(model, name_or_path)
    base = settings.base_url.rstrip("/")
    # the guard admits the server's root (the engines' own routes, e.g. SGLang's /get_model_info, sit beside /v1);
    # the SDK's relative paths still go under base_url
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    client = ChatClient(root, api_key(settings.api_key_env), api_key_env=settings.api_key_env or "(none)",
                        timeout=settings.timeout, max_retries=settings.max_retries, concurrency=settings.concurrency,
                        retry_base_delay=0.5, retry_max_delay=10.0)
    client.sdk = client.sdk.with_options(base_url=base + "/")
    client.base_url = base
    gen = OpenAIGenerator(settings, tok, client, root)
    if name_or_path is not None and gen.facts.reload is not None:
        # a caller naming a checkpoint (online: each round's final/) gets it served, proven by its fingerprint
        fp = model_fingerprint(str(name_or_path))
        now = gen.serving() or {}
        if now.get("folder") != str(name_or_path) or now.get("fingerprint") != fp:
            gen.reload(str(name_or_path), fp)
    return gen


__all__ = ["OpenAIGenerator", "api_key", "client_tokenizer", "make_openai_generator"]
