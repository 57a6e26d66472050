"""The HTTP side of ``dllm-align serve``: an OpenAI-compatible ASGI app (Starlette) over an :class:`Engine`.

Routes: ``GET /health``; ``GET /v1/models``; ``POST /v1/completions`` (a prompt as text or token ids, or a list
of either); ``POST /v1/chat/completions`` (messages through the model's chat template, as ``generate`` encodes
them); ``GET /v1/serving`` (the folder, weights fingerprint, family and settings served); ``POST /v1/settings``
(a set of ``generate`` keys checked against the served model: what a request with them would decode under);
``POST /v1/load`` (``{"folder": ...}``: serve another checkpoint from the next batch on).

A request's decoding settings are the server's (the recipe's ``generate`` section) with what it names:
``max_tokens`` (``gen_length``), ``temperature``, ``top_p``, ``top_k``, ``seed`` and, as top-level fields (the
OpenAI SDK's ``extra_body``), any other key of the ``generate`` section that decides tokens (``steps``,
``block_length``, ``threshold``, ...). A request without a seed gets the server's seed hashed with its prompt, so
its result is a function of what it sent either way.

Manners: every refusal is an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status naming the field (unknown fields too); a body past ``max_body`` bytes is 413 and is not read further; a
full queue is 429; a request not answered within ``timeout`` seconds is 504 and its job is dropped if not
started; a client that goes away has its job dropped likewise. With an API key every route but ``/health``
needs ``Authorization: Bearer <key>`` (compared in constant time). The server writes no file.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import threading
import time
import uuid
from typing import Any, Optional

import uvicorn
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dllm_align import __version__
from dllm_align.config import components as registry
from dllm_align.core.errors import UserError
from dllm_align.generate.settings import Completion, SamplerSettings, encode_prompt
from dllm_align.judge.client import is_loopback
from dllm_align.serve.engine import MAX_SEED, Engine, QueueFull, Stopped, completion_record, default_seed, request_keys

MAX_PROMPTS = 64  # prompts in one request's list
MAX_STOPS = 8


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


# --------------------------------------------------------------------------- request checks
def _int(body: dict, key: str, lo: int, hi: int) -> Optional[int]:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key}: expected an integer (got {json.dumps(v)[:40]})", key)
    if not lo <= v <= hi:
        raise ApiError(400, f"{key}: {v} is out of range [{lo}, {hi}]", key)
    return v


def _number(body: dict, key: str) -> Optional[float]:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{key}: expected a finite number (got {json.dumps(v)[:40]})", key)
    return float(v)


# fields of the OpenAI requests this server accepts with their only honoured values (a request asking for
# anything else is refused by name rather than silently answered otherwise)
FIXED_FIELDS = {"n": (1,), "stream": (False,), "echo": (False,), "logprobs": (None, 0, False), "top_logprobs": (None, 0),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1),
                "logit_bias": (None, {})}
FREE_FIELDS = {"model", "user", "return_token_ids", "stop", "seed", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "top_k", "prompt", "messages"}


def check_fields(body: dict, prompt_key: str) -> None:
    known = FREE_FIELDS | set(FIXED_FIELDS) | set(request_keys())
    unknown = sorted(k for k in body if k not in known or k in ("prompt", "messages") and k != prompt_key)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                       unknown[0])
    for k, allowed in FIXED_FIELDS.items():
        if k in body and not any(body[k] == a and type(body[k]) is type(a) or (a is None and body[k] is None) for a in allowed):
            raise ApiError(400, f"{k}: {json.dumps(body[k])[:40]} is not supported by this server "
                                f"(it honours {', '.join(json.dumps(a) for a in allowed)})", k)


def request_settings(engine: Engine, body: dict, length_key: str = "max_tokens"):
    """The settings a request decodes under and its seed (None: derived per prompt)."""
    over: dict[str, Any] = {}
    for k in (length_key, "max_tokens") if length_key != "max_tokens" else ("max_tokens",):
        n = _int(body, k, 1, 1 << 16)
        if n is not None:
            over["gen_length"] = n
            break
    for k in ("temperature", "top_p"):
        v = _number(body, k)
        if v is not None:
            over[k] = v
    if "top_k" in body and body["top_k"] is not None and body["top_k"] != -1:
        over["top_k"] = _int(body, "top_k", 1, 1 << 20)
    for k in request_keys():
        if k in body and k not in ("temperature", "top_p", "top_k"):
            over[k] = _typed(k, body[k])
    if "gen_length" in body and "gen_length" in over and length_key in body:
        raise ApiError(400, f"gen_length and {length_key} both given: give one", "gen_length")
    seed = _int(body, "seed", 0, MAX_SEED)
    try:
        settings = engine.settings_for(over)
    except UserError as e:
        raise ApiError(400, str(e).replace("invalid generation settings: ", ""), None) from None
    n_pos = engine.generator.max_positions
    if n_pos is not None and settings.gen_length > n_pos:
        raise ApiError(400, f"max_tokens: {settings.gen_length} exceeds the model's {n_pos} positions", length_key)
    return settings, seed


def _typed(key: str, value: Any) -> Any:
    """A generate key of a request as JSON gives it: of its setting's own type (``"4"`` is no step count; the
    recipe's settings would coerce it), a rule's settings an object of theirs. The ranges are checked after."""
    field = SamplerSettings.model_fields.get(key)
    try:
        if field is not None:
            TypeAdapter(field.annotation).validate_python(value, strict=True)
        elif not isinstance(value, dict):
            raise ApiError(400, f"{key}: expected an object of the rule's settings (got {json.dumps(value)[:40]})", key)
        else:
            registry.get("rule", key).settings.model_validate(value, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = key if field is not None else ".".join([key, *(str(x) for x in err["loc"][:1])])
        raise ApiError(400, f"{where}: {err['msg'].lower()} (got {json.dumps(value)[:40]})", key) from None
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: expected a non-empty string or a list of at most {MAX_STOPS}", "stop")
    return stops


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def _token_prompt(engine: Engine, ids: list, where: str) -> list[int]:
    if not ids:
        raise ApiError(400, f"{where}: an empty prompt cannot be decoded", "prompt")
    V = engine.vocab_size
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
            raise ApiError(400, f"{where}: token ids must be integers in [0, {V}) (got {json.dumps(t)[:30]})", "prompt")
    return list(ids)


def completion_prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    """The token ids of each prompt of a /v1/completions request (text is encoded without special tokens)."""
    tok = engine.tokenizer
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise ApiError(400, "prompt: expected a string, a list of token ids, or a non-empty list of either", "prompt")
    if len(items) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: {len(items)} prompts in one request (at most {MAX_PROMPTS})", "prompt")
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise ApiError(400, f"prompt[{i}]: an empty prompt cannot be decoded", "prompt")
            out.append([int(t) for t in tok(p, add_special_tokens=False)["input_ids"]])
        elif isinstance(p, list):
            out.append(_token_prompt(engine, p, f"prompt[{i}]"))
        else:
            raise ApiError(400, f"prompt[{i}]: expected a string or a list of token ids", "prompt")
    return out


def chat_prompt(engine: Engine, messages: Any) -> list[int]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) and set(m) <= {"role", "content", "name"}
        for m in messages)
    if not ok:
        raise ApiError(400, "messages: expected a non-empty list of {role, content} objects with string content", "messages")
    try:
        return encode_prompt(engine.tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    except UserError as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    except Exception as e:  # a template that rejects the roles given
        raise ApiError(400, f"messages: the chat template refused them ({type(e).__name__}: {str(e)[:200]})", "messages") from None


def _retrieved(fut) -> None:
    """Read a dropped request's outcome, so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


