"""The sixth adversarial round, kept as fast refusals (docs/reliability.md, "sixth round").

What this round attacks is what the last one added: ``dllm-align serve`` (its flags, and HTTP requests against a
live server on 127.0.0.1), ``dllm-align parity``, the client backend (``generate.backend: openai``) against an
unreachable server and against a fake one that answers badly, LLaDA2.1's settings, the three-verdict labels
(``online.math_answer``, unsure routing, a user's verifier returning no verdict), and loading (sharded weights
and their index) and doctor's launch settings.

The manners asserted: bad input exits 2 with one ``Error:`` line naming the key, file or flag (a fault at run
time, such as a server answering garbage, exits 1); no traceback; no output folder left behind; nothing written
outside the run folder; the API key (``DLLM_ALIGN_SERVE_KEY`` or the backend's ``api_key_env``) in no output or
file; servers bind 127.0.0.1. HTTP refusals are a 4xx with an OpenAI-style JSON error body and a server that
answers the next request.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reliability import run_cli, snapshot

ASSETS = Path(__file__).resolve().parent.parent / "src" / "dllm_align" / "assets"
KEY = "r6-sekrit-0123456789abcdef"  # a key no output or file may show
WAIT = 60


def refused(r, *needles, code=2) -> str:
    """The one ``Error:`` line of a refusal: exit ``code`` (or one of a tuple), no traceback, naming every needle."""
    assert r.exc is None, r.traceback
    codes = code if isinstance(code, tuple) else (code,)
    assert r.code in codes, (r.code, r.err[-2000:])
    errors = [line for line in r.err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, r.err[-2000:]
    assert "Traceback" not in r.err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    assert KEY not in r.out and KEY not in r.err
    return errors[0]


def no_key_in(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            assert KEY.encode() not in p.read_bytes(), p


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "p.txt"
    p.write_text("Sort: 3 1 2\nSort: 2 1\n")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =========================================================================== serve: flags, before any serving
class _Served(Exception):
    """The serve command reached the point of serving: a refusal came too late (or never)."""


@pytest.fixture
def no_serving(monkeypatch):
    """A serve command that gets past its checks stops here instead of serving forever."""
    import dllm_align.serve.api as api

    def stop(server, host, port, **kw):
        server.engine.close()
        raise _Served(f"serving on {host}:{port}")

    monkeypatch.setattr(api, "serve_forever", stop)


SERVE_FLAGS = [
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--port", "http"], "--port"),
    (["--host", "0.0.0.0"], "--host"),
    (["--host", "::"], "--host"),
    (["--host", "10.1.2.3"], "--host"),
    (["--host", "example.com"], "--host"),
    (["--host", ""], "--host"),
    (["--max-queue", "0"], "--max-queue"),
    (["--max-batch", "0"], "--max-batch"),
    (["--batch-window-ms", "-1"], "--batch-window-ms"),
    (["--batch-window-ms", "nan"], "--batch-window-ms"),
    (["--batch-window-ms", "inf"], "--batch-window-ms"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--max-body-mb", "nan"], "--max-body-mb"),
    (["--max-body-mb", "inf"], "--max-body-mb"),
    (["--max-connections", "0"], "--max-connections"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--device", "tpu"], "--device"),
    (["--api-key-env", "R6_NOT_SET_ANYWHERE", "--host", "0.0.0.0"], "--host"),
]


@pytest.mark.parametrize("flags, needle", SERVE_FLAGS, ids=[" ".join(f) or "empty" for f, _ in SERVE_FLAGS])
def test_serve_refuses_a_bad_flag_before_serving(tmp_path, no_serving, flags, needle):
    r = run_cli(["serve", "demo", *flags], cwd=tmp_path)
    refused(r, needle)
    assert list(tmp_path.iterdir()) == []


def test_serve_refuses_a_key_with_spaces_without_showing_it(tmp_path, no_serving):
    r = run_cli(["serve", "demo", "--host", "0.0.0.0"], env={"DLLM_ALIGN_SERVE_KEY": KEY[:6] + " " + KEY[6:]}, cwd=tmp_path)
    refused(r, "DLLM_ALIGN_SERVE_KEY")
    assert KEY[6:] not in r.err


@pytest.mark.parametrize("make", ["missing", "file", "garbage-config", "empty-folder"])
def test_serve_refuses_a_model_folder_it_cannot_load_naming_it(tmp_path, no_serving, make):
    folder = tmp_path / "m"
    if make == "file":
        folder.write_text("not a folder\n")
    elif make == "garbage-config":
        folder.mkdir()
        (folder / "config.json").write_text("{not json")
    elif make == "empty-folder":
        folder.mkdir()
    before = snapshot(tmp_path)
    r = run_cli(["serve", "demo", "--model", folder], env={"DLLM_ALIGN_SERVE_KEY": KEY}, cwd=tmp_path)
    refused(r, "m")
    assert snapshot(tmp_path) == before


def test_serve_binds_loopback_only_by_default_and_never_shows_the_key(tmp_path, monkeypatch):
    import dllm_align.serve.api as api

    seen = {}

    def stop(server, host, port, **kw):
        seen.update(host=host, key=server.api_key)
        server.engine.close()
        raise _Served("stop")

    monkeypatch.setattr(api, "serve_forever", stop)
    r = run_cli(["serve", "demo", "--set", "generate.gen_length=8", "--set", "generate.block_length=8",
                 "--set", "generate.steps=8"], env={"DLLM_ALIGN_SERVE_KEY": KEY}, cwd=tmp_path)
    assert r.exc is None and r.code == 1 and "_Served" in r.err, (r.code, r.err)  # it got as far as serving
    assert seen["host"] == "127.0.0.1" and seen["key"] == KEY
    assert KEY not in r.err and KEY not in r.out and list(tmp_path.iterdir()) == []


# =========================================================================== serve: hostile HTTP requests
@pytest.fixture(scope="module")
def live():
    """``dllm-align serve``'s app on 127.0.0.1 over the tiny LLaDA, with an API key, a small queue and body."""
    from dllm_align.config.schema import GenerateSection, ModelSection
    from dllm_align.serve.api import Running, Server
    from dllm_align.serve.engine import Engine

    engine = Engine.from_section(ModelSection(name_or_path="builtin:tiny"),
                                 GenerateSection(gen_length=8, block_length=4, steps=4), max_queue=8)
    run = Running(Server(engine, api_key=KEY, max_body=64 << 10, timeout=30), "127.0.0.1", 0, start_timeout=WAIT)
    try:
        yield run
    finally:
        run.stop(timeout=WAIT)


