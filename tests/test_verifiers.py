"""Verifiers as components (online/verifiers.py, online/components.py): a toy verifier with its own setting
added by following CONTRIBUTING.md's steps literally, specs with an argument, and the built-in ones."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from dllm_align.config import components
from dllm_align.config.schema import verifier_forms, verifier_problem
from dllm_align.core.errors import UserError
from dllm_align.online.verifiers import Rule, get_rule
from reliability import run_cli

# The verifier's module: a factory (Selection) -> Rule (CONTRIBUTING.md, "Adding a component").
VERIFIER_MODULE = '''
import json

from dllm_align.online.verifiers import Rule


def exact_json_rule(sel):
    column = sel.settings.column

    def same(prompt, completion, row):
        try:
            return json.loads(completion) == json.loads(row[column])
        except ValueError:
            return False

    return Rule("exact_json", same, needs=(column,))
'''

# Its declaration, torch-free (a built-in one goes in online/components.py; a user's in a module named by
# DLLM_ALIGN_PLUGINS).
DECLARATION = '''
from pydantic import Field

from dllm_align.config.components import Component, ComponentSettings, register


class ExactJsonSettings(ComponentSettings):
    column: str = Field("expected", min_length=1, description="The row's column holding the expected JSON.")


register(Component("verifier", "exact_json", "toy_exact_json:exact_json_rule", settings=ExactJsonSettings,
                   summary="the completion is the JSON value of the row's column"))
'''

FAST = ["--set", "generate.gen_length=8", "--set", "generate.block_length=8", "--set", "generate.steps=8"]


@pytest.fixture
def toy_verifier(tmp_path, monkeypatch):
    """The toy verifier written as CONTRIBUTING.md says, found through DLLM_ALIGN_PLUGINS; taken away afterwards."""
    (tmp_path / "toy_exact_json.py").write_text(textwrap.dedent(VERIFIER_MODULE), encoding="utf-8")
    (tmp_path / "toy_verifiers.py").write_text(textwrap.dedent(DECLARATION), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(components.PLUGINS_ENV, "toy_verifiers")
    yield {components.PLUGINS_ENV: "toy_verifiers"}
    components.unregister("verifier", "exact_json")
    components._loaded.discard("toy_verifiers")
    for mod in ("toy_verifiers", "toy_exact_json"):
        sys.modules.pop(mod, None)


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"give {i} as JSON", "want": str(i)}) + "\n"
                               for i in range(3)), encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"name": "t", "output_dir": str(tmp_path / "run"),
                                  "online": {"rule": "exact_json", "exact_json": {"column": "want"}}}), encoding="utf-8")
    return recipe, prompts


def test_a_toy_verifier_with_its_own_setting_runs_label(tmp_path, toy_verifier):
    recipe, prompts = _setup(tmp_path)
    shown = run_cli(["recipes", "show", recipe], env=toy_verifier)
    assert shown.code == 0 and '"exact_json": {"column": "want"}' in shown.out
    checked = run_cli(["recipes", "check", recipe], env=toy_verifier)
    assert checked.code == 0 and "exact_json:\n    column: want" in checked.out, checked.err
    r = run_cli(["label", recipe, "-o", tmp_path / "lab", "--rule", "exact_json", "--prompts", prompts, "--n", "2", *FAST],
                env=toy_verifier)
    assert r.code == 0, r.err
    rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 6 and {x["labeller"] for x in rows} == {"exact_json"}
    for x in rows:  # the verdict, recomputed here from the column its setting names
        try:
            want = json.loads(x["completion"]) == int(x["prompt_id"][1:])
        except ValueError:
            want = False
        assert x["label"] is want
    # the setting is what the verifier reads: a column the prompts lack is refused before anything is sampled
    r = run_cli(["label", recipe, "-o", tmp_path / "lab2", "--rule", "exact_json", "--prompts", prompts, "--n", "2",
                 "--set", "online.exact_json.column=gold", *FAST], env=toy_verifier)
    assert r.code == 2 and "no 'gold' column, which --rule exact_json compares against" in r.err
    assert not (tmp_path / "lab2").exists()


def test_a_toy_verifiers_bad_setting_is_refused_in_one_line(tmp_path, toy_verifier):
    recipe, _ = _setup(tmp_path)
    for setting, words in (("online.exact_json.column=''", "online.exact_json.column: String should have at least 1 character"),
                           ("online.exact_json.colum=x", "unknown key 'online.exact_json.colum'"),
                           ("online.rule=exact_jsn", "online.rule: unknown verifier 'exact_jsn' (did you mean 'exact_json'?)")):
        r = run_cli(["recipes", "check", recipe, "--set", setting], env=toy_verifier)
        lines = r.err.strip().splitlines()
        assert r.code == 2 and len(lines) == 1 and lines[0].startswith("Error:") and words in lines[0], r.err


def test_a_spec_selects_a_verifier_by_the_name_before_its_argument():
    assert verifier_forms()[:4] == ["sort", "math_answer", "regex:PATTERN", "judge:MODEL"]
    assert verifier_forms()[-1] == "package.module:function"
    rx = get_rule("regex:^4[0-9]$")
    assert isinstance(rx, Rule) and rx.name == "regex:^4[0-9]$" and rx.fn("", "42", {}) and not rx.fn("", "52", {})
    assert verifier_problem("regex") == "the verifier 'regex' needs its argument: regex:PATTERN"
    assert verifier_problem("judge:") == "name the judge model, e.g. judge:gpt-4o-mini"
    # a verifier that takes no argument is named bare: sort:x stays a user's module 'sort'
    assert verifier_problem("sort:x") is None
    with pytest.raises(UserError, match="--rule sort:x"):
        get_rule("sort:x")
    assert get_rule("sort").reasons == ("correct", "descending", "unsorted", "malformed")
    m = get_rule("math_answer", answer_column="gold")
    assert m.needs == ("gold",) and "none" in m.reasons


def test_the_judge_verifier_checks_its_section_and_binds_to_the_run_folder(tmp_path, monkeypatch):
    from dllm_align.config.schema import Recipe
    from dllm_align.online.absolute import AbsoluteJudge

    recipe = Recipe(judge={"base_url": "http://127.0.0.1:9/v1", "api_key_env": ""})
    rule = get_rule("judge:m", recipe=recipe)
    judge = rule.bind(tmp_path)
    try:
        assert isinstance(judge, AbsoluteJudge) and rule.name == "judge:m"
    finally:
        judge.close()
    with pytest.raises(UserError, match="judge.base_url"):
        get_rule("judge:m", recipe=Recipe(judge={"base_url": "ftp://x", "api_key_env": ""}))