# --------------------------------------------------------------------------- the app
class Server:
    """The routes over ``engine``; ``api_key``: required of every route but /health when set."""

    def __init__(self, engine: Engine, *, api_key: Optional[str] = None, max_body: int = 4 << 20,
                 timeout: float = 600.0, allow_load: bool = True) -> None:
        self.engine = engine
        self.api_key = api_key
        self.max_body = max_body
        self.timeout = timeout
        self.allow_load = allow_load
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/serving", self.serving, methods=["GET"]),
            Route("/v1/settings", self.settings, methods=["POST"]),
            Route("/v1/load", self.load, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(404, f"no route {request.url.path}", kind="not_found_error")

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}")

    # -- guards
    def _authorise(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    async def _body(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise ApiError(413, f"request body larger than {self.max_body} bytes")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > self.max_body:
                raise ApiError(413, f"request body larger than {self.max_body} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON ({str(e)[:100]})") from None
        except RecursionError:  # nesting deeper than the parser's stack: no request of this API nests so
            raise ApiError(400, "the body is not JSON this server reads (nested too deeply)") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> None:
        if "model" in body and body["model"] != self.engine.name:
            shown = json.dumps(body["model"])[:80]
            raise ApiError(404, f"the model {shown} is not served here (this server serves {self.engine.name!r})",
                           "model", kind="model_not_found")

    async def _guarded(self, request: Request, fn) -> Response:
        try:
            self._authorise(request)
            return await fn(request)
        except ApiError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except ClientDisconnect:
            return Response(status_code=499)

    # -- routes
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "pending": self.engine.pending()})

    async def models(self, request: Request) -> Response:
        async def go(_):
            e = self.engine
            return JSONResponse({"object": "list", "data": [{
                "id": e.name, "object": "model", "created": 0, "owned_by": "dllm-align", "root": e.folder,
                "max_model_len": e.generator.max_positions, "fingerprint": e.fingerprint}]})
        return await self._guarded(request, go)

    async def serving(self, request: Request) -> Response:
        async def go(_):
            return JSONResponse({**self.engine.serving(), "version": __version__})
        return await self._guarded(request, go)

    async def settings(self, request: Request) -> Response:
        async def go(req):
            body = await self._body(req)
            unknown = sorted(k for k in body if k not in request_keys() and k != "seed")
            if unknown:
                raise ApiError(400, f"unknown generate key {unknown[0]!r}", unknown[0])
            try:
                s = self.engine.settings_for(body)
            except UserError as e:
                raise ApiError(400, str(e).replace("invalid generation settings: ", "")) from None
            return JSONResponse({"settings": s.model_dump(mode="json")})
        return await self._guarded(request, go)

    async def load(self, request: Request) -> Response:
        async def go(req):
            if not self.allow_load:
                raise ApiError(403, "this server was started with loading turned off (--no-load)", kind="permission_error")
            body = await self._body(req)
            folder = body.get("folder")
            if not isinstance(folder, str) or not folder or set(body) - {"folder"}:
                raise ApiError(400, "expected {\"folder\": <checkpoint folder>}", "folder")
            try:
                out = await asyncio.to_thread(self.engine.load, folder)
            except UserError as e:
                raise ApiError(400, f"folder: {e}", "folder") from None
            except Exception as e:
                raise ApiError(400, f"folder: {folder!r} could not be loaded ({type(e).__name__}: {str(e)[:200]})", "folder") from None
            return JSONResponse({"model": self.engine.name, **out})
        return await self._guarded(request, go)

    async def completions(self, request: Request) -> Response:
        async def go(req):
            body = await self._body(req)
            check_fields(body, "prompt")
            self._check_model(body)
            if "prompt" not in body:
                raise ApiError(400, "prompt: required", "prompt")
            prompts = completion_prompts(self.engine, body["prompt"])
            settings, seed = request_settings(self.engine, body)
            results = await self._decode(req, prompts, settings, seed)
            return self._reply(body, "text_completion", prompts, results, chat=False)
        return await self._guarded(request, go)

    async def chat(self, request: Request) -> Response:
        async def go(req):
            body = await self._body(req)
            check_fields(body, "messages")
            self._check_model(body)
            prompt = chat_prompt(self.engine, body.get("messages"))
            settings, seed = request_settings(self.engine, body, "max_completion_tokens")
            results = await self._decode(req, [prompt], settings, seed)
            return self._reply(body, "chat.completion", [prompt], results, chat=True)
        return await self._guarded(request, go)

    # -- decoding
    async def _decode(self, request: Request, prompts: list[list[int]], settings, seed: Optional[int]):
        seeds = [seed if seed is not None else default_seed(settings, p) for p in prompts]
        futures = []
        try:
            for p, s in zip(prompts, seeds):
                futures.append(self.engine.submit(p, settings, s))
        except QueueFull:
            for f in futures:
                f.cancel()
            raise ApiError(429, f"the queue is full ({self.engine.pending()} waiting); retry later", kind="rate_limit_error") from None
        except Stopped:
            raise ApiError(503, "the server is shutting down", kind="server_error") from None
        waiting = [asyncio.wrap_future(f) for f in futures]
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                _, pending = await asyncio.wait(waiting, timeout=0.25)
                if not pending:
                    return [(w.result(), s) for w, s in zip(waiting, seeds)]
                if await request.is_disconnected():
                    raise ClientDisconnect()
                if time.monotonic() > deadline:
                    raise ApiError(504, f"not decoded within {self.timeout:g} s", kind="timeout_error")
        except (ApiError, ClientDisconnect, asyncio.CancelledError):
            raise
        except Exception as e:
            raise ApiError(500, f"decoding failed ({type(e).__name__}: {str(e)[:200]})", kind="server_error") from None
        finally:
            for f, w in zip(futures, waiting):
                if not w.done():
                    f.cancel()  # dropped before its batch starts (a batch under way finishes; its answer is dropped)
                w.add_done_callback(_retrieved)

    def _reply(self, body: dict, kind: str, prompts: list[list[int]], results: list[tuple[Completion, int]], chat: bool) -> JSONResponse:
        stops = _stops(body)
        choices, completion_tokens = [], 0
        for i, (c, seed) in enumerate(results):
            text, cut = cut_at_stop(c.text, stops)
            finish = "stop" if cut or c.stopped else "length"
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if body.get("return_token_ids"):
                choice["token_ids"] = list(c.ids)
                choice["prompt_token_ids"] = list(prompts[i])
            choice["dllm_align"] = {**completion_record(c), "seed": seed}
            choices.append(choice)
            completion_tokens += len(c.ids)
        prompt_tokens = sum(len(p) for p in prompts)
        return JSONResponse({
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": self.engine.name, "system_fingerprint": self.engine.fingerprint, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})



# --------------------------------------------------------------------------- running it
def check_limits(*, timeout: float, batch_window_ms: float, max_body_mb: float, served_model_name: Optional[str]) -> None:
    """The server's bounds as ``serve`` takes them, checked before the model loads: finite numbers (an infinite
    timeout is a request that never ends; an infinite body limit no limit) and a model name requests can give."""
    for flag, v in (("--timeout", timeout), ("--batch-window-ms", batch_window_ms), ("--max-body-mb", max_body_mb)):
        if not math.isfinite(v):
            raise UserError(f"{flag} {v}: a finite number")
    if max_body_mb > 1 << 20:
        raise UserError(f"--max-body-mb {max_body_mb:g}: at most {1 << 20} (a TiB)")
    if served_model_name is not None and not served_model_name.strip():
        raise UserError("--served-model-name: empty; requests name the model by it")


def check_bind(host: str, api_key: Optional[str]) -> None:
    """Loopback by default: a server reachable from elsewhere must have an API key."""
    if not is_loopback(host) and not api_key:
        raise UserError(f"--host {host}: not a loopback address, and no API key is set; anyone who can reach it could "
                        "generate and load folders", hint="set the key in the variable --api-key-env names, or bind 127.0.0.1")


def _uvicorn_server(server: Server, host: str, port: int, *, max_connections: int) -> uvicorn.Server:
    # uvicorn answers 503 itself past max_connections (a flood never reaches the queue); no access log: a
    # prompt is the user's data and the key must never reach a log
    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", access_log=False,
                            limit_concurrency=max_connections, timeout_keep_alive=5, lifespan="off")
    return uvicorn.Server(config)


class Running:
    """A server started on a thread (tests, benchmarks): its URL, and :meth:`stop`."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0, *, max_connections: int = 2048,
                 start_timeout: float = 60.0) -> None:
        self.server = server
        self.uv = _uvicorn_server(server, host, port, max_connections=max_connections)
        self.thread = threading.Thread(target=self.uv.run, daemon=True, name="serve-http")
        self.thread.start()
        end = time.monotonic() + start_timeout
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server did not start within {start_timeout:g} s")
            time.sleep(0.02)
        sock = self.uv.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout)
        self.server.engine.close()


def serve_forever(server: Server, host: str, port: int, *, max_connections: int = 2048) -> None:
    """Serve until Ctrl-C / SIGTERM (uvicorn's own signal handling), then stop the worker."""
    uv = _uvicorn_server(server, host, port, max_connections=max_connections)
    try:
        uv.run()
    finally:
        server.engine.close()


__all__ = ["ApiError", "MAX_PROMPTS", "Running", "Server", "check_bind", "check_limits", "serve_forever", "chat_prompt", "completion_prompts", "cut_at_stop", "error_response",
           "request_settings"]