def call(url, path, body=None, *, raw=None, key=KEY, method=None, headers=None, timeout=WAIT):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {}) | (headers or {})
    req = urllib.request.Request(url + path, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
            return r.status, json.loads(text or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text


def assert_api_refusal(live, status, body, want, field=None):
    assert status == want, (status, body)
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    assert body["error"]["message"] and KEY not in json.dumps(body)
    if field is not None:
        assert field in body["error"]["message"] or body["error"].get("param") == field, body
    assert call(live.url, "/health")[0] == 200  # the server lives on


P = [5, 6, 7]
COMPLETIONS = {
    "max_tokens 0": ({"prompt": P, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens as float": ({"prompt": P, "max_tokens": 8.0}, 400, "max_tokens"),
    "max_tokens as text": ({"prompt": P, "max_tokens": "8"}, 400, "max_tokens"),
    "max_tokens true": ({"prompt": P, "max_tokens": True}, 400, "max_tokens"),
    "max_tokens 2**64": ({"prompt": P, "max_tokens": 2**64}, 400, "max_tokens"),
    "max_tokens not a block multiple": ({"prompt": P, "max_tokens": 7}, 400, "gen_length"),
    "temperature negative": ({"prompt": P, "temperature": -1}, 400, "temperature"),
    "temperature 1e308": ({"prompt": P, "temperature": 1e308}, 400, "temperature"),
    "temperature as text": ({"prompt": P, "temperature": "hot"}, 400, "temperature"),
    "top_p 2": ({"prompt": P, "top_p": 2}, 400, "top_p"),
    "top_p negative": ({"prompt": P, "top_p": -0.5}, 400, "top_p"),
    "top_k 0": ({"prompt": P, "top_k": 0}, 400, "top_k"),
    "top_k as float": ({"prompt": P, "top_k": 1.5}, 400, "top_k"),
    "seed float": ({"prompt": P, "seed": 1.5}, 400, "seed"),
    "seed true": ({"prompt": P, "seed": True}, 400, "seed"),
    "model not text": ({"prompt": P, "model": 7}, 404, "model"),
    "model empty": ({"prompt": P, "model": ""}, 404, "model"),
    "messages on completions": ({"prompt": P, "messages": []}, 400, "messages"),
    "stream as text": ({"prompt": P, "stream": "true"}, 400, "stream"),
    "stream 1": ({"prompt": P, "stream": 1}, 400, "stream"),
    "stream_options": ({"prompt": P, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    "n 0": ({"prompt": P, "n": 0}, 400, "n"),
    "n as float": ({"prompt": P, "n": 1.0}, 400, "n"),
    "logprobs 5": ({"prompt": P, "logprobs": 5}, 400, "logprobs"),
    "echo": ({"prompt": P, "echo": True}, 400, "echo"),
    "stop empty": ({"prompt": P, "stop": ""}, 400, "stop"),
    "stop nine": ({"prompt": P, "stop": ["a"] * 9}, 400, "stop"),
    "stop number": ({"prompt": P, "stop": 5}, 400, "stop"),
    "prompt of booleans": ({"prompt": [True, False]}, 400, "prompt"),
    "prompt of floats": ({"prompt": [5.0, 6.0]}, 400, "prompt"),
    "negative token": ({"prompt": [5, -1]}, 400, "prompt"),
    "prompt object": ({"prompt": {"text": "hi"}}, 400, "prompt"),
    "65 prompts": ({"prompt": [[5, 6]] * 65}, 400, "prompt"),
    "an empty text prompt": ({"prompt": ["ok", ""]}, 400, "prompt"),
    "no prompt": ({"max_tokens": 8}, 400, "prompt"),
    "backend field": ({"prompt": P, "backend": "openai"}, 400, "backend"),
    "batch_size field": ({"prompt": P, "batch_size": 10**9}, 400, "batch_size"),
    "gen_length beside max_tokens": ({"prompt": P, "gen_length": 8, "max_tokens": 4}, 400, "gen_length"),
    "unknown sampler": ({"prompt": P, "sampler": "bogus"}, 400, "sampler"),
    "another family's rule": ({"prompt": P, "sampler": "diffusion_gemma"}, 400, "sampler"),
    "steps as text": ({"prompt": P, "steps": "4"}, 400, "steps"),
    "block_length 0": ({"prompt": P, "block_length": 0}, 400, "block_length"),
    "llada21 settings on a LLaDA model": ({"prompt": P, "llada21": {"mode": "speed"}}, 400, "llada21"),
}


@pytest.mark.parametrize("what", list(COMPLETIONS))
def test_a_hostile_completions_request_gets_a_4xx_naming_the_field(live, what):
    body, status, field = COMPLETIONS[what]
    got, err = call(live.url, "/v1/completions", body)
    assert_api_refusal(live, got, err, status, field)


RAW = {
    "empty body": (b"", 400),
    "null body": (b"null", 400),
    "not UTF-8": (b'{"prompt": "\xff\xfe"}', 400),
    "deeply nested": (b"[" * 200000 + b"]" * 200000, 413),
    "nested under the limit": (b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
}


@pytest.mark.parametrize("what", list(RAW))
def test_a_body_that_is_no_request_gets_a_4xx_json_error(live, what):
    raw, status = RAW[what]
    got, err = call(live.url, "/v1/completions", raw=raw)
    assert_api_refusal(live, got, err, status)


CHAT = {
    "content as parts": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "messages"),
    "tool_calls field": ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    "no messages": ({"max_completion_tokens": 8}, "messages"),
    "prompt on chat": ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "prompt"),
    "negative max_completion_tokens": ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
                                       "max_completion_tokens"),
}


@pytest.mark.parametrize("what", list(CHAT))
def test_a_hostile_chat_request_gets_a_400_naming_the_field(live, what):
    body, field = CHAT[what]
    got, err = call(live.url, "/v1/chat/completions", body)
    assert_api_refusal(live, got, err, 400, field)


def test_the_api_key_guards_and_is_never_echoed(live):
    for headers in ({"Authorization": KEY}, {"Authorization": f"Bearer {KEY[:-1]}"}, {"X-Api-Key": KEY}):
        got, err = call(live.url, "/v1/models", key=None, headers=headers)
        assert_api_refusal(live, got, err, 401)
    got, err = call(live.url, f"/v1/models?api_key={KEY}", key=None)
    assert_api_refusal(live, got, err, 401)
    for path in ("/v1/models", "/v1/serving"):
        got, body = call(live.url, path)
        assert got == 200 and KEY not in json.dumps(body)


def test_a_wrong_method_and_route_get_json_errors(live):
    got, err = call(live.url, "/v1/completions", method="GET")
    assert_api_refusal(live, got, err, 405)
    got, err = call(live.url, "/v1/../v1/models")
    assert got in (200, 404)


@pytest.mark.parametrize("body, field", [({"folder": 5}, "folder"), ({"folder": "/"}, "folder"),
                                         ({"folder": "x", "extra": 1}, "folder"), ({"folder": "../../etc"}, "folder")],
                         ids=["number", "root", "extra-key", "dotdot"])
def test_load_of_a_bad_folder_is_refused_and_the_old_model_stays_served(live, body, field):
    got, err = call(live.url, "/v1/load", body)
    assert_api_refusal(live, got, err, 400, field)
    assert call(live.url, "/v1/serving")[1]["folder"] == "builtin:tiny"


def test_load_of_a_folder_with_a_garbage_config_keeps_the_old_model(live, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(ASSETS / "toy_sort_base", folder)
    (folder / "config.json").write_text("{not json")
    got, err = call(live.url, "/v1/load", {"folder": str(folder)})
    assert_api_refusal(live, got, err, 400, "folder")
    assert call(live.url, "/v1/serving")[1]["folder"] == "builtin:tiny"


def test_a_chunked_body_past_the_limit_is_413(live):
    s = socket.create_connection((live.host, live.port), timeout=WAIT)
    try:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * 8192
        for _ in range(20):  # 160 KiB against a 64 KiB limit
            try:
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except OSError:
                break
        s.settimeout(WAIT)
        head = s.recv(200)
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert call(live.url, "/health")[0] == 200


def test_a_client_that_sends_half_a_body_and_goes_away_leaves_the_server_answering(live):
    for _ in range(3):
        s = socket.create_connection((live.host, live.port), timeout=10)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": [5".encode())
        s.close()
    got, body = call(live.url, "/v1/completions", {"prompt": P})
    assert got == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_content_length_that_is_no_number_is_refused(live):
    s = socket.create_connection((live.host, live.port), timeout=WAIT)
    try:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: -5\r\n\r\n".encode())
        s.settimeout(WAIT)
        head = s.recv(200)
    finally:
        s.close()
    assert head.split(b" ")[1][:1] == b"4", head
    assert call(live.url, "/health")[0] == 200


# =========================================================================== the client backend: settings
CLIENT_SETTINGS = [
    ("generate.openai.base_url=", "generate.openai.base_url"),
    ("generate.openai.base_url=ftp://127.0.0.1/v1", "generate.openai.base_url"),
    ("generate.openai.base_url=localhost:8000/v1", "generate.openai.base_url"),
    ("generate.openai.base_url=http://", "generate.openai.base_url"),
    ("generate.openai.base_url=http://user:pw@127.0.0.1:8000/v1", "generate.openai.base_url"),
    ("generate.openai.concurrency=0", "generate.openai.concurrency"),
    ("generate.openai.concurrency=257", "generate.openai.concurrency"),
    ("generate.openai.timeout=0", "generate.openai.timeout"),
    ("generate.openai.timeout=nan", "generate.openai.timeout"),
    ("generate.openai.timeout=inf", "generate.openai.timeout"),
    ("generate.openai.max_retries=-1", "generate.openai.max_retries"),
    ("generate.openai.max_retries=21", "generate.openai.max_retries"),
    ("generate.openai.engine=tgi", "generate.openai.engine"),
    ("generate.openai.engine=vllm", "generate.openai.engine"),
    ("generate.openai.api_key_env=NOT A NAME", "generate.openai.api_key_env"),
    ("generate.openai.fixed={bogus_key: 1}", "generate.openai.fixed"),
    ('generate.openai.model=""', "generate.openai.model"),
]


@pytest.mark.parametrize("setting, key", CLIENT_SETTINGS, ids=[s for s, _ in CLIENT_SETTINGS])
def test_a_bad_client_backend_setting_is_refused_by_recipes_check_and_generate(tmp_path, prompts, setting, key):
    base = ["--set", "generate.backend=openai", "--set", setting]
    r = run_cli(["recipes", "check", "demo", *base])
    refused(r, key)
    out = tmp_path / "g"
    r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, *base])
    refused(r, key)
    assert not out.exists()


def test_the_keys_a_recipe_may_declare_fixed_are_the_keys_engines_fix_at_launch():
    from dllm_align.generate.components import FIXABLE
    from dllm_align.serve.engines import ENGINES

    assert set(FIXABLE) == {k for e in ENGINES.values() for k in e.launch}


def test_an_unset_api_key_variable_is_refused_before_the_folder(tmp_path, prompts):
    out = tmp_path / "g"
    r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--set", "generate.backend=openai",
                 "--set", "generate.openai.api_key_env=R6_UNSET_KEY_VAR"], env={"R6_UNSET_KEY_VAR": None})
    refused(r, "R6_UNSET_KEY_VAR")
    assert not out.exists()


