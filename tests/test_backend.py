"""Generation backends: a backend added in a test alone (registered under a test-only name, selected by the
recipe's ``generate.backend``) runs the ``generate`` command and writes its rows; an unknown backend is
refused by name before anything is written; the in-process backend is the samplers themselves."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.generate import backend
from dllm_align.generate.settings import Completion, SamplerSettings, encode_prompt

runner = CliRunner()


class Reversed:
    """A toy backend: a prompt's completion is its token ids reversed, written as numbers (no model at all)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_positions(self):
        return None

    def settings_for(self, settings):
        return settings

    def generate(self, prompts, settings, seeds=None, *, batch_size=8, stop_early=True, stats=None, on_batch=None):
        self.calls += 1
        out = [Completion(ids=p[::-1], text=" ".join(map(str, p[::-1])), raw=p[::-1], stopped=True, forwards=0)
               for p in map(list, prompts)]
        if on_batch is not None:
            on_batch(list(range(len(prompts))), out)
        return out


def test_a_backend_registered_in_a_test_runs_generate(tmp_path, monkeypatch):
    from dllm_align.models import load

    made = []

    def factory(model, *, device, name_or_path, predictor):
        # A served engine loads no weights here: the tokenizer is all it needs on this side.
        gen = Reversed(load.load_tokenizer(load.resolve_model_path(name_or_path or model.name_or_path)))
        made.append(gen)
        return gen

    def no_model(*a, **k):
        raise AssertionError("the in-process model was loaded")

    monkeypatch.setitem(backend.BACKENDS, "test_reversed", factory)
    monkeypatch.setattr(load, "load_from_section", no_model)
    monkeypatch.setattr(load, "load_model", no_model)
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path), "--limit", "3", "--set", "generate.backend=test_reversed"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "gen.test.jsonl"
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3 and made and made[0].calls >= 1
    tok = made[0].tokenizer
    for row in rows:
        ids = encode_prompt(tok, row["prompt"])
        assert row["completion"] == " ".join(map(str, ids[::-1]))
        assert row["num_tokens"] == len(ids) and row["finish_reason"] == "stop"
    assert json.loads((tmp_path / "gen.test.settings.json").read_text())["backend"] == "test_reversed"


def test_an_unknown_backend_is_refused_by_name_before_anything_is_written(tmp_path):
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path / "run"), "--limit", "2", "--set", "generate.backend=in_proces"])
    assert r.exit_code == 2
    assert "generate.backend: no generation backend named 'in_proces' (did you mean 'in_process'?)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_the_in_process_backend_is_the_samplers(tiny):
    from dllm_align.generate.sampler import generate

    gen = backend.make_generator("in_process", predictor=tiny)
    st = SamplerSettings(gen_length=8, block_length=4, steps=4, temperature=1.0, seed=3)
    prompts = [[1, 2, 3], [4, 5]]
    got = gen.generate(prompts, st, [11, 12])
    want = generate(tiny, prompts, st, seeds=[11, 12])
    assert [c.raw for c in got] == [c.raw for c in want] and [c.text for c in got] == [c.text for c in want]
    assert gen.tokenizer is tiny.tokenizer
    assert gen.max_positions == tiny.model.config.max_position_embeddings
