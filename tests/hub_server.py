"""A counting stand-in for the Hugging Face Hub on 127.0.0.1 (used by tests/test_multinode.py): serves one model
repository from a folder, as ``huggingface_hub``'s ``snapshot_download`` asks for it, and counts each file's
downloads (GET of its content), the API requests (``api``) and the HEAD requests in ``counts.json`` beside the folder.

    python tests/hub_server.py FOLDER REPO_ID PORT_FILE
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FOLDER, REPO = Path(sys.argv[1]), sys.argv[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
COUNTS: dict = {}
LOCK = threading.Lock()
FILES = {p.name: p.read_bytes() for p in FOLDER.iterdir() if p.is_file()}


def count(key: str) -> None:
    with LOCK:
        COUNTS[key] = COUNTS.get(key, 0) + 1
        (FOLDER.parent / "counts.json").write_text(json.dumps(COUNTS))


class Hub(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _file(self) -> str | None:
        for rev in ("main", SHA):
            prefix = f"/{REPO}/resolve/{rev}/"
            if self.path.startswith(prefix):
                return self.path[len(prefix):].split("?")[0]
        return None

    def _headers(self, name: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("X-Repo-Commit", SHA)
        self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()

    def _json(self, value) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):
        count("HEAD")
        name = self._file()
        if name not in FILES:
            self.send_error(404)
            return
        self._headers(name, FILES[name])

    def do_GET(self):
        if self.path.startswith("/api/"):
            count("api")
        if self.path.split("?")[0] in (f"/api/models/{REPO}/revision/main", f"/api/models/{REPO}"):
            self._json({"id": REPO, "modelId": REPO, "sha": SHA, "siblings": [{"rfilename": n} for n in sorted(FILES)]})
            return
        if self.path.split("?")[0] in (f"/api/models/{REPO}/tree/{SHA}", f"/api/models/{REPO}/tree/main"):
            self._json([{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                        for n, b in sorted(FILES.items())])
            return
        name = self._file()
        if name not in FILES:
            self.send_error(404)
            return
        count(name)
        self._headers(name, FILES[name])
        self.wfile.write(FILES[name])


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    Path(sys.argv[3]).write_text(str(server.server_address[1]))
    server.serve_forever()
