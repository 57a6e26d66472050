"""``dllm-align serve`` and the client backend: every built-in family served on 127.0.0.1 and generated through
``generate.backend: openai`` gives the in-process tokens (greedy, and sampled with seeds); requests that arrive
together are batched and get what they get alone; hostile requests get a 4xx or a bounded refusal and the
server lives on; a loaded folder is reported with its fingerprint; the engines' refusals name the setting."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.config.schema import GenerateSection, ModelSection
from dllm_align.core.errors import UserError
from dllm_align.generate.backend import check_serves_each_round, make_generator, serves
from dllm_align.generate.sampler import generate
from dllm_align.generate.settings import SamplerSettings, encode_prompt, model_fingerprint
from dllm_align.serve import engines
from dllm_align.serve.api import Running, Server, check_bind
from dllm_align.serve.engine import Engine

runner = CliRunner()
WAIT = 120  # seconds: bounded waits on a busy 2-core box


@contextlib.contextmanager
def served(model: str, generate_section: GenerateSection, **kw):
    """``dllm-align serve``'s engine and app on 127.0.0.1 (a free port), stopped on the way out."""
    server_kw = {k: kw.pop(k) for k in ("api_key", "max_body", "timeout") if k in kw}
    engine = Engine.from_section(ModelSection(name_or_path=model), generate_section, **kw)
    run = Running(Server(engine, **server_kw), "127.0.0.1", 0, start_timeout=WAIT)
    try:
        yield run
    finally:
        run.stop(timeout=WAIT)