def test_an_unreachable_server_is_refused_naming_it_and_leaves_no_folder(tmp_path, prompts):
    out = tmp_path / "g"
    port = _free_port()
    t0 = time.monotonic()
    r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--set", "generate.backend=openai",
                 "--set", f"generate.openai.base_url=http://127.0.0.1:{port}/v1", "--set", "generate.openai.max_retries=0",
                 "--set", "generate.openai.timeout=5", "--set", "generate.openai.api_key_env=R6_KEY"],
                env={"R6_KEY": KEY})
    refused(r, f"127.0.0.1:{port}", code=(1, 2))
    assert time.monotonic() - t0 < 60 and not out.exists()


def test_an_engine_setting_it_cannot_honour_is_refused_before_any_request(tmp_path, prompts):
    out = tmp_path / "g"
    port = _free_port()
    r = run_cli(["generate", "demo_block", "-o", out, "--prompts", prompts, "--set", "generate.backend=openai",
                 "--set", f"generate.openai.base_url=http://127.0.0.1:{port}/v1", "--set", "generate.openai.engine=sglang",
                 "--set", "generate.openai.model=m", "--set", "generate.temperature=0.7",
                 "--set", "generate.openai.max_retries=0"])
    refused(r, "temperature")
    assert not out.exists()


# =========================================================================== the client backend: a server answering badly
class _Fake(BaseHTTPRequestHandler):
    mode = "ok"
    seen: list = []

    def log_message(self, *a):  # quiet
        pass

    def _send(self, status: int, text: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def do_GET(self):
        m = type(self).mode
        if self.path.endswith("/models"):
            if m == "models-garbage":
                return self._send(200, b'{"data": "none"}')
            return self._send(200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode())
        if self.path.endswith("/serving"):
            if m == "serving-garbage":
                return self._send(200, b"[1, 2")
            return self._send(200, json.dumps({"model": "m", "folder": None, "fingerprint": None, "max_positions": 4096}).encode())
        self._send(404, b'{"error": {"message": "no"}}')

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        type(self).seen.append((self.path, body))
        m = type(self).mode
        if self.path.endswith("/settings"):
            if m == "settings-garbage":
                return self._send(200, b'{"nothing": 1}')
            return self._send(200, json.dumps({"settings": {**body, "sampler": "llada"}}).encode())
        if m == "garbage":
            return self._send(200, b"{not json")
        if m == "truncated":
            return self._send(200, b'{"id": "c", "object": "text_completion", "choices": [{"te')
        if m == "500":
            return self._send(500, b'{"error": {"message": "boom"}}')
        if m == "html":
            return self._send(200, b"<html>hi</html>", "text/html")
        if m == "no-choices":
            return self._send(200, json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                               "choices": []}).encode())
        ids = [49, 50] if m != "bad-ids" else "ab"
        own = {"token_ids": ids, "raw": ids, "stopped": False, "forwards": 1}
        self._send(200, json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "text": "12", "finish_reason": "length", "logprobs": None, "dllm_align": own}]}).encode())


