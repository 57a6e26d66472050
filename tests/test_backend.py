"""Generation backends: a backend declared in a test alone (a component with its own setting,
``generate.toy_echo.prefix``) runs the ``generate`` command and records only what it used; its setting is
validated by ``recipes check``; a backend that serves a fixed model is refused by ``online`` before anything is
written; an unknown backend is refused by name; the in-process backend is the samplers themselves."""

from __future__ import annotations

import json

import pytest
from pydantic import Field
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.config import components
from dllm_align.config.components import Component, ComponentSettings
from dllm_align.core.errors import UserError
from dllm_align.generate import backend, in_process
from dllm_align.generate.settings import Completion, SamplerSettings, encode_prompt

runner = CliRunner()


class EchoSettings(ComponentSettings):
    prefix: str = Field("", max_length=8, description="Written before every completion.")


class Echo:
    """A toy backend: a prompt's completion is its prefix and its token ids reversed, written as numbers (no
    model at all: a served engine loads no weights here, the tokenizer is all it needs on this side)."""

    def __init__(self, tokenizer, prefix: str, folder: str) -> None:
        self._tokenizer = tokenizer
        self.prefix = prefix
        self.folder = folder
        self.calls = 0
        self.checked = []

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_positions(self):
        return None

    def settings_for(self, settings):
        self.checked.append(settings)
        if self.prefix == "!!":  # a setting the schema accepts but this backend's model cannot serve
            raise UserError("generate.toy_echo.prefix: '!!' is not served by this model")
        return settings

    def serving(self):
        return {"folder": self.folder, "fingerprint": None}

    def generate(self, prompts, settings, seeds=None, *, batch_size=8, stop_early=True, stats=None, on_batch=None):
        self.calls += 1
        out = [Completion(ids=p[::-1], text=self.prefix + " ".join(map(str, p[::-1])), raw=p[::-1], stopped=True,
                          forwards=0) for p in map(list, prompts)]
        if on_batch is not None:
            on_batch(list(range(len(prompts))), out)
        return out


MADE: list = []


def make_echo(generate, settings, *, model, device, name_or_path, predictor):
    from dllm_align.models import load

    folder = name_or_path or model.name_or_path
    gen = Echo(load.load_tokenizer(load.resolve_model_path(folder)), settings.prefix, folder)
    MADE.append((generate, gen))
    return gen


ECHO = Component(kind="backend", name="toy_echo", target=f"{__name__}:make_echo", settings=EchoSettings,
                 traits={"serves": "load", "reads": ("gen_length", "seed")})
FIXED = Component(kind="backend", name="toy_fixed", target=f"{__name__}:make_echo",
                  traits={"serves": "fixed", "reads": ("gen_length",)})


@pytest.fixture
def toys(monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the in-process model was loaded")

    # the in-process backend's own binding (imported at this module's top, so no other module keeps the patch)
    monkeypatch.setattr(in_process, "load_from_section", no_model)
    MADE.clear()
    for c in (ECHO, FIXED):
        components.register(c)
    yield
    for c in (ECHO, FIXED):
        components.unregister("backend", c.name)


def test_a_backend_registered_in_a_test_runs_generate(tmp_path, toys):
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path), "--limit", "3", "--set", "generate.backend=toy_echo",
                            "--set", "generate.toy_echo.prefix=>>"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "gen.test.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3 and MADE
    section, gen = MADE[0]
    assert gen.calls >= 1 and section.backend == "toy_echo" and gen.prefix == ">>"
    assert gen.checked  # the factory's generator was asked for its settings before any row was written
    for row in rows:
        ids = encode_prompt(gen.tokenizer, row["prompt"])
        assert row["completion"] == ">>" + " ".join(map(str, ids[::-1]))
        assert row["num_tokens"] == len(ids) and row["finish_reason"] == "stop"
    side = json.loads((tmp_path / "gen.test.settings.json").read_text())
    # what this backend used, and nothing it did not: no dtype (no weights here), no rule keys it never reads
    assert side["backend"] == "toy_echo" and "dtype" not in side
    assert side["sampler"] == {"gen_length": 8, "seed": 0, "toy_echo": {"prefix": ">>"}}
    # resumable with the same recorded values; another prefix is refused by name
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path), "--limit", "3", "--set", "generate.backend=toy_echo",
                            "--set", "generate.toy_echo.prefix=>>"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path), "--limit", "3", "--set", "generate.backend=toy_echo",
                            "--set", "generate.toy_echo.prefix=<<"])
    assert r.exit_code == 2 and "sampler.toy_echo.prefix" in r.stderr


