"""Serving: ``dllm-align serve``'s micro-batching, the client backend's cost per request, and hostile input.

Run: ``PYTHONPATH=src python benchmarks/serving.py [--size full|quick|smoke]`` or call :func:`run`
(``benchmarks/run.py`` does). On the CPU with the built-in tiny model (LLaDA's rule, temperature 1 with a
seed per request, gen_length 32 in blocks of 8, 32 steps), prompts of the toy sorting task (one length):

- ``serve_concurrency_speedup``: 64 requests sent at once against the same 64 sent one after another (each
  waiting for its answer); the server decodes requests that arrive together in one batch. Both sides' tokens
  are checked equal first (a request's result does not depend on its batch-mates).
- ``serve_client_overhead_ms``: ``generate.backend: openai`` (concurrency 1) against the in-process backend at
  batch 1, on the same prompts: milliseconds a prompt costs more through HTTP, JSON and the server's queue.
- ``serve_hostile_ok``: 1 when every hostile request got a 4xx or a bounded refusal and the server answered a
  plain request afterwards: malformed JSON, a 10 MB body, 1,000 requests at once against a queue of 256, clients
  that disconnect mid-generation, negative and huge max_tokens, an unknown model, bad seeds.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dllm_align.config.schema import GenerateSection, ModelSection  # noqa: E402
from dllm_align.data.toy import make_prompts, prompt_text  # noqa: E402
from dllm_align.generate.backend import make_generator  # noqa: E402
from dllm_align.generate.sampler import generate  # noqa: E402
from dllm_align.generate.settings import SamplerSettings, encode_prompt  # noqa: E402
from dllm_align.serve.api import Running, Server  # noqa: E402
from dllm_align.serve.engine import Engine  # noqa: E402

SIZES = {"full": (64, 32), "quick": (32, 16), "smoke": (8, 8)}  # requests, gen_length


def _post(url: str, body=None, raw: bytes | None = None, timeout: float = 600):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, ConnectionError):
        return -1, None


def _concurrent(fn, n: int, workers: int) -> list:
    out = [None] * n
    idx = iter(range(n))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                i = next(idx, None)
            if i is None:
                return
            out[i] = fn(i)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def hostile(run: Running) -> dict:
    url = run.url + "/v1/completions"
    checks = {
        "malformed_json": _post(url, raw=b"{oops")[0] == 400,
        "ten_mb_body": _post(url, raw=json.dumps({"prompt": "x" * (10 << 20)}).encode())[0] in (413, -1),
        "negative_max_tokens": _post(url, {"prompt": [5, 6], "max_tokens": -1})[0] == 400,
        "huge_max_tokens": _post(url, {"prompt": [5, 6], "max_tokens": 10**12})[0] == 400,
        "unknown_model": _post(url, {"model": "nope", "prompt": [5, 6]})[0] == 404,
        "bad_seed": all(_post(url, {"prompt": [5, 6], "seed": s})[0] == 400 for s in (-5, "x", 2**80, 1.5)),
    }
    for _ in range(5):  # clients that go away mid-generation
        s = socket.create_connection((run.host, run.port), timeout=10)
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 64}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        s.close()
    codes = _concurrent(lambda i: _post(url, {"prompt": [5, 6, 7 + i % 50], "max_tokens": 8})[0], 1000, 500)
    checks["thousand_at_once"] = set(codes) <= {200, 429, 503}
    checks["alive_after"] = _post(url, {"prompt": [5, 6], "max_tokens": 8})[0] == 200
    return {"checks": checks, "thousand_codes": {str(c): codes.count(c) for c in sorted(set(codes))}}


def run(device: str = "cpu", size: str = "full") -> dict:
    n, gen_length = SIZES[size]
    section = GenerateSection(gen_length=gen_length, block_length=8, steps=gen_length, temperature=1.0, seed=0)
    engine = Engine.from_section(ModelSection(name_or_path="builtin:tiny"), section, device=device, max_queue=256,
                                 max_batch=64, batch_window=0.02)
    mp = engine.generator.mp
    prompts = [encode_prompt(mp.tokenizer, [{"role": "user", "content": prompt_text(d)}]) for d in make_prompts(n, 5, 7)]
    url = None
    run_ = Running(Server(engine), "127.0.0.1", 0)
    try:
        url = run_.url + "/v1/completions"

        def ask(i):
            return _post(url, {"prompt": prompts[i], "seed": 100 + i, "max_tokens": gen_length})

        ask(0)  # warm-up
        t = time.perf_counter()
        one = [ask(i) for i in range(n)]
        t_one = time.perf_counter() - t
        engine.batches.clear()
        t = time.perf_counter()
        together = _concurrent(ask, n, n)
        t_all = time.perf_counter() - t
        same = all(a[0] == b[0] == 200 and a[1]["choices"][0]["dllm_align"] == b[1]["choices"][0]["dllm_align"]
                   for a, b in zip(one, together))
        if not same:
            raise RuntimeError("a request's answer changed when sent with others")
        batches = list(engine.batches)

        # the client backend against in-process, one prompt at a time
        settings = SamplerSettings.from_section(section)
        seeds = [100 + i for i in range(n)]
        t = time.perf_counter()
        want = generate(mp, prompts, settings, seeds=seeds, batch_size=1)
        t_local = time.perf_counter() - t
        client = GenerateSection(**{**section.model_dump(), "backend": "openai",
                                    "openai": {"base_url": run_.url + "/v1", "concurrency": 1}})
        gen = make_generator(client, ModelSection(name_or_path="builtin:tiny"))
        t = time.perf_counter()
        got = gen.generate(prompts, gen.settings_for(settings), seeds)
        t_client = time.perf_counter() - t
        gen.close()
        if [c.raw for c in got] != [c.raw for c in want]:
            raise RuntimeError("the client backend's tokens differ from in-process")
        bad = hostile(run_)
    finally:
        run_.stop()
    return {
        "serve_concurrency_speedup": t_one / t_all,
        "serve_client_overhead_ms": 1000 * (t_client - t_local) / n,
        "serve_hostile_ok": float(all(bad["checks"].values())),
        "serving_figures": {"requests": n, "one_at_a_time_s": t_one, "together_s": t_all, "batches": batches,
                            "in_process_batch1_s": t_local, "client_s": t_client, "hostile": bad},
        "serving_settings": {"model": "builtin:tiny", "gen_length": gen_length, "block_length": 8, "steps": gen_length,
                             "temperature": 1.0, "device": device},
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=list(SIZES))
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    print(json.dumps(run(a.device, a.size), indent=2, default=str))