@contextlib.contextmanager
def fake_server(mode: str):
    _Fake.mode, _Fake.seen = mode, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _through(url: str) -> list[str]:
    return ["--set", "generate.backend=openai", "--set", f"generate.openai.base_url={url}", "--set",
            "generate.openai.max_retries=0", "--set", "generate.openai.timeout=10", "--set", "generate.openai.api_key_env=R6_KEY"]


@pytest.mark.parametrize("mode", ["garbage", "truncated", "500", "html", "no-choices", "bad-ids", "models-garbage",
                                  "serving-garbage", "settings-garbage"])
def test_a_server_answering_badly_ends_generate_naming_it_without_a_traceback(tmp_path, prompts, mode):
    out = tmp_path / "g"
    with fake_server(mode) as url:
        r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, *_through(url)], env={"R6_KEY": KEY})
    refused(r, url.rsplit("/v1", 1)[0].split("//")[1], code=(1, 2))
    if out.exists():
        no_key_in(out)
    no_key_in(tmp_path)


def test_a_rerun_through_a_server_with_a_changed_prompts_file_is_refused_leaving_the_files(tmp_path, prompts):
    out = tmp_path / "g"
    with fake_server("ok") as url:
        r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, *_through(url)], env={"R6_KEY": KEY})
        assert r.code == 0, r.err
        no_key_in(out)
        prompts.write_text("Sort: 9 8 7\nSort: 2 1\n")
        before = snapshot(out)
        r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, *_through(url)], env={"R6_KEY": KEY})
    refused(r, "p.txt")
    assert snapshot(out) == before