def test_a_backends_setting_is_shown_and_checked_by_recipes(tmp_path, toys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: demo\ngenerate:\n  backend: toy_echo\n  toy_echo:\n    prefix: '>>'\n")
    r = runner.invoke(app, ["recipes", "show", str(recipe)])
    assert r.exit_code == 0 and "toy_echo:" in r.stdout and "prefix: '>>'" in r.stdout
    r = runner.invoke(app, ["recipes", "check", str(recipe)])
    assert r.exit_code == 0, r.output
    assert "toy_echo:" in r.stdout and "prefix: '>>'" in r.stdout
    r = runner.invoke(app, ["recipes", "check", str(recipe), "--set", "generate.toy_echo.prefix=much_too_long"])
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "generate.toy_echo.prefix" in lines[0], r.stderr


@pytest.mark.parametrize("name, shown", [("in_proces", "'in_proces' (did you mean 'in_process'?)"),
                                         ("in_process ", "'in_process '"),
                                         ("x" * 300, "'" + "x" * 59 + "...'")])
def test_an_unknown_backend_is_refused_by_name_by_recipes_check(tmp_path, name, shown):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: demo\ngenerate:\n  backend: " + json.dumps(name) + "\n")
    r = runner.invoke(app, ["recipes", "check", str(recipe)])
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"generate.backend: no backend named {shown}" in lines[0], r.stderr
    assert len(lines[0]) < 300


def test_an_unknown_backend_is_refused_by_name_before_anything_is_written(tmp_path):
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path / "run"), "--limit", "2", "--set", "generate.backend=in_proces"])
    assert r.exit_code == 2
    assert "generate.backend: no backend named 'in_proces' (did you mean 'in_process'?)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_online_refuses_a_backend_that_serves_a_fixed_model(tmp_path, toys):
    r = runner.invoke(app, ["online", "demo", "-o", str(tmp_path / "run"), "--rounds", "1",
                            "--set", "generate.backend=toy_fixed"])
    assert r.exit_code == 2, r.output
    assert "generate.backend: the backend 'toy_fixed' serves one model and cannot change it" in r.stderr
    assert not (tmp_path / "run").exists() and not MADE


def test_the_online_demo_refuses_a_backend_that_serves_a_fixed_model(tmp_path, toys):
    r = runner.invoke(app, ["demo", "--recipe", "demo_online", "-o", str(tmp_path / "run"),
                            "--set", "generate.backend=toy_fixed"])
    assert r.exit_code == 2, r.output
    assert "generate.backend: the backend 'toy_fixed' serves one model and cannot change it" in r.stderr
    assert not (tmp_path / "run").exists()


def test_backend_traits_say_how_a_model_reaches_it(toys):
    assert backend.serves("in_process") == "load" and backend.loads_here("in_process")
    assert backend.serves("toy_fixed") == "fixed" and not backend.loads_here("toy_echo")
    backend.check_serves_each_round("in_process")
    backend.check_serves_each_round("toy_echo")


def test_the_in_process_backend_is_the_samplers(tiny):
    from dllm_align.generate.sampler import generate

    st = SamplerSettings(gen_length=8, block_length=4, steps=4, temperature=1.0, seed=3)
    gen = backend.make_generator(st, predictor=tiny)
    prompts = [[1, 2, 3], [4, 5]]
    got = gen.generate(prompts, st, [11, 12])
    want = generate(tiny, prompts, st, seeds=[11, 12])
    assert [c.raw for c in got] == [c.raw for c in want] and [c.text for c in got] == [c.text for c in want]
    assert gen.tokenizer is tiny.tokenizer
    assert gen.max_positions == tiny.model.config.max_position_embeddings
    assert backend.recorded_settings(st) == st.to_dict()


