"""``judge --batch``: the OpenAI Batch API (upload a JSONL of requests, create a
batch, poll, download results and errors), resumable at every stage.

Every batch this run folder ever made is recorded in ``DIR/batch_state.json``
(written atomically) with its stage: ``written`` (the request file is on disk),
``uploaded`` (the server holds it: file id), ``created`` (the batch exists:
batch id) and ``done`` (its results are in the cache). A run killed anywhere
continues from the recorded stage. The two steps that make something on the
server (upload, create) are looked up before they are repeated: a killed upload
is found by its file name (unique to this batch record: its name, the hash of
its content and a random tag, all in the state before the upload starts), and
a killed create by the batch whose input file is ours. So a request is never in two
live batches, and a finished judgement (cached) is never sent again.

The request files (``DIR/batches/NAME.input.jsonl``) hold model, messages and
sampling parameters, never the key; downloaded results are scrubbed of it
before they are written (``NAME.output.jsonl``, ``NAME.errors.jsonl``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from dllm_align.core import faults
from dllm_align.core.console import info, progress, warn
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.core.io import atomic_write_json, atomic_write_text
from dllm_align.judge.cache import CacheWriter, Task
from dllm_align.judge.client import Cancelled, ChatClient, FatalApiError

STATE = "batch_state.json"
FOLDER = "batches"
MAX_REQUESTS = 50_000  # the Batch API's limits per file: requests,
MAX_BYTES = 190 << 20  # and size (200 MB), with a margin
ENDPOINT = "/v1/chat/completions"
TERMINAL = ("completed", "expired", "failed", "cancelled")
LOOKUP_LIMIT = 2000  # listing the account's files / batches stops here


def request_line(task: Task, params: Mapping[str, Any]) -> dict:
    return {"custom_id": task.key, "method": "POST", "url": ENDPOINT,
            "body": {"model": task.judge, "messages": [{"role": "user", "content": task.content}], **params}}


def pending_batches(out: Path) -> dict[str, list[str]]:
    """``{name: keys}`` of the batches in ``out`` that an earlier run left unfinished."""
    path = out / STATE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        return {b["name"]: list(b["keys"]) for b in state["batches"] if b["status"] != "done"}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return {}  # a damaged state file is reported by --batch, which reads it


class BatchRunner:
    def __init__(self, client: ChatClient, out: Path, params: Mapping[str, Any], writer: CacheWriter,
                 parse: Callable[[str], Optional[str]], *, poll_interval: float, poll_max: float, stop: threading.Event):
        self.client, self.out, self.params, self.writer, self.parse = client, out, dict(params), writer, parse
        self.poll_interval, self.poll_max, self.stop = poll_interval, poll_max, stop
        self.state_path = out / STATE
        self.folder = out / FOLDER
        self.state = self._load_state()
        self.submitted = 0  # requests put into new batches by this run
        # Requests a result file answered more than once with different verdicts: a fault of the server's
        # batch, not of the request, so they are decided by batches alone (never re-asked live): one new
        # batch for all of them, and what still conflicts or fails there is a failure with its reason.
        self.conflicted: dict[str, str] = {}
        self.settled: set[str] = set()  # keys the batches decided (returned failed; not to be retried live)

    # ------------------------------------------------------------------ state
    def _load_state(self) -> dict:
        if not self.state_path.exists():
            return {"version": 1, "batches": []}
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            assert isinstance(state, dict) and isinstance(state.get("batches"), list)
        except (ValueError, AssertionError, UnicodeDecodeError):
            raise UserError(f"{self.state_path}: damaged batch state", hint="it records the batches of this folder; "
                            "move it away only if none of them is still running on the server")
        return state

    def _save(self) -> None:
        atomic_write_json(self.state_path, self.state)

    # ------------------------------------------------------------------ the run
    def run(self, tasks: Mapping[str, Task], rounds: int) -> dict[str, str]:
        """Obtain every judgement of ``tasks`` not cached yet through batches: first
        finish the batches earlier runs left, then submit what is still missing, and
        what failed in a batch again, up to ``rounds`` new batches deep. Returns
        ``{key: why}`` for the judgements still missing."""
        why: dict[str, str] = {}
        for b in self.state["batches"]:
            if b["status"] != "done":
                info(f"Continuing {b['name']} ({len(b['keys'])} requests, stage: {b['status']})")
                why.update(self._drive(b))
        for _ in range(rounds):
            todo = [t for k, t in tasks.items() if k not in self.writer.cache and k not in self.conflicted]
            if not todo:
                break
            for chunk in self._chunks(todo):
                b = self._write(chunk)
                why.update(self._drive(b))
        again = {k: m for k, m in self.conflicted.items() if k in tasks and k not in self.writer.cache}
        if again:
            info(f"Submitting the {len(again)} request(s) whose results conflicted in one new batch (not asked live)")
            self.settled = set(again)
            for chunk in self._chunks([tasks[k] for k in again]):
                b = self._write(chunk)
                for k, msg in self._drive(b).items():
                    why[k] = f"{again[k]}; in the new batch: {msg}" if k in again else msg
        return {k: why.get(k, "not judged") for k in tasks if k not in self.writer.cache}

    def _chunks(self, todo: list[Task]) -> list[list[Task]]:
        """One batch per judge (the Batch API takes one model per file), each within
        MAX_REQUESTS lines and MAX_BYTES."""
        chunks: list[list[Task]] = []
        for judge in dict.fromkeys(t.judge for t in todo):
            cur, size = [], 0
            for t in (t for t in todo if t.judge == judge):
                n = len(json.dumps(request_line(t, self.params), ensure_ascii=False).encode("utf-8")) + 1
                if cur and (len(cur) == MAX_REQUESTS or size + n > MAX_BYTES):
                    chunks.append(cur)
                    cur, size = [], 0
                cur.append(t)
                size += n
            if cur:
                chunks.append(cur)
        return chunks

    def _write(self, tasks: list[Task]) -> dict:
        """Stage ``written``: the request file on disk, recorded in the state."""
        self.folder.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(request_line(t, self.params), ensure_ascii=False) + "\n" for t in tasks)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        name = f"batch-{len(self.state['batches']) + 1:04d}"
        atomic_write_text(self.folder / f"{name}.input.jsonl", text)
        b = {"name": name, "status": "written", "input": f"{FOLDER}/{name}.input.jsonl", "sha256": digest,
             "bytes": len(text.encode("utf-8")), "upload_name": f"dllm-align-{name}-{digest[:16]}-{secrets.token_hex(4)}.jsonl",
             "file_id": None, "batch_id": None, "keys": {t.key: [t.judge, t.id, t.order] for t in tasks}}
        self.state["batches"].append(b)
        self._save()
        self.submitted += len(tasks)
        return b

    def _drive(self, b: dict) -> dict[str, str]:
        c = self.client
        # Each attempt of an upload or a create first looks for what an earlier attempt
        # (killed, or timed out after the server had acted) may have made.
        if b["status"] == "written":
            faults.at("kill_at", "batch_before_upload")
            data = (self.out / b["input"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != b["sha256"]:
                raise RunFailure(f"{self.out / b['input']} changed since it was written; not uploading it")

            def upload(sdk):
                found = self._find_upload(sdk, b)
                if found is not None:
                    return found
                fid = sdk.files.create(file=(b["upload_name"], data, "application/jsonl"), purpose="batch").id
                faults.at("kill_at", "batch_after_upload")  # uploaded, not yet recorded: the next run must find it
                return fid

            b.update(file_id=c.call(upload, "file upload"), status="uploaded")
            self._save()
        if b["status"] == "uploaded":
            def create(sdk):
                found = self._find_batch(sdk, b["file_id"])
                if found is not None:
                    return found
                bid = sdk.batches.create(input_file_id=b["file_id"], endpoint=ENDPOINT, completion_window="24h",
                                         metadata={"dllm_align": b["name"]}).id
                faults.at("kill_at", "batch_after_create")  # created, not yet recorded: the next run must find it
                return bid

            bid = c.call(create, "batch create")
            b.update(batch_id=bid, status="created")
            self._save()
            info(f"Submitted {b['name']} ({len(b['keys'])} requests) as {bid}")
        if b["status"] == "created":
            batch = self._poll(b)
            return self._collect(b, batch)
        return {}

    @staticmethod
    def _find_upload(sdk, b: dict) -> Optional[str]:
        for i, f in enumerate(sdk.files.list(purpose="batch")):
            if i >= LOOKUP_LIMIT:
                break
            if f.filename == b["upload_name"] and f.bytes == b["bytes"]:
                return f.id
        return None

    @staticmethod
    def _find_batch(sdk, file_id: str) -> Optional[str]:
        for i, bt in enumerate(sdk.batches.list(limit=100)):
            if i >= LOOKUP_LIMIT:
                break
            if bt.input_file_id == file_id:
                return bt.id
        return None

    def _poll(self, b: dict):
        delay, last_status, polls = self.poll_interval, None, 0
        with progress(f"{b['name']}", len(b["keys"]), unit="requests") as bar:
            done_shown = 0
            while True:
                try:
                    batch = self.client.call(lambda sdk: sdk.batches.retrieve(b["batch_id"]), "batch retrieve")
                except FatalApiError as e:
                    if "HTTP 404" not in str(e):
                        raise
                    # Expired or deleted on the server: every rerun would get the same 404. Marked lost
                    # here, so the next run submits the requests it still lacks in a new batch.
                    b.update(status="done", server_status="lost", answered=0, failed=len(b["keys"]))
                    self._save()
                    raise FatalApiError(f"{b['name']}: the server no longer knows batch {b['batch_id']} (HTTP 404: expired or "
                                        f"deleted); it is marked lost here: run the same command again to submit its "
                                        f"{len(b['keys'])} request(s) in a new batch (judgements already cached are kept)") from None
                polls += 1
                if polls == 2:
                    faults.at("kill_at", "batch_polling")
                rc = batch.request_counts
                done = (rc.completed + rc.failed) if rc is not None else 0
                if done > done_shown:
                    bar.advance(done - done_shown)
                    done_shown = done
                bar.update(f"{batch.status}")
                if batch.status != last_status:
                    last_status = batch.status
                    counts = f" ({rc.completed} done, {rc.failed} failed of {rc.total})" if rc is not None else ""
                    info(f"{b['name']} ({b['batch_id']}): {batch.status}{counts}")
                if batch.status in TERMINAL:
                    return batch
                if self.stop.wait(delay):
                    raise Cancelled()
                delay = min(self.poll_max, delay * 1.5)

    def _download(self, b: dict, file_id: Optional[str], kind: str) -> list[dict]:
        """The lines of a result file, kept under DIR/batches (scrubbed) so a rerun
        after a kill does not download it again."""
        if not file_id:
            return []
        path = self.folder / f"{b['name']}.{kind}.jsonl"
        if not path.exists():
            raw = self.client.call(lambda sdk: sdk.files.content(file_id).content, f"download of {kind} file")
            atomic_write_text(path, self.client.scrub(raw.decode("utf-8", "replace")))
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
                rows.append(obj)
        return rows

    def _read_result(self, b: dict, row: dict):
        """One result line: ``(verdict, reply, usage)``, or why it gives no verdict."""
        resp, err = row.get("response") or {}, row.get("error")
        body = resp.get("body") if isinstance(resp, dict) else None
        status = resp.get("status_code") if isinstance(resp, dict) else None
        if err or status != 200 or not isinstance(body, dict):
            e = err if isinstance(err, dict) else (body or {}).get("error") if isinstance(body, dict) else None
            msg = e.get("message") if isinstance(e, dict) else None
            code = e.get("code") if isinstance(e, dict) else None
            return self.client.scrub(f"batch {b['batch_id']}: " + (f"HTTP {status}: " if status else "")
                                     + (f"{code}: " if code else "") + str(msg or "error"))[:300]
        try:
            choice = body["choices"][0]
            msg = choice["message"]
            text = msg.get("content") if isinstance(msg.get("content"), str) else ""
        except (KeyError, IndexError, TypeError, AttributeError):
            return f"batch {b['batch_id']}: a result that is not a chat completion"
        text = self.client.scrub(text)
        verdict = self.parse(text)
        if verdict is None:
            snippet = " ".join(text.split())[-120:]
            cut = " (cut off at the token cap, finish_reason 'length': raise --max-tokens)" if choice.get("finish_reason") == "length" else ""
            return f"batch {b['batch_id']}: no [[A]]/[[B]]/[[C]] verdict{cut} (reply ends: {snippet!r})"
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        return verdict, text, usage

    def _collect(self, b: dict, batch) -> dict[str, str]:
        """Cache every answered request of a finished batch; return why the others failed."""
        why: dict[str, str] = {}
        ok = 0
        rows = self._download(b, batch.output_file_id, "output")
        faults.at("kill_at", "batch_downloading")  # results on disk, not yet in the cache
        rows += self._download(b, batch.error_file_id, "errors")
        by_key: dict[str, list[dict]] = {}
        for row in rows:  # an id may appear more than once (an error line and an answer; or two answers)
            by_key.setdefault(row["custom_id"], []).append(row)
        conflicts = 0
        for key, key_rows in by_key.items():
            meta = b["keys"].get(key)
            if meta is None or key in self.writer.cache:
                continue
            answers, problems = [], []
            for row in key_rows:
                got = self._read_result(b, row)
                (answers if isinstance(got, tuple) else problems).append(got)
            verdicts = {a[0] for a in answers}
            if len(verdicts) > 1:
                # The same request answered twice with different verdicts: neither is taken (first-wins
                # would silently move the counts); the judgement is retried like any failure.
                conflicts += 1
                why[key] = f"batch {b['batch_id']}: the result file answers this request {len(answers)} times with different verdicts ({', '.join(sorted(verdicts))}); none was taken"
                if key not in self.settled:
                    self.conflicted[key] = why[key]
                continue
            if not answers:
                why[key] = problems[0]
                continue
            verdict, text, usage = answers[0]  # an error line beside a good answer is no failure
            judge, pid, order = meta
            self.writer.add({"key": key, "judge": judge, "id": pid, "order": order, "verdict": verdict, "reply": text,
                             "usage": {k: v for k, v in usage.items() if k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                             "tries": 1, "mode": "batch", "batch": b["batch_id"]})
            ok += 1
        if conflicts:
            warn(f"{b['name']}: {conflicts} request(s) answered more than once with different verdicts in the result file; "
                 "none of those answers was taken" + ("" if self.settled & set(b["keys"]) else " (they go into one new batch)"))
        if batch.status in ("failed", "cancelled") and batch.errors is not None and batch.errors.data:
            e = batch.errors.data[0]
            reason = self.client.scrub(f"batch {b['batch_id']} {batch.status}: {e.code or ''} {e.message or ''}".strip())
        else:
            reason = f"batch {b['batch_id']} {batch.status} without a result for it"
        for key in b["keys"]:
            if key not in self.writer.cache and key not in why:
                why[key] = reason
        b.update(status="done", server_status=batch.status, answered=ok, failed=len(why))
        self._save()

        (warn if why else info)(f"{b['name']} {batch.status}: {ok} judgement(s) cached, {len(why)} failed")
        return why

