"""A scripted OpenAI-compatible chat-completions server for the judging tests.

Real HTTP on 127.0.0.1 (``http.server`` in a thread, HTTP/1.1 keep-alive). The
tests give answers that carry markers ``<<A-id>>`` (model A) and ``<<B-id>>``
(model B); the server finds them in the rendered judging prompt, so it knows the
prompt id and the order (which marker comes first) whatever the template.

* ``verdicts[(model, id, order)]`` is the verdict it answers ("A", "B", "C");
  missing entries answer ``default_verdict`` (a position-biased judge: "A").
* ``faults[(model, id, order)]`` is a list of actions spent one per request
  before the normal answer: "429" (Retry-After: 1), "429ms" (retry-after-ms: 30), "429-hour"
  (Retry-After: 3600), "429-year" (Retry-After: an HTTP date a year ahead),
  "500", "503", "slow" (answers after ``slow_seconds``), "drop" (closes the
  connection without answering), "garbage" (a reply with no verdict), "badjson",
  "302", "400", "401", "404". The action "forever-garbage" never runs out.
* ``echo_auth``: replies and error messages quote the Authorization header
  back (as some servers do), to test that the key never reaches a file or log.
* Every request is logged (model, id, order, action, time); ``answered`` counts
  normal answers; with ``hold_after = N`` the server stops answering after N
  normal answers until ``release`` is set; with ``fail_after = N`` it answers
  503 to every request after N normal answers.
* Transport faults (class 3 of the hostile-input round), also as chat actions:
  "endless" (200, then a body that never ends, one byte every 50 ms), "huge"
  (200, then 64 MiB of body as fast as it goes), "slowheaders" (a status line,
  then header bytes one every 50 ms, never finished), "404" shows the path asked for.

Files and batches (the Batch API), on the same server and key:

* ``POST /v1/files`` (multipart upload, kept in ``uploads``), ``GET /v1/files``
  (newest first, ``?purpose=``), ``GET /v1/files/ID/content``;
* ``POST /v1/batches``, ``GET /v1/batches`` (newest first), ``GET /v1/batches/ID``.
  A batch is ``validating`` when created, ``in_progress`` on the next retrieve,
  and finishes on the ``batch_polls``-th retrieve: every line is answered like a
  live request (same ``verdicts``), logged in ``batch_log``. ``batch_faults[(model,
  id, order)]`` gives a line "error" (an error-file line), "garbage" (a reply
  with no verdict) or "500" (a non-200 response line); ``expire_after = k``
  answers only k lines and expires the batch (the rest: ``batch_expired`` in the
  error file); ``fail_batches = n`` fails the next n batches at validation.
* ``route_faults[ROUTE]`` (ROUTE = "files.create", "files.list",
  "files.content", "batches.create", "batches.list", "batches.retrieve") is a
  list of actions spent one per request: "429", "500", "drop", "act-then-hang"
  (the server does what was asked, then never answers: the client times out).
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
        self.answer_as: dict[str, str] = {}  # model asked -> model the reply names (server-side routing)
        self.absolute = None  # (first message, number of messages) -> reply text, for absolute (yes/no) judging
        self.fail_after: int | None = None
        self.long_wait_after = 0  # a "429-hour" / "429-year" answer waits until this many requests have arrived (10 s at most)
        self.held = threading.Event()  # set once a request is being held
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.contents: list[str] = []
        self.headers: list[dict] = []  # every chat request's headers
        self.bodies: list[dict] = []   # and its JSON body
        self.reasoning_models: set[str] = set()  # models that reject max_tokens and temperature, like o-series
        # files and batches
        self.files: dict[str, dict] = {}
        self.uploads: list[tuple[str, bytes]] = []
        self.batches: dict[str, dict] = {}
        self.batch_log: list[tuple[str, str, str]] = []
        self.api_log: list[tuple[str, str]] = []  # (route, action) of every files / batches request
        self.route_faults: dict[str, list[str]] = {}
        self.batch_faults: dict[tuple[str, str, str], list[str]] = {}
        self.batch_polls = 2
        self.expire_after: int | None = None
        self.fail_batches = 0
        self._n = 0
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            wbufsize = 1 << 16  # headers and body leave in one write (unbuffered, Nagle delays the body ~40 ms)

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

            def _drop(self) -> None:
                """Close the connection without answering."""
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _authorized(self) -> bool:
                return srv.api_key is None or self.headers.get("Authorization") == f"Bearer {srv.api_key}"

            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path.startswith("/v1/files/") and path.endswith("/content"):
                    return self._api("files.content", lambda: srv._file_content(path.split("/")[3]))
                if path == "/v1/files":
                    return self._api("files.list", lambda: srv._list(srv.files, query))
                if path == "/v1/batches":
                    return self._api("batches.list", lambda: srv._list(srv.batches, ""))
                if path.startswith("/v1/batches/"):
                    return self._api("batches.retrieve", lambda: srv._retrieve(path.split("/")[3]))
                return self._send(404, {"error": {"message": f"no route {path}"}})

            def _api(self, route: str, fn):
                with srv.lock:
                    queue = srv.route_faults.get(route, [])
                    action = queue.pop(0) if queue else "ok"
                    if not self._authorized():
                        action = "401"
                    srv.api_log.append((route, action))
                if action == "401":
                    return self._send(401, {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}})
                if action == "429":
                    return self._send(429, {"error": {"message": "rate limited"}}, {"Retry-After": "0.05"})
                if action == "500":
                    return self._send(500, {"error": {"message": "server error"}})
                if action == "404":  # e.g. a batch the server no longer knows
                    return self._send(404, {"error": {"message": "No batch found with that id", "code": "not_found"}})
                if action == "drop":
                    return self._drop()
                with srv.lock:
                    status, obj = fn()
                if action == "act-then-hang":  # the server acts, then the answer never comes
                    srv.release.wait(30)
                    self.close_connection = True
                    return
                if isinstance(obj, bytes):
                    try:
                        self.send_response(status)
                        self.send_header("Content-Type", "application/octet-stream")
                        self.send_header("Content-Length", str(len(obj)))
                        self.end_headers()
                        self.wfile.write(obj)
                    except (BrokenPipeError, ConnectionResetError):
                        self.close_connection = True
                    return
                return self._send(status, obj)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                if self.path == "/v1/files":
                    return self._api("files.create", lambda: srv._upload(self.headers.get("Content-Type", ""), raw))
                if self.path == "/v1/batches":
                    return self._api("batches.create", lambda: srv._create_batch(json.loads(raw), self.headers.get("Authorization")))
                req = json.loads(raw)
                model = req["model"]
                content = req["messages"][0]["content"]  # the judging prompt (a re-ask appends a follow-up)
                marks = MARK_RE.findall(content)
                pid = marks[0][1] if marks else "?"
                order = (marks[0][0] + marks[1][0]) if len(marks) >= 2 else "?"
                key = (model, pid, order)
                auth = self.headers.get("Authorization")
                with srv.lock:
                    srv.paths.append(self.path)
                    srv.contents.append(content)
                    srv.headers.append(dict(self.headers.items()))
                    srv.bodies.append(req)
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
                if action in ("429-hour", "429-year"):  # a server asking for an hour, or (as an HTTP date) a year
                    t0 = time.monotonic()
                    while len(srv.log) < srv.long_wait_after and time.monotonic() - t0 < 10:
                        time.sleep(0.01)
                    after = "3600" if action == "429-hour" else time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 365 * 86400))
                    return self._send(429, {"error": {"message": "rate limited" + echo}}, {"Retry-After": after})
                if action == "429ms":
                    return self._send(429, {"error": {"message": "rate limited"}}, {"retry-after-ms": "30"})
                if action in ("500", "503"):
                    return self._send(int(action), {"error": {"message": "server error" + echo}})
                if action == "drop":
                    return self._drop()
                if model in srv.reasoning_models:
                    bad = "max_tokens" if "max_tokens" in req else "temperature" if "temperature" in req else None
                    if bad:
                        return self._send(400, {"error": {"message": f"Unsupported parameter: '{bad}' is not supported with this model.",
                                                          "type": "invalid_request_error", "param": bad, "code": "unsupported_parameter"}})
                if action == "badjson":
                    return self._send(200, b"<html>not json")
                if action in ("endless", "huge"):
                    return self._stream_forever(action)
                if action == "slowheaders":
                    return self._trickle_headers()
                if action == "slow":
                    time.sleep(srv.slow_seconds)
                finish = "stop"
                if srv.absolute is not None:  # a yes/no judge: the verdict is the server's function of the request
                    text = srv.absolute(content, len(req["messages"]))
                elif action == "garbage":
                    text = "Both answers have merit; I cannot decide."
                elif action == "cutoff":  # the token cap ended the reply before its verdict
                    text, finish = "Let me weigh both answers point by point. First, the", "length"
                else:
                    v = srv.verdicts.get(key, srv.default_verdict)
                    text = f"Comparison done. [[{v}]]"
                    if srv.echo_auth:
                        text = f"(you sent {auth}) " + text
                    with srv.lock:
                        srv.answered += 1
                self._send(200, {
                    "id": "chatcmpl-test", "object": "chat.completion", "model": srv.answer_as.get(model, model),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                    "usage": {"prompt_tokens": len(content) // 4, "completion_tokens": 5, "total_tokens": len(content) // 4 + 5},
                })

            def _trickle_headers(self) -> None:
                """A status line, then header bytes one every 50 ms, never finishing them."""
                self.close_connection = True
                try:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    self._trickle()
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass

            def _trickle(self) -> None:
                """One byte every 50 ms for up to a minute (or until the server is released)."""
                t0 = time.monotonic()
                while time.monotonic() - t0 < 60 and not srv.release.is_set():
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)

            def _stream_forever(self, action: str) -> None:
                """200 and headers, then a body that never ends ("endless": a byte every
                50 ms) or is enormous ("huge": 64 MiB as fast as it goes)."""
                self.close_connection = True
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()
                    self.wfile.write(b'{"id": "x", "choices": [{"message": {"content": "')
                    if action == "huge":
                        chunk = b"x" * (1 << 20)
                        for _ in range(64):
                            self.wfile.write(chunk)
                    else:
                        self._trickle()
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # ------------------------------------------------------------------ files and batches (called under self.lock)
    def _new_id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}-{self._n:04d}"

    def _upload(self, content_type: str, raw: bytes):
        boundary = content_type.partition("boundary=")[2].strip('"').encode()
        fields: dict[str, tuple[str | None, bytes]] = {}
        for part in raw.split(b"--" + boundary):
            head, sep, body = part.partition(b"\r\n\r\n")
            if not sep:
                continue
            m = re.search(rb'name="([^"]+)"', head)
            fn = re.search(rb'filename="([^"]*)"', head)
            if m:
                fields[m.group(1).decode()] = (fn.group(1).decode() if fn else None, body[:-2] if body.endswith(b"\r\n") else body)
        if "file" not in fields or "purpose" not in fields:
            return 400, {"error": {"message": "file and purpose are required"}}
        name, data = fields["file"]
        fid = self._new_id("file")
        self.files[fid] = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()), "filename": name,
                           "purpose": fields["purpose"][1].decode(), "status": "processed", "data": data}
        self.uploads.append((name, data))
        return 200, self._public(self.files[fid])

    @staticmethod
    def _public(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("data", "polls", "lines", "auth")}

    def _list(self, table: dict, query: str):
        purpose = dict(p.partition("=")[::2] for p in query.split("&") if p).get("purpose")
        items = [self._public(v) for v in reversed(list(table.values())) if purpose is None or v.get("purpose") == purpose]
        return 200, {"object": "list", "data": items, "has_more": False}

    def _file_content(self, fid: str):
        if fid not in self.files:
            return 404, {"error": {"message": f"no file {fid}"}}
        return 200, self.files[fid]["data"]

    def _create_batch(self, req: dict, auth: str | None = None):
        fid = req.get("input_file_id")
        if fid not in self.files:
            return 400, {"error": {"message": f"no file {fid}"}}
        bid = self._new_id("batch")
        lines = [json.loads(x) for x in self.files[fid]["data"].decode().splitlines() if x.strip()]
        status = "validating"
        self.batches[bid] = {"id": bid, "object": "batch", "endpoint": req["endpoint"], "input_file_id": fid,
                             "completion_window": req["completion_window"], "created_at": int(time.time()), "status": status,
                             "metadata": req.get("metadata"), "output_file_id": None, "error_file_id": None, "errors": None,
                             "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "polls": 0, "lines": lines,
                             "auth": auth}
        if self.fail_batches > 0:
            self.fail_batches -= 1
            self.batches[bid].update(status="failed", errors={"object": "list", "data": [
                {"code": "invalid_request", "message": "the batch failed validation", "line": 1}]})
        return 200, self._public(self.batches[bid])

    def _retrieve(self, bid: str):
        b = self.batches.get(bid)
        if b is None:
            return 404, {"error": {"message": f"no batch {bid}"}}
        if b["status"] in ("validating", "in_progress"):
            b["polls"] += 1
            b["status"] = "in_progress"
            if b["polls"] >= self.batch_polls:
                self._finish(b)
        return 200, self._public(b)

    def _finish(self, b: dict) -> None:
        out, err = [], []
        for i, line in enumerate(b["lines"]):
            body = line["body"]
            content = body["messages"][-1]["content"]
            marks = MARK_RE.findall(content)
            key = (body["model"], marks[0][1] if marks else "?", (marks[0][0] + marks[1][0]) if len(marks) >= 2 else "?")
            cid = line["custom_id"]
            if self.expire_after is not None and i >= self.expire_after:
                err.append({"id": f"req-{i}", "custom_id": cid, "response": None,
                            "error": {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}})
                continue
            self.batch_log.append(key)
            queue = self.batch_faults.get(key, [])
            action = queue.pop(0) if queue else "ok"
            if action == "error":
                err.append({"id": f"req-{i}", "custom_id": cid, "response": None, "error": {"code": "server_error", "message": "internal error"}})
                continue
            if action == "500":
                err.append({"id": f"req-{i}", "custom_id": cid, "response": {"status_code": 500, "body": {"error": {"message": "server error"}}}, "error": None})
                continue
            finish = "length" if action == "cutoff" else "stop"
            if self.absolute is not None:  # a yes/no judge, as for live requests
                text = self.absolute(content, len(body["messages"]))
            elif action == "garbage":
                text = "Both have merit."
            elif action == "cutoff":
                text = "Let me weigh both answers point by point. First, the"
            else:
                text = f"Comparison done. [[{self.verdicts.get(key, self.default_verdict)}]]"
            if self.echo_auth:
                text = f"(you sent {b['auth']}) " + text

            def answer(t, n=i, f=finish):
                return {"id": f"req-{n}", "custom_id": cid, "error": None, "response": {"status_code": 200, "request_id": f"r{n}", "body": {
                    "id": "chatcmpl-b", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": t}, "finish_reason": f}],
                    "usage": {"prompt_tokens": len(content) // 4, "completion_tokens": 5, "total_tokens": len(content) // 4 + 5}}}}

            if action == "error-then-ok":  # the error file names the id, and the output file answers it
                err.append({"id": f"req-{i}-e", "custom_id": cid, "response": None, "error": {"code": "server_error", "message": "transient"}})
            out.append(answer(text))
            if action == "dup-conflict":  # the same custom_id answered twice, differently
                other = {"A": "B", "B": "A", "C": "A"}[self.verdicts.get(key, self.default_verdict)]
                out.append(answer(f"On reflection. [[{other}]]"))
            elif action == "dup-same":
                out.append(answer(text))
        for rows, field in ((out, "output_file_id"), (err, "error_file_id")):
            if rows:
                fid = self._new_id("file")
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                self.files[fid] = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                                   "filename": f"{b['id']}_{field}.jsonl", "purpose": "batch_output", "status": "processed", "data": data}
                b[field] = fid
        b["status"] = "expired" if self.expire_after is not None else "completed"
        self.expire_after = None  # one batch expires, the next one runs
        b["request_counts"] = {"total": len(b["lines"]), "completed": len(out), "failed": len(err)}

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