def test_make_generator_refuses_settings_the_model_cannot_decode(tiny):
    # the factory's generator checks the section against its model before any caller writes anything
    from dllm_align.core.errors import UserError

    with pytest.raises(UserError, match="block"):
        backend.make_generator(SamplerSettings(sampler="block", gen_length=8, block_length=4, steps=4), predictor=tiny)


def _eval_recipe(tmp_path, prefix: str):
    tasks = tmp_path / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    rows = [{"question": q, "answer": "x"} for q in ("Q: 2+2=", "Say hi.")]
    (tasks / "toy_gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "toy_gen.yaml").write_text(json.dumps({
        "task": "toy_gen", "dataset_path": "json", "output_type": "generate_until", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tasks / "toy_gen.jsonl")}, "cache_dir": str(tasks / "hf_cache")},
        "doc_to_text": "{{question}}", "doc_to_target": "answer", "generation_kwargs": {"until": ["\n"]},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0}}))
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(json.dumps({
        "name": "t", "output_dir": str(tmp_path / "run"),
        "generate": {"gen_length": 8, "block_length": 4, "steps": 4, "backend": "toy_echo", "toy_echo": {"prefix": prefix}},
        "evaluate": {"mc_num": 2, "batch_size": 2, "bootstrap_iters": 0, "tasks": {"gen": {"task": "toy_gen"}},
                     "include_path": str(tasks)}}))
    return recipe


def test_evaluate_hands_the_backend_its_settings_and_its_refusal_is_one_line(tmp_path):
    pytest.importorskip("lm_eval", reason="the evaluate command needs the optional harness")
    MADE.clear()
    components.register(ECHO)
    try:
        r = runner.invoke(app, ["evaluate", str(_eval_recipe(tmp_path / "ok", ">>"))])
        assert r.exit_code == 0, r.output
        section, gen = MADE[-1]
        assert gen.prefix == ">>" and gen.calls >= 1 and section.backend == "toy_echo"
        samples = (tmp_path / "ok" / "run" / "eval" / "builtin_tiny" / "samples_gen.jsonl").read_text()
        assert ">>" in samples  # the completions came from the backend, with its own setting
        # a setting the backend refuses for its model: one line naming the key, before any task is written
        r = runner.invoke(app, ["evaluate", str(_eval_recipe(tmp_path / "bad", "!!"))])
        assert r.exit_code == 2 and "generate.toy_echo.prefix: '!!' is not served by this model" in r.stderr
        assert not (tmp_path / "bad" / "run" / "eval" / "builtin_tiny" / "tasks").exists()
    finally:
        components.unregister("backend", "toy_echo")


PLUGIN = '''
from pydantic import Field

from dllm_align.config.components import Component, ComponentSettings, register
from dllm_align.generate.settings import Completion
from dllm_align.models.load import load_tokenizer, resolve_model_path


class UpperSettings(ComponentSettings):
    suffix: str = Field("!", description="Written after every completion.")


class Upper:
    def __init__(self, tokenizer, suffix, folder):
        self.tokenizer, self.suffix, self.folder = tokenizer, suffix, folder
        self.max_positions = None

    def settings_for(self, settings):
        return settings

    def serving(self):
        return {"folder": self.folder, "fingerprint": None}

    def generate(self, prompts, settings, seeds=None, *, batch_size=8, stop_early=True, stats=None, on_batch=None):
        out = [Completion(ids=list(p), text=f"{len(p)}{self.suffix}", raw=list(p), stopped=True, forwards=0)
               for p in prompts]
        if on_batch is not None:
            on_batch(list(range(len(prompts))), out)
        return out


def make(generate, settings, *, model, device, name_or_path, predictor):
    folder = name_or_path or model.name_or_path
    return Upper(load_tokenizer(resolve_model_path(folder)), settings.suffix, folder)


register(Component(kind="backend", name="upper_plugin", target="my_backend_plugin:make", settings=UpperSettings,
                   traits={"serves": "load", "reads": ("gen_length",), "loads_here": False}))
'''