def call(url: str, path: str, body=None, *, raw: bytes | None = None, key: str | None = None, timeout: float = WAIT):
    """(status, JSON body) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text.startswith(b"{") else text


def client_section(base: GenerateSection, url: str, **own) -> GenerateSection:
    return GenerateSection(**{**base.model_dump(), "backend": "openai", "openai": {"base_url": url + "/v1", **own}})


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from fixtures.family_checkpoints import lladamoe_config, lladamoe_state, write_checkpoint

    from dllm_align.models.load import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = lladamoe_config(tok)
    return str(write_checkpoint(tmp_path_factory.mktemp("moe") / "model", cfg, lladamoe_state(cfg), tok, 1))


# (model, generate settings, prompts): the published rule of each family at the tiny size; DiffusionGemma's
# sampler takes a model call per prompt and step, so it gets fewer prompts and steps
FAMILIES = {
    "llada": ("builtin:tiny", dict(gen_length=8, block_length=4, steps=4), 12),
    "dream": ("builtin:tiny-dream", dict(gen_length=8, block_length=8, steps=4), 12),
    "llada_moe": ("moe", dict(gen_length=8, block_length=4, steps=4), 12),
    "sdar": ("builtin:tiny-sdar", dict(gen_length=8, block_length=4, steps=4), 10),
    "llada2": ("builtin:tiny-llada2", dict(gen_length=8, block_length=8, steps=4), 10),
    "diffusion_gemma": ("builtin:tiny-diffusiongemma", dict(gen_length=8, block_length=8, steps=3), 3),
}


def _prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ["sort", "five", "digits", "hello", "why", "sky", "blue", "add", "two", "and", "three"]
    return [encode_prompt(tok, [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 6)))}])
            for _ in range(n)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_through_serve_gives_the_in_process_tokens(family, moe_dir):
    _through_serve(family, moe_dir, FAMILIES[family][2])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_through_serve_on_50_prompts(family, moe_dir):
    _through_serve(family, moe_dir, 50)


def _through_serve(family, moe_dir, n):
    name, kw, _ = FAMILIES[family]
    name = moe_dir if name == "moe" else name
    base = GenerateSection(**kw, seed=11)
    with served(name, base) as run:
        gen = make_generator(client_section(base, run.url, concurrency=4), ModelSection(name_or_path=name))
        mp = run.server.engine.generator.mp
        assert mp.family.name == family
        prompts = _prompts(gen.tokenizer, n)
        assert prompts == _prompts(mp.tokenizer, n)  # the client encodes with the model's own tokenizer
        # DiffusionGemma's published sampler starts from random tokens (seeded) and takes no temperature of ours:
        # its temperature-0 decode is already the seeded draw to compare, and any other temperature is refused
        temperatures = (0.0,) if family == "diffusion_gemma" else (0.0, 1.0)
        for temperature in temperatures:
            st = gen.settings_for(SamplerSettings(**kw, seed=11, temperature=temperature))
            seeds = [1000 + i for i in range(n)]
            got = gen.generate(prompts, st, seeds)
            want = generate(mp, prompts, st, seeds=seeds, batch_size=8)
            assert [c.raw for c in got] == [c.raw for c in want], (family, temperature)
            assert [(c.ids, c.text, c.stopped) for c in got] == [(c.ids, c.text, c.stopped) for c in want]
        if family in ("llada", "diffusion_gemma"):  # seeds matter (else the comparison above proves little)
            other = gen.generate(prompts, st, [7 + i for i in range(n)])
            assert [c.raw for c in other] != [c.raw for c in got]
        gen.close()


def test_requests_arriving_together_are_batched_and_get_what_they_get_alone():
    st = GenerateSection(gen_length=8, block_length=4, steps=4, temperature=1.0, seed=3)
    with served("builtin:tiny", st, batch_window=0.2) as run:
        engine = run.server.engine
        prompts = [[5 + i % 3, 6, 7, 8 + i % 2] for i in range(24)]
        out = [None] * len(prompts)

        def one(i):
            out[i] = call(run.url, "/v1/completions", {"prompt": prompts[i], "seed": 40 + i, "temperature": 1.0})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert all(o is not None and o[0] == 200 for o in out)
        assert max(engine.batches) > 1  # decoded together
        settings = engine.settings_for({})
        for i, p in enumerate(prompts):
            alone = generate(engine.generator.mp, [p], settings, seeds=[40 + i])[0]
            assert out[i][1]["choices"][0]["dllm_align"]["raw"] == alone.raw
        # no seed: the server's seed hashed with the prompt, the same answer twice
        a = call(run.url, "/v1/completions", {"prompt": [9, 9, 9]})[1]["choices"][0]["dllm_align"]
        b = call(run.url, "/v1/completions", {"prompt": [9, 9, 9]})[1]["choices"][0]["dllm_align"]
        assert a == b


def test_hostile_requests_get_a_4xx_and_the_server_lives(tmp_path):
    st = GenerateSection(gen_length=8, block_length=4, steps=4)
    with served("builtin:tiny", st, max_queue=4, max_body=1 << 20, timeout=30) as run:
        url = run.url
        cases = {
            "malformed JSON": (None, b"{not json", 400),
            "not an object": (None, b"[1, 2]", 400),
            "10 MB prompt": (None, json.dumps({"prompt": "x" * (10 << 20)}).encode(), 413),
            "negative max_tokens": ({"prompt": [5, 6], "max_tokens": -3}, None, 400),
            "huge max_tokens": ({"prompt": [5, 6], "max_tokens": 10**9}, None, 400),
            "max_tokens past the model": ({"prompt": [5, 6], "max_tokens": 8192}, None, 400),
            "unknown model": ({"model": "gpt-5", "prompt": [5, 6]}, None, 404),
            "negative seed": ({"prompt": [5, 6], "seed": -1}, None, 400),
            "seed as text": ({"prompt": [5, 6], "seed": "7"}, None, 400),
            "seed past 63 bits": ({"prompt": [5, 6], "seed": 2**70}, None, 400),
            "token past the vocabulary": ({"prompt": [5, 10**6]}, None, 400),
            "empty prompt": ({"prompt": []}, None, 400),
            "n = 2": ({"prompt": [5, 6], "n": 2}, None, 400),
            "streaming": ({"prompt": [5, 6], "stream": True}, None, 400),
            "unknown field": ({"prompt": [5, 6], "best_guess": 1}, None, 400),
            "steps the blocks do not divide": ({"prompt": [5, 6], "steps": 3}, None, 400),
            "NaN temperature": (None, b'{"prompt": [5, 6], "temperature": NaN}', 400),
        }
        for what, (body, raw, status) in cases.items():
            try:
                got, err = call(url, "/v1/completions", body, raw=raw)
            except urllib.error.URLError:  # the 413 came before the body was sent: the server stopped reading
                assert what == "10 MB prompt"
                continue
            assert got == status, (what, got, err)
            assert isinstance(err, dict) and err["error"]["message"], what
        assert call(url, "/v1/chat/completions", {"messages": "hi"})[0] == 400
        assert call(url, "/v1/load", {"folder": str(tmp_path / "nothing")})[0] == 400
        assert call(url, "/v1/nowhere", {})[0] == 404
        # a client that goes away mid-generation: its job is dropped, the server goes on
        host, port = run.host, run.port
        for _ in range(3):
            s = socket.create_connection((host, port), timeout=10)
            body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 64}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            s.close()
        # many at once against a queue of 4: each is answered (200 or 429), none hangs, nothing crashes
        statuses = []
        lock = threading.Lock()

        def one():
            code = call(url, "/v1/completions", {"prompt": [5, 6, 7]})[0]
            with lock:
                statuses.append(code)

        threads = [threading.Thread(target=one) for _ in range(60)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert len(statuses) == 60 and set(statuses) <= {200, 429} and 429 in statuses
        assert call(url, "/health")[0] == 200
        assert call(url, "/v1/completions", {"prompt": [5, 6]})[0] == 200
    assert not any(tmp_path.iterdir())  # the server wrote nothing


def test_loopback_by_default_and_an_api_key_guards_every_v1_route():
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    with pytest.raises(UserError, match="not a loopback address"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "k" * 20)
    st = GenerateSection(gen_length=8, block_length=4, steps=4)
    with served("builtin:tiny", st, api_key="secret-key-123") as run:
        assert call(run.url, "/v1/models")[0] == 401
        assert call(run.url, "/v1/completions", {"prompt": [5]}, key="wrong")[0] == 401
        assert call(run.url, "/v1/models", key="secret-key-123")[0] == 200
        assert call(run.url, "/health")[0] == 200


def test_load_serves_another_folder_and_reports_its_fingerprint(tmp_path, tiny_dir):
    from dllm_align.core.io import write_checksums

    folder = tmp_path / "final"
    shutil.copytree(tiny_dir, folder)
    write_checksums(folder)
    fp = model_fingerprint(str(folder))
    assert fp is not None
    st = GenerateSection(gen_length=8, block_length=4, steps=4)
    with served("builtin:tiny", st) as run:
        before = call(run.url, "/v1/serving")[1]
        assert before["folder"] == "builtin:tiny" and before["fingerprint"] is None
        code, got = call(run.url, "/v1/load", {"folder": str(folder)})
        assert code == 200 and got["fingerprint"] == fp and got["folder"] == str(folder)
        assert call(run.url, "/v1/serving")[1]["fingerprint"] == fp
        # the client backend told to generate with that folder finds it served; with another it loads it
        gen = make_generator(client_section(st, run.url), ModelSection(name_or_path="builtin:tiny"), name_or_path=str(folder))
        assert gen.serving() == {"folder": str(folder), "fingerprint": fp}
        code, got = call(run.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 8})
        assert code == 200 and got["system_fingerprint"] == fp


def test_generate_through_serve_resumes_without_asking_finished_prompts_again(tmp_path):
    st = GenerateSection(gen_length=8, block_length=8, steps=8)
    with served("builtin:toy-sort-base", st) as run:
        engine = run.server.engine
        args = ["generate", "demo", "-o", str(tmp_path), "--set", "generate.backend=openai",
                "--set", f"generate.openai.base_url={run.url}/v1"]
        r = runner.invoke(app, args + ["--limit", "3"])
        assert r.exit_code == 0, r.output
        asked = engine.stats.prompts
        assert asked == 3
        # the same server under another address (a restarted server on another port alike): resumed, not refused
        other = args[:-1] + [f"generate.openai.base_url=http://localhost:{run.port}/v1", "--set", "generate.openai.concurrency=2"]
        r = runner.invoke(app, other + ["--limit", "5"])
        assert r.exit_code == 0, r.output
        assert engine.stats.prompts == asked + 2  # only the two new prompts
        rows = [json.loads(x) for x in (tmp_path / "gen.test.jsonl").read_text().splitlines()]
        inproc = tmp_path / "inproc"
        r = runner.invoke(app, ["generate", "demo", "-o", str(inproc), "--limit", "5"])
        assert r.exit_code == 0, r.output
        want = [json.loads(x) for x in (inproc / "gen.test.jsonl").read_text().splitlines()]
        assert [(w["id"], w["completion"]) for w in rows] == [(w["id"], w["completion"]) for w in want]


def test_engines_refuse_by_name_what_they_cannot_honour():
    greedy = SamplerSettings(gen_length=32, block_length=32, steps=32, threshold=0.95)
    assert engines.refusals("sglang", greedy, {"block_length": 32, "threshold": 0.95}) == [
        "steps: sglang has no such setting (the recipe asks for 32; its default 512 is what an engine's own rule is "
        "taken to do)"]
    hot = greedy.replace(temperature=0.7, steps=512)
    why = engines.refusals("sglang", hot, {"block_length": 32, "threshold": 0.95})
    assert any(w.startswith("temperature: sglang's dLLM decoders take the argmax") for w in why)
    assert any(w.startswith("seed: sglang does not reproduce") for w in why)
    why = engines.refusals("lmdeploy", SamplerSettings(gen_length=8, block_length=4, steps=8), {})
    assert [w.split(":")[0] for w in why] == ["block_length", "steps", "threshold"]
    # the step schedule without a threshold: LMDeploy's low_confidence_static, declared as threshold None
    fixed = {"block_length": 4, "steps": 8, "threshold": None}
    assert engines.refusals("lmdeploy", SamplerSettings(gen_length=8, block_length=4, steps=8), fixed) == []
    assert engines.refusals("lmdeploy", SamplerSettings(gen_length=8, block_length=4, steps=4), fixed) == [
        "steps: the server was started with 8 (--dllm-denoising-steps), the recipe asks for 4"]
    gemma = SamplerSettings(sampler="diffusion_gemma", gen_length=8, steps=48)
    assert [w.split(":")[0] for w in engines.refusals("vllm", gemma, {"steps": 48})] == ["seed"]
    assert engines.refusals("vllm", gemma, {"steps": 48}, accept_unseeded=True) == []
    assert engines.refusals("dllm_align", hot, {}) == []
    own = GenerateSection(backend="openai", openai={"engine": "lmdeploy"}).own_settings("openai")
    assert serves("openai", own) == "fixed"
    with pytest.raises(UserError, match="serves one model"):
        check_serves_each_round("openai", own=own)
    check_serves_each_round("openai", own=GenerateSection(backend="openai", openai={"engine": "sglang"}).own_settings("openai"))


def test_the_serve_command_starts_answers_and_stops(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dllm_align", "serve", "demo", "--port", str(port),
                             "--set", "generate.gen_length=8", "--set", "generate.block_length=8", "--set", "generate.steps=8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + WAIT
        while True:
            try:
                if call(url, "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < end, "serve did not answer /health in time"
            time.sleep(0.5)
        code, got = call(url, "/v1/chat/completions", {"model": "builtin:toy-sort-base",
                                                         "messages": [{"role": "user", "content": "sort: 31524"}]})
        assert code == 200 and got["choices"][0]["message"]["content"] in ("12345", "54321")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode is not None and not any(tmp_path.iterdir())
    r = runner.invoke(app, ["serve", "demo", "--host", "0.0.0.0", "--api-key-env", "NO_SUCH_VAR_S45"])
    assert r.exit_code == 2 and "not a loopback address" in r.stderr


def test_evaluate_through_serve_writes_the_in_process_samples(tmp_path):
    pytest.importorskip("lm_eval", reason="the evaluate command needs the optional harness")
    from test_backend import _eval_recipe

    def samples(folder, generate):
        recipe = _eval_recipe(folder, ">>")
        spec = json.loads(recipe.read_text())
        spec["generate"] = generate
        recipe.write_text(json.dumps(spec))
        r = runner.invoke(app, ["evaluate", str(recipe)])
        assert r.exit_code == 0, r.output
        rows = [json.loads(x) for x in (folder / "run" / "eval" / "builtin_tiny" / "samples_gen.jsonl").read_text().splitlines()]
        return [(row["doc_id"], row["resps"]) for row in rows]

    kw = dict(gen_length=8, block_length=4, steps=4, temperature=1.0, seed=5)
    want = samples(tmp_path / "local", kw)
    with served("builtin:tiny", GenerateSection(**kw)) as run:
        got = samples(tmp_path / "served", {**kw, "backend": "openai", "openai": {"base_url": run.url + "/v1"}})
    assert got == want and len(want) == 2


@pytest.mark.parametrize("recipe", ["demo", "demo_dream", "demo_block", "demo_gemma"])
def test_generate_through_serve_of_each_toy_demo_base_equals_in_process(recipe, tmp_path):
    from dllm_align.config.recipe import load_recipe

    # seeded sampling: temperature 1, or for DiffusionGemma (no temperature of ours) its own seeded draw at 0
    hot = "0.0" if recipe == "demo_gemma" else "1.0"
    rec = load_recipe(recipe, [f"generate.temperature={hot}", "generate.seed=4"], None)
    engine = Engine.from_section(rec.model, rec.generate)
    run = Running(Server(engine), "127.0.0.1", 0, start_timeout=WAIT)
    try:
        common = ["--limit", "6", "--set", f"generate.temperature={hot}", "--set", "generate.seed=4"]
        served_args = ["--set", "generate.backend=openai", "--set", f"generate.openai.base_url={run.url}/v1"]
        r = runner.invoke(app, ["generate", recipe, "-o", str(tmp_path / "served"), *common, *served_args])
        assert r.exit_code == 0, r.output
    finally:
        run.stop(timeout=WAIT)
    r = runner.invoke(app, ["generate", recipe, "-o", str(tmp_path / "local"), *common])
    assert r.exit_code == 0, r.output

    def rows(run_dir):
        return [(x["id"], x["completion"], x["num_tokens"]) for x in
                map(json.loads, (tmp_path / run_dir / "gen.test.jsonl").read_text().splitlines())]

    assert rows("served") == rows("local") and len(rows("local")) == 6


def test_a_rules_own_settings_reach_the_server(tmp_path):
    # LLaDA2.1's rule has settings of its own (generate.llada21.*): the client sends them, the server decodes by them
    kw = dict(gen_length=8, block_length=8)
    base = GenerateSection(**kw, seed=2)
    with served("builtin:tiny-llada21", base) as run:
        mp = run.server.engine.generator.mp
        wants = []
        for own in ({"mode": "speed"}, {"mode": "quality", "threshold": 0.3, "edit_threshold": 0.2}):
            section = GenerateSection(**kw, seed=2, temperature=1.0, llada21=own)
            gen = make_generator(client_section(section, run.url), ModelSection(name_or_path="builtin:tiny-llada21"))
            st = gen.settings_for(SamplerSettings.from_section(section))
            assert st.sampler == "llada21" and st.own_settings("llada21").mode == own["mode"]
            prompts = _prompts(gen.tokenizer, 6)
            got = gen.generate(prompts, st, list(range(6)))
            want = generate(mp, prompts, st, seeds=list(range(6)))
            assert [c.raw for c in got] == [c.raw for c in want], own
            wants.append([c.raw for c in want])
            gen.close()
        assert wants[0] != wants[1]  # the rule's settings decide the tokens: the equality above shows they arrived
        # a request naming them directly; an unknown key of the rule is refused by name
        code, _ = call(run.url, "/v1/completions", {"prompt": [5, 6, 7], "llada21": {"mode": "speed"}})
        assert code == 200
        code, err = call(run.url, "/v1/completions", {"prompt": [5, 6, 7], "llada21": {"speed": 1}})
        assert code == 400 and "llada21" in err["error"]["message"]
