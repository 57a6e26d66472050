"""``dllm-align parity``: passes against ``dllm-align serve`` of the recipe's model and fails, naming the reason,
against test servers that reproduce the engines' quirks: greedy-only (SGLang's released dLLM decoders), seeds
ignored (vLLM's DiffusionGemma sampler draws from the global generator), and another model served under the
recipe's name. ``online`` refuses a served backend without a passing record, and records a skipped gate."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.config.schema import GenerateSection, ModelSection
from dllm_align.generate.settings import model_fingerprint
from dllm_align.serve.api import Running, Server
from dllm_align.serve.engine import Engine
from dllm_align.serve.parity import first_divergence, permutation_p

runner = CliRunner()
WAIT = 120
MODEL = "builtin:toy-sort-base"  # the demo recipe's model
DEMO = GenerateSection(gen_length=8, block_length=8, steps=8)


class GreedyOnly(Engine):
    """Takes the argmax whatever the temperature (SGLang's released LowConfidence / JointThreshold)."""

    def submit(self, prompt, settings, seed):
        return super().submit(prompt, settings.replace(temperature=0.0), seed)


class IgnoresSeeds(Engine):
    """Draws with a seed of its own for every request (vLLM's DiffusionGemma: the global generator)."""

    def submit(self, prompt, settings, seed):
        return super().submit(prompt, settings, random.getrandbits(62))


@contextlib.contextmanager
def served(cls=Engine, model: str = MODEL):
    from dllm_align.generate.in_process import InProcessGenerator
    from dllm_align.generate.settings import SamplerSettings

    section = ModelSection(name_or_path=model)
    gen = InProcessGenerator.load(DEMO, None, model=section)
    gen.folder = MODEL  # what it claims to serve, whatever it loaded
    engine = cls(gen, SamplerSettings.from_section(DEMO), section, name=MODEL)
    run = Running(Server(engine), "127.0.0.1", 0, start_timeout=WAIT)
    try:
        yield run
    finally:
        run.stop(timeout=WAIT)


def parity(tmp_path, url, *extra):
    return runner.invoke(app, ["parity", "demo", "-o", str(tmp_path), "--limit", "6", "--samples", "3",
                               "--set", "generate.backend=openai", "--set", f"generate.openai.base_url={url}/v1", *extra])


def test_parity_passes_against_serve_and_writes_its_record(tmp_path):
    with served() as run:
        r = parity(tmp_path, run.url, "--rule", "sort")
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "parity.json").read_text())
    assert rec["passed"] and rec["reasons"] == []
    assert rec["greedy"]["match_rate"] == 1.0 and rec["sampled"]["token_match_rate"] == 1.0
    assert rec["sampled"]["distinct_backend"] == rec["sampled"]["distinct_reference"] > 1
    assert rec["served"] == {"folder": MODEL, "fingerprint": None} and rec["backend"] == "openai"
    assert rec["sampled"]["verifier"]["rule"] == "sort" and rec["sampled"]["verifier"]["p_value"] == 1.0
    assert rec["settings"]["gen_length"] == 8 and rec["backend_settings"]["engine"] == "dllm_align"


@pytest.mark.parametrize("cls, model, reason", [
    (GreedyOnly, MODEL, "greedy-only"),
    (IgnoresSeeds, MODEL, "ignores seeds"),
    (Engine, "builtin:small", "greedy:"),
])
def test_parity_fails_naming_the_quirk(tmp_path, cls, model, reason):
    with served(cls, model) as run:
        r = parity(tmp_path, run.url)
        assert r.exit_code == 1, r.output
        assert "parity failed:" in r.stderr and reason in r.stderr
        rec = json.loads((tmp_path / "parity.json").read_text())
        assert not rec["passed"] and any(x.startswith(reason) for x in rec["reasons"])
        # online refuses the engine on that record, naming why, before its folder is made
        r = runner.invoke(app, ["online", "demo", "-o", str(tmp_path / "online"), "--rounds", "1",
                                "--set", "generate.backend=openai", "--set", f"generate.openai.base_url={run.url}/v1",
                                "--parity", str(tmp_path / "parity.json")])
    assert r.exit_code == 2 and "the backend failed parity" in r.stderr and reason in r.stderr, r.output
    assert not (tmp_path / "online").exists()


def test_parity_statistics():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert permutation_p([1, 1, 1, 1], [1, 1, 1, 1]) == 1.0
    assert permutation_p([0] * 20, [5] * 20) < 0.001
    assert 0.05 < permutation_p([1, 2, 3, 4, 5], [2, 3, 4, 5, 1]) <= 1.0


# A tiny round of the online demo (12 prompts x 2 samples, one step per 4 rows, 4 held-out prompts).
TINY = ["--n", "2", "--limit", "12", "--heldout-limit", "4",
        "--set", "generate.gen_length=16", "--set", "generate.block_length=16", "--set", "generate.steps=16",
        "--set", "train.batch_size=4", "--set", "train.global_batch_size=4", "--set", "reference.n_mc=2",
        "--set", "train.n_mc=2", "--set", "train.max_steps=2", "--set", "train.lambda_undesirable=1.0"]


def test_online_through_serve_needs_parity_and_equals_in_process(tmp_path):
    served_section = GenerateSection(gen_length=16, block_length=16, steps=16)
    with contextlib.ExitStack() as stack:
        engine = Engine.from_section(ModelSection(name_or_path=MODEL), served_section)
        run = Running(Server(engine), "127.0.0.1", 0, start_timeout=WAIT)
        stack.callback(run.stop, WAIT)
        client = ["--set", "generate.backend=openai", "--set", f"generate.openai.base_url={run.url}/v1"]
        r = runner.invoke(app, ["online", "demo", "-o", str(tmp_path / "refused"), "--rounds", "2", *TINY, *client])
        assert r.exit_code == 2 and "needs a passing parity record" in r.stderr, r.output
        assert not (tmp_path / "refused").exists()
        gen_keys = TINY[6:12]
        r = runner.invoke(app, ["parity", "demo", "-o", str(tmp_path / "parity"), "--limit", "4", "--samples", "2",
                                *gen_keys, *client])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["online", "demo", "-o", str(tmp_path / "served"), "--rounds", "2", *TINY, *client,
                                "--parity", str(tmp_path / "parity" / "parity.json")])
        assert r.exit_code == 0, r.output
        # the server was handed each round's folder (the last: round 1's, for its held-out figures) and proved it
        last = tmp_path / "served" / "round-1" / "final"
        assert engine.folder == str(last) and engine.fingerprint == model_fingerprint(str(last)) is not None
    r = runner.invoke(app, ["online", "demo", "-o", str(tmp_path / "local"), "--rounds", "2", *TINY])
    assert r.exit_code == 0, r.output
    served = json.loads((tmp_path / "served" / "rounds.json").read_text())
    local = json.loads((tmp_path / "local" / "rounds.json").read_text())

    def figures(rounds):  # every figure of a round, not the folders it names
        return [{k: v for k, v in row.items() if k not in ("model", "policy", "served")} for row in rounds["rounds"]]

    assert figures(served) == figures(local)  # labels, class weights, held-out figures

    def weights(run, rd):  # the files' checksums but the training summary's (it holds timings)
        files = json.loads((tmp_path / run / rd / "final" / "checksums.json").read_text())["files"]
        return {k: v for k, v in files.items() if k != "training_summary.json"}

    for rd in ("round-0", "round-1"):
        assert weights("served", rd) == weights("local", rd) and "model.safetensors" in weights("local", rd)
    assert json.loads((tmp_path / "served" / "online.json").read_text())["parity"]["skipped"] is False