# =========================================================================== parity
def _parity(tmp_path, *extra, recipe="demo", url=None):
    out = tmp_path / "par"
    url = url or f"http://127.0.0.1:{_free_port()}/v1"
    args = ["parity", recipe, "-o", out, "--set", "generate.backend=openai", "--set", f"generate.openai.base_url={url}",
            "--set", "generate.openai.max_retries=0", "--set", "generate.openai.timeout=5", *extra]
    return run_cli(args), out


@pytest.mark.parametrize("extra, needle", [
    (["--split", "bogus"], "--split"),
    (["--alpha", "nan"], "--alpha"),
    (["--min-match", "nan"], "--min-match"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--prompts", "/nonexistent-r6/p.txt"], "p.txt"),
    (["--rule", "no_such_rule"], "no_such_rule"),
    (["--samples", "1"], "--samples"),
    (["--limit", "0"], "--limit"),
])
def test_parity_refuses_bad_flags_before_contacting_anything(tmp_path, extra, needle):
    r, out = _parity(tmp_path, *extra)
    refused(r, needle)
    assert not out.exists()


def test_parity_on_an_empty_prompts_file_is_refused_naming_it(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("")
    r, out = _parity(tmp_path, "--prompts", p)
    refused(r, "empty.txt")
    assert not out.exists()


def test_parity_against_an_unreachable_server_names_it_and_leaves_no_folder(tmp_path, prompts):
    port = _free_port()
    r, out = _parity(tmp_path, "--prompts", prompts, url=f"http://127.0.0.1:{port}/v1")
    refused(r, f"127.0.0.1:{port}", code=(1, 2))
    assert not out.exists()


def test_parity_with_a_wrong_engine_for_the_family_is_refused_naming_it(tmp_path, prompts):
    r, out = _parity(tmp_path, "--prompts", prompts, "--set", "generate.openai.engine=lmdeploy", "--set",
                     "generate.openai.model=m")
    refused(r, "generate.openai.engine")
    assert not out.exists()


def test_parity_on_an_in_process_recipe_is_refused_naming_the_backend(tmp_path, prompts):
    out = tmp_path / "par"
    refused(run_cli(["parity", "demo", "-o", out, "--prompts", prompts]), "generate.backend")
    assert not out.exists()


# =========================================================================== LLaDA2.1's settings
@pytest.mark.parametrize("setting, key", [
    ("generate.llada21.threshold=1.5", "generate.llada21.threshold"),
    ("generate.llada21.threshold=-0.1", "generate.llada21.threshold"),
    ("generate.llada21.threshold=nan", "generate.llada21.threshold"),
    ("generate.llada21.edit_threshold=2", "generate.llada21.edit_threshold"),
    ("generate.llada21.edit_threshold=nan", "generate.llada21.edit_threshold"),
    ("generate.llada21.max_post_steps=-1", "generate.llada21.max_post_steps"),
    ("generate.llada21.max_post_steps=2000", "generate.llada21.max_post_steps"),
    ("generate.llada21.mode=turbo", "generate.llada21.mode"),
    ("generate.llada21.speed=1", "generate.llada21.speed"),
    ("generate.steps=12", "generate.steps"),
    ("generate.threshold=0.9", "generate.threshold"),
])
def test_recipes_check_refuses_llada21_values_out_of_range(setting, key):
    refused(run_cli(["recipes", "check", "demo_llada21", "--set", setting]), key)


@pytest.mark.parametrize("recipe", ["demo", "demo_dream", "demo_block", "demo_gemma"])
def test_llada21_settings_on_another_family_are_refused(recipe):
    refused(run_cli(["recipes", "check", recipe, "--set", "generate.llada21.mode=speed"]), "generate.llada21")


@pytest.mark.parametrize("recipe", ["demo", "demo_gemma"])
def test_the_llada21_rule_on_a_model_it_cannot_decode_is_refused(tmp_path, prompts, recipe):
    steps = ["--set", "generate.steps=512"]  # the rule reads no steps: the recipe's own are set back
    refused(run_cli(["recipes", "check", recipe, "--set", "generate.sampler=llada21", *steps]), "generate.sampler")
    out = tmp_path / "g"
    refused(run_cli(["generate", recipe, "-o", out, "--prompts", prompts, "--sampler", "llada21", *steps]),
            "generate.sampler")
    assert not out.exists()


@pytest.mark.parametrize("recipe, setting", [("demo", "reference.replace_share=0.2"),
                                             ("demo_gemma", "reference.replace_share=0.2"),
                                             ("demo_llada21", "reference.replace_share=1.5")])
def test_llada21s_replaced_share_elsewhere_is_refused_by_name(recipe, setting):
    refused(run_cli(["recipes", "check", recipe, "--set", setting]), "reference.replace_share")


@pytest.mark.parametrize("recipe, settings, key", [
    ("demo", ["reference.likelihood=hybrid"], "reference.likelihood"),
    ("demo_block", ["reference.likelihood=hybrid"], "reference.likelihood"),
    ("demo_gemma", ["reference.likelihood=hybrid"], "reference.likelihood"),
    ("demo_llada21", ["reference.hybrid.mask_share=0.3"], "reference.hybrid"),
    ("demo_llada21", ["reference.likelihood=hybrid", "reference.hybrid.mask_share=1.5"], "reference.hybrid.mask_share"),
    ("demo_llada21", ["reference.likelihood=masked"], "reference.likelihood"),
], ids=["llada", "sdar", "gemma", "share-without-hybrid", "share-out-of-range", "masked-on-llada21"])
def test_the_hybrid_likelihood_choice_elsewhere_or_out_of_range_is_refused(tmp_path, recipe, settings, key):
    sets = [x for s in settings for x in ("--set", s)]
    refused(run_cli(["recipes", "check", recipe, *sets]), key)
    out = tmp_path / "t"
    refused(run_cli(["train", recipe, *sets, "-o", out]), key)
    assert not out.exists()


# =========================================================================== three-verdict labels
@pytest.mark.parametrize("setting, key", [
    ("online.math_answer.format=latex", "online.math_answer.format"),
    ("online.math_answer.format=", "online.math_answer.format"),
    ("online.math_answer.format=BOXED", "online.math_answer.format"),
    ("online.math_answer.field=", "online.math_answer.field"),
    ('online.math_answer.field=a"b', "online.math_answer.field"),
    ("online.math_answer.no_answer=maybe", "online.math_answer.no_answer"),
    ("online.math_answer.bogus=1", "online.math_answer.bogus"),
    ('online.unsure_judge=""', "online.unsure_judge"),
])
def test_recipes_check_refuses_bad_math_answer_and_unsure_settings(setting, key):
    refused(run_cli(["recipes", "check", "demo_online", "--set", "online.rule=math_answer", "--set", setting]), key)


def test_math_answer_settings_beside_another_verifier_are_refused(tmp_path, prompts):
    """label's --rule (or online's online.rule) chooses the verifier for the run: another's settings are unused."""
    out = tmp_path / "lab"
    refused(run_cli(["label", "demo_online", "--rule", "sort", "-o", out, "--prompts", prompts,
                     "--set", "online.math_answer.format=boxed"]), "online.math_answer", "--rule")
    assert not out.exists()
    refused(run_cli(["online", "demo_online", "-o", out, "--set", "online.math_answer.format=boxed"]), "online.math_answer")
    assert not out.exists()


@pytest.mark.parametrize("value", ["-1", "1e-9", " "])
@pytest.mark.parametrize("cmd", ["online", "parity", "serve"])
def test_a_bad_rule_timeout_is_refused_by_every_command_before_work(tmp_path, no_serving, cmd, value):
    out = tmp_path / "o"
    args = {"online": ["online", "demo_online", "-o", out], "parity": ["parity", "demo", "-o", out],
            "serve": ["serve", "demo", "--port", str(_free_port())]}[cmd]
    r = run_cli(args, env={"DLLM_ALIGN_RULE_TIMEOUT": value}, cwd=tmp_path)
    refused(r, "DLLM_ALIGN_RULE_TIMEOUT")
    assert not out.exists()


VERDICTS = {
    "text": "def f(prompt, completion, row):\n    return 'yes'\n",
    "number": "def f(prompt, completion, row):\n    return 2\n",
    "nan": "def f(prompt, completion, row):\n    return float('nan')\n",
    "bad reason": "def f(prompt, completion, row):\n    return ('desirable', 5)\n",
    "bad verdict": "def f(prompt, completion, row):\n    return ('maybe', None)\n",
    "three-tuple": "def f(prompt, completion, row):\n    return ('unsure', 'x', 1)\n",
}


@pytest.mark.parametrize("what", list(VERDICTS))
def test_a_user_verifier_returning_no_verdict_is_refused_naming_it(tmp_path, monkeypatch, prompts, what):
    n = abs(hash(what)) % 10**8
    (tmp_path / f"r6_verdict_{n}.py").write_text(VERDICTS[what])
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "lab"
    r = run_cli(["label", "demo", "-o", out, "--rule", f"r6_verdict_{n}:f", "--prompts", prompts, "--n", "1",
                 "--limit", "1"])
    refused(r, f"r6_verdict_{n}:f")
    assert not (out / "labelled.jsonl").exists() or (out / "labelled.jsonl").read_text() == ""


# =========================================================================== loading: sharded weights and the index
def _sharded(tmp: Path, base: str = "toy_sort_base", bf16: bool = True) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp / "m"
    shutil.copytree(ASSETS / base, folder)
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: (sd[k].to(torch.bfloat16) if bf16 else sd[k]).contiguous() for k in keys}, str(folder / fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if bf16:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["torch_dtype"] = "bfloat16"
        cfg.pop("dtype", None)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _missing_shard(folder: Path):
    (folder / "model-00002-of-00002.safetensors").unlink()


def _garbage_index(folder: Path):
    (folder / "model.safetensors.index.json").write_text("{not json")


def _index_without_map(folder: Path):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _index_map_not_a_dict(folder: Path):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))