def test_contributing_steps_for_a_backend_work(tmp_path, monkeypatch):
    # CONTRIBUTING.md, "A generation backend", followed literally: one module named in DLLM_ALIGN_PLUGINS
    # (class, factory, declaration), selected by generate.backend, its setting under generate.<name>.<key>
    import sys

    (tmp_path / "my_backend_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(components.PLUGINS_ENV, "my_backend_plugin")
    monkeypatch.setattr(in_process, "load_from_section", lambda *a, **k: pytest.fail("the in-process model was loaded"))
    try:
        out = tmp_path / "out"
        r = runner.invoke(app, ["generate", "demo", "-o", str(out), "--limit", "2", "--set", "generate.backend=upper_plugin",
                                "--set", "generate.upper_plugin.suffix=++"])
        assert r.exit_code == 0, r.output
        rows = [json.loads(x) for x in (out / "gen.test.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(row["completion"].endswith("++") for row in rows)
        side = json.loads((out / "gen.test.settings.json").read_text())
        assert side["sampler"] == {"gen_length": 8, "upper_plugin": {"suffix": "++"}} and "dtype" not in side
    finally:
        components.unregister("backend", "upper_plugin")
        sys.modules.pop("my_backend_plugin", None)
        components._loaded.discard("my_backend_plugin")


# The sidecar the in-process backend wrote for `generate demo --limit 2` before backends declared what they
# use (and the rows it wrote): a folder made then resumes, since the in-process record is unchanged.
OLD_SIDECAR = {
    "model": "builtin:toy-sort-base", "model_checksums": None, "revision": None, "tokenizer": None, "dtype": "float32",
    "prompts": "builtin:toy-sort", "split": "test", "max_prompt_length": None,
    "sampler": {"sampler": "auto", "gen_length": 8, "block_length": 8, "steps": 8, "remasking": "low_confidence",
                "temperature": 0.0, "cfg": 0.0, "seed": 0, "cache": "none", "threshold": None, "alg": "origin",
                "alg_temp": 0.0, "top_p": None, "top_k": None, "eps": 0.001},
    "backend": "in_process",
}
OLD_ROWS = [("sort-test-00000", "sort: 29141", "94221"), ("sort-test-00001", "sort: 77763", "36777")]


def test_a_folder_generated_before_backends_declared_their_use_resumes(tmp_path):
    rows = [{"id": i, "prompt": [{"role": "user", "content": p}], "completion": c, "finish_reason": "stop",
             "num_tokens": 5, "settings": OLD_SIDECAR} for i, p, c in OLD_ROWS]
    (tmp_path / "gen.test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gen.test.settings.json").write_text(json.dumps(OLD_SIDECAR, indent=2))
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path), "--limit", "3"])
    assert r.exit_code == 0, r.output
    assert "2 already in" in r.stderr
    got = [json.loads(x) for x in (tmp_path / "gen.test.jsonl").read_text().splitlines()]
    assert [g["completion"] for g in got[:2]] == ["94221", "36777"] and len(got) == 3
    assert json.loads((tmp_path / "gen.test.settings.json").read_text()) == OLD_SIDECAR  # recorded as before
    # a value that differs is still refused, by name
    r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path), "--limit", "3", "--set", "generate.seed=1"])
    assert r.exit_code == 2 and "sampler.seed" in r.stderr


class Partial:
    tokenizer = None
    max_positions = None

    def generate(self, *a, **k):
        raise AssertionError("never reached")


def make_partial(generate, settings, **kw):
    return Partial()


def test_a_backend_whose_generator_lacks_a_method_is_refused_by_name(tmp_path):
    components.register(Component(kind="backend", name="toy_partial", target=f"{__name__}:make_partial",
                                  traits={"serves": "load"}))
    try:
        r = runner.invoke(app, ["generate", "demo", "-o", str(tmp_path / "run"), "--limit", "2",
                                "--set", "generate.backend=toy_partial"])
    finally:
        components.unregister("backend", "toy_partial")
    assert r.exit_code == 2
    assert "generate.backend: the backend 'toy_partial'" in r.stderr and "settings_for, serving" in r.stderr
    assert not (tmp_path / "run").exists()
