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


def test_parity_statistics():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert permutation_p([1, 1, 1, 1], [1, 1, 1, 1]) == 1.0
    assert permutation_p([0] * 20, [5] * 20) < 0.001
    assert 0.05 < permutation_p([1, 2, 3, 4, 5], [2, 3, 4, 5, 1]) <= 1.0