def _index_outside(folder: Path):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    shutil.move(str(folder / "model-00002-of-00002.safetensors"), str(folder.parent / "outside.safetensors"))
    idx["weight_map"] = {k: ("../outside.safetensors" if v.startswith("model-00002") else v) for k, v in idx["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))


def _index_absolute(folder: Path):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    target = str(folder / "model-00002-of-00002.safetensors")
    idx["weight_map"] = {k: (target if v.startswith("model-00002") else v) for k, v in idx["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))


def _index_wrong_file(folder: Path):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: "model-00001-of-00002.safetensors" for k in idx["weight_map"]}
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))


def _shard_is_a_folder(folder: Path):
    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").mkdir()


SHARDS = [(_missing_shard, "model-00002-of-00002.safetensors"), (_garbage_index, "model.safetensors.index.json"),
          (_index_without_map, "model.safetensors.index.json"), (_index_map_not_a_dict, "model.safetensors.index.json"),
          (_index_outside, "outside.safetensors"), (_index_absolute, "model.safetensors.index.json"),
          (_index_wrong_file, "missing"), (_shard_is_a_folder, "model-00002-of-00002.safetensors")]


@pytest.mark.parametrize("change, needle", SHARDS, ids=[c.__name__.strip("_") for c, _ in SHARDS])
def test_a_damaged_sharded_bf16_folder_is_refused_naming_the_file(tmp_path, prompts, change, needle):
    folder = _sharded(tmp_path)
    change(folder)
    out = tmp_path / "g"
    r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--model", folder, "--limit", "1"])
    refused(r, needle)
    assert not out.exists()


def test_an_intact_sharded_bf16_folder_loads(tmp_path, prompts):
    folder = _sharded(tmp_path)
    out = tmp_path / "g"
    r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--model", folder, "--limit", "1",
                 "--gen-length", "8", "--set", "generate.block_length=8", "--set", "generate.steps=8"])
    assert r.code == 0, r.err


