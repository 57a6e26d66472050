"""A scripted OpenAI-compatible chat-completions server for the judging tests.

Real HTTP on 127.0.0.1 (``http.server`` in a thread, HTTP/1.1 keep-alive). The
tests give answers that carry markers ``<<A-id>>`` (model A) and ``<<B-id>>``
(model B); the server finds them in the rendered judging prompt, so it knows the
prompt id and the order (which marker comes first) whatever the template.

* ``verdicts[(model, id, order)]`` is the verdict it answers ("A", "B", "C");
  missing entries answer ``default_verdict`` (a position-biased judge: "A").
* ``faults[(model, id, order)]`` is a list of actions spent one per request
  before the normal answer: "429" (Retry-After: 1), "429ms" (retry-after-ms: 30),
  "500", "503", "slow" (answers after ``slow_seconds``), "drop" (closes the
  connection without answering), "garbage" (a reply with no verdict), "badjson",
  "302", "400", "401", "404". The action "forever-garbage" never runs out.
* ``echo_auth``: replies and error messages quote the Authorization header
  back (as some servers do), to test that the key never reaches a file or log.
* Every request is logged (model, id, order, action, time); ``answered`` counts
  normal answers; with ``hold_after = N`` the server stops answering after N
  normal answers until ``release`` is set; with ``fail_after = N`` it answers
  503 to every request after N normal answers.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MARK_RE = re.compile(r"<<([AB])-([^>]+)>>")


def answer(model: str, pid: str) -> str:
    """The completion text the tests give to model ``model`` ("A"/"B") for prompt ``pid``."""
    return f"Answer <<{model}-{pid}>>."


class JudgeServer:
    def __init__(self, api_key: str | None = "sk-test", *, default_verdict: str = "A", slow_seconds: float = 1.2,
                 echo_auth: bool = False):
        self.api_key = api_key
        self.verdicts: dict[tuple[str, str, str], str] = {}
        self.faults: dict[tuple[str, str, str], list[str]] = {}
        self.default_verdict = default_verdict
        self.slow_seconds = slow_seconds
        self.echo_auth = echo_auth
        self.redirect_to = "http://elsewhere.invalid/v1/chat/completions"  # where a "302" points
        self.log: list[dict] = []
        self.answered = 0
        self.hold_after: int | None = None
        self.fail_after: int | None = None
        self.held = threading.Event()  # set once a request is being held
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.contents: list[str] = []
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # keep test output clean
                pass

            def _send(self, status: int, obj, headers: dict | None = None) -> None:
                body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                req = json.loads(self.rfile.read(n))
                model = req["model"]
                content = req["messages"][-1]["content"]
                marks = MARK_RE.findall(content)
                pid = marks[0][1] if marks else "?"
                order = (marks[0][0] + marks[1][0]) if len(marks) >= 2 else "?"
                key = (model, pid, order)
                auth = self.headers.get("Authorization")
                with srv.lock:
                    srv.paths.append(self.path)
                    srv.contents.append(content)
                    queue = srv.faults.get(key, [])
                    if queue and queue[0] == "forever-garbage":
                        action = "garbage"
                    else:
                        action = queue.pop(0) if queue else "ok"
                    if action == "ok" and srv.fail_after is not None and srv.answered >= srv.fail_after:
                        action = "503"
                    if srv.api_key is not None and auth != f"Bearer {srv.api_key}":
                        action = "401"
                    hold = action == "ok" and srv.hold_after is not None and srv.answered >= srv.hold_after
                    srv.log.append({"model": model, "id": pid, "order": order, "action": "held" if hold else action, "t": time.monotonic()})
                if hold:
                    srv.held.set()
                    srv.release.wait(30)
                    self.close_connection = True
                    return
                echo = f" (you sent {auth})" if srv.echo_auth else ""  # a server that quotes the key back
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if action == "401":
                    return self._send(401, {"error": {"message": f"Incorrect API key provided: {auth}", "code": "invalid_api_key"}})
                if action == "404":
                    return self._send(404, {"error": {"message": f"The model {model} does not exist"}})
                if action == "302":
                    return self._send(302, {}, {"Location": srv.redirect_to})
                if action == "400":
                    return self._send(400, {"error": {"message": "context too long" + echo}})
                if action == "429":
                    return self._send(429, {"error": {"message": "rate limited" + echo}}, {"Retry-After": "1"})
                if action == "429ms":
                    return self._send(429, {"error": {"message": "rate limited"}}, {"retry-after-ms": "30"})
                if action in ("500", "503"):
                    return self._send(int(action), {"error": {"message": "server error" + echo}})
                if action == "drop":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if action == "badjson":
                    return self._send(200, b"<html>not json")
                if action == "slow":
                    time.sleep(srv.slow_seconds)
                if action == "garbage":
                    text = "Both answers have merit; I cannot decide."
                else:
                    v = srv.verdicts.get(key, srv.default_verdict)
                    text = f"Comparison done. [[{v}]]"
                    if srv.echo_auth:
                        text = f"(you sent {auth}) " + text
                    with srv.lock:
                        srv.answered += 1
                self._send(200, {
                    "id": "chatcmpl-test", "object": "chat.completion", "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(content) // 4, "completion_tokens": 5, "total_tokens": len(content) // 4 + 5},
                })

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def requests_for(self, **match) -> list[dict]:
        with self.lock:
            return [r for r in self.log if all(r[k] == v for k, v in match.items())]

    def __enter__(self) -> "JudgeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