# =========================================================================== checkpoints, resume and doctor
def test_resume_without_a_checkpoint_folder_is_refused_leaving_the_folder(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    (out / "checkpoints" / "step-2" / "state.json").write_text("{not json")
    before = snapshot(out)
    r = run_cli(["train", "demo", "-o", out, "--resume"])
    refused(r, code=(1, 2))
    assert snapshot(out) == before


def test_a_lora_adapter_folder_without_its_weights_is_refused_naming_it(tmp_path, prompts):
    folder = tmp_path / "final"
    shutil.copytree(ASSETS / "toy_sort_base", folder)
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                            "base_model_name_or_path": str(ASSETS / "toy_sort_base")}))
    (folder / "model.safetensors").unlink()
    out = tmp_path / "g"
    refused(run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--model", folder]), "final")
    assert not out.exists()


@pytest.mark.parametrize("make, needle", [
    (lambda t: t / "nonexistent.yaml", "nonexistent.yaml"),
    (lambda t: (t / "bad.yaml").write_text("{not: [yaml") and t / "bad.yaml", "bad.yaml"),
    (lambda t: (t / "zero.yaml").write_text("num_processes: 0\ndistributed_type: MULTI_GPU\n") and t / "zero.yaml", "num_processes"),
    (lambda t: (t / "neg.yaml").write_text("num_processes: -4\n") and t / "neg.yaml", "num_processes"),
    (lambda t: (t / "list.yaml").write_text("- 1\n- 2\n") and t / "list.yaml", "list.yaml"),
    (lambda t: (t / "dt.yaml").write_text("distributed_type: WARP_DRIVE\n") and t / "dt.yaml", "distributed_type"),
    (lambda t: t, "cfg"),
], ids=["missing", "garbage", "zero-processes", "negative-processes", "a-list", "unknown-type", "a-folder"])
def test_doctor_refuses_bad_launch_settings_writing_nothing(tmp_path, make, needle):
    cfgdir = tmp_path / "cfg"
    cfgdir.mkdir()
    cfg = make(cfgdir)
    before = snapshot(tmp_path)
    r = run_cli(["doctor", "demo", "--config", cfg, "-o", tmp_path / "run"], cwd=tmp_path)
    refused(r, needle)
    assert snapshot(tmp_path) == before
