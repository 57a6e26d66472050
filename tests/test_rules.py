"""Decoding rules as components (generate/rules.py, generate/components.py): a toy rule added by following
CONTRIBUTING.md's steps literally, the keys a rule ignores and its own check, in the recipe and once
``sampler: auto`` is resolved to the model family's rule."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from dllm_align.config import components
from dllm_align.config.schema import GenerateSection
from dllm_align.core.errors import UserError
from dllm_align.generate.rules import rule_for, settings_for
from dllm_align.generate.settings import SamplerSettings
from reliability import run_cli

# The rule's module: a DecodingRule (CONTRIBUTING.md, "Adding a component"). Left to right: each step commits
# the leftmost `width` masked positions to their most probable token (never the mask itself).
RULE_MODULE = '''
import time

import torch

from dllm_align.generate.canvas import canvas, completion
from dllm_align.generate.rules import DecodingRule
from dllm_align.generate.settings import SamplerStats


def decode_batch(mp, prompts, settings, seeds, stats, t0, stop_early):
    width = settings.own_settings("left_to_right").width
    x, attn = canvas(mp, prompts, settings.gen_length)
    P = x.shape[1] - settings.gen_length
    local = SamplerStats(prompts=len(prompts))
    while bool((x[:, P:] == mp.mask_token_id).any()):
        logits = mp.logits(x, attn).float()
        logits[..., mp.mask_token_id] = -torch.inf
        local.forwards += 1
        local.positions += x.numel()
        for b in range(len(prompts)):
            cols = P + (x[b, P:] == mp.mask_token_id).nonzero(as_tuple=True)[0][:width]
            x[b, cols] = logits[b, cols].argmax(-1)
    stops = torch.tensor(mp.stop_token_ids or [-1], device=mp.device)
    out = [completion(mp, x[b, P:], stops, local.forwards, local) for b in range(len(prompts))]
    local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(local)
    return out


RULE = DecodingRule("left_to_right", decode_batch)
'''

# Its declaration, torch-free (a built-in one goes in generate/components.py; a user's in a module named by
# DLLM_ALIGN_PLUGINS).
DECLARATION = '''
from pydantic import Field

from dllm_align.config.components import Component, ComponentSettings, register


class LeftToRightSettings(ComponentSettings):
    width: int = Field(1, ge=1, le=64, description="Positions committed per step, leftmost first.")


register(Component("rule", "left_to_right", "toy_left_to_right:RULE", settings=LeftToRightSettings,
                   ignores=("cfg", "cache", "threshold", "remasking", "top_p", "top_k"),
                   summary="commits the leftmost masked positions first"))
'''


@pytest.fixture
def toy_rule(tmp_path, monkeypatch):
    """The toy rule written as CONTRIBUTING.md says, found through DLLM_ALIGN_PLUGINS; taken away afterwards."""
    (tmp_path / "toy_left_to_right.py").write_text(textwrap.dedent(RULE_MODULE), encoding="utf-8")
    (tmp_path / "toy_rules.py").write_text(textwrap.dedent(DECLARATION), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(components.PLUGINS_ENV, "toy_rules")
    yield {components.PLUGINS_ENV: "toy_rules"}
    components.unregister("rule", "left_to_right")
    components._loaded.discard("toy_rules")
    for mod in ("toy_rules", "toy_left_to_right"):
        sys.modules.pop(mod, None)


def _recipe(tmp_path: Path, generate: dict) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": [{"role": "user", "content": f"say {i}"}]}) + "\n"
                               for i in range(3)), encoding="utf-8")
    recipe = {"name": "t", "output_dir": str(tmp_path / "run"), "data": {"test": str(prompts)}, "generate": generate}
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe), encoding="utf-8")  # JSON is YAML
    return path


def test_a_toy_rule_with_its_own_setting_runs_generate(tmp_path, toy_rule):
    recipe = _recipe(tmp_path, {"sampler": "left_to_right", "gen_length": 8, "block_length": 3, "steps": 5,
                                "left_to_right": {"width": 4}})
    # a rule without blocks: gen_length 8 in blocks of 3 and 5 steps are no problem of this rule
    shown = run_cli(["recipes", "show", recipe], env=toy_rule)
    assert shown.code == 0 and '"left_to_right": {"width": 4}' in shown.out
    checked = run_cli(["recipes", "check", recipe], env=toy_rule)
    assert checked.code == 0, checked.err
    assert "left_to_right:\n    width: 4" in checked.out
    for width, forwards in ((4, 2), (1, 8)):
        out = tmp_path / f"w{width}.jsonl"
        r = run_cli(["generate", recipe, "--output", out, "--set", f"generate.left_to_right.width={width}"], env=toy_rule)
        assert r.code == 0, r.err
        rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
        assert len(rows) == 3
        # one batch of 3 prompts: gen_length / width forward passes, so the rule read its own setting
        assert f"{forwards} forward passes" in r.err
        side = json.loads((tmp_path / f"w{width}.settings.json").read_text(encoding="utf-8"))
        assert side["sampler"]["sampler"] == "left_to_right"


def test_a_toy_rules_bad_setting_and_ignored_keys_are_refused_in_one_line(tmp_path, toy_rule):
    recipe = _recipe(tmp_path, {"sampler": "left_to_right", "gen_length": 8})
    for setting, words in (("generate.left_to_right.width=0", "generate.left_to_right.width: Input should be greater than or equal to 1"),
                           ("generate.left_to_right.depth=2", "unknown key 'generate.left_to_right.depth'"),
                           ("generate.cfg=1.5", "generate.cfg: not a setting of the rule 'left_to_right'"),
                           ("generate.sampler=left_to_rigth", "did you mean 'left_to_right'")):
        r = run_cli(["recipes", "check", recipe, "--set", setting], env=toy_rule)
        lines = r.err.strip().splitlines()
        assert r.code == 2 and len(lines) == 1 and lines[0].startswith("Error:") and words in lines[0], r.err


def test_the_sampler_and_the_verifier_are_registered_names_checked_without_torch():
    import subprocess

    # The objective package registers its objectives on import (its own catalog's business): its __init__ is
    # left out here so that what is asserted is the rules' and verifiers' path alone.
    code = textwrap.dedent("""
        import sys, types
        from pathlib import Path
        import dllm_align
        pkg = types.ModuleType("dllm_align.objective")
        pkg.__path__ = [str(Path(dllm_align.__file__).parent / "objective")]
        sys.modules["dllm_align.objective"] = pkg
        from dllm_align.config.recipe import load_recipe
        from dllm_align.core.errors import UserError
        for key in ("generate.sampler=lada", "online.rule=regex:(", "online.rule=math_answr"):
            try:
                load_recipe("demo", [key])
            except UserError as e:
                print(e.message)
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "generate.sampler: no decoding rule named 'lada' (did you mean 'llada'?)" in out
    assert "online.rule: not a valid regular expression" in out
    assert "online.rule: unknown verifier 'math_answr' (did you mean 'math_answer'?)" in out
    assert out.strip().endswith("False")


def test_a_rule_without_blocks_gets_no_block_check():
    # Dream decodes one canvas: no blocks, so neither gen_length's nor steps' block check applies
    GenerateSection(sampler="dream", gen_length=30, block_length=8, steps=7)
    GenerateSection(sampler="diffusion_gemma", gen_length=30, block_length=8, steps=7)
    for rule in ("llada", "block"):
        with pytest.raises(ValidationError, match="gen_length: 30 is not a multiple of block_length"):
            GenerateSection(sampler=rule, gen_length=30, block_length=8)
    assert components.get("rule", "dream").check is None
    # evaluate's tasks decode with the same rule: a task's own lengths are checked by it alone
    from dllm_align.config.schema import Recipe

    tasks = {"tasks": {"gsm8k": {"gen_length": 10, "block_length": 4}}}
    Recipe(generate={"sampler": "dream"}, evaluate=tasks)
    with pytest.raises(ValidationError, match="evaluate.tasks.gsm8k: gen_length: 10 is not a multiple of block_length"):
        Recipe(generate={"sampler": "llada"}, evaluate=tasks)


def test_cache_dual_with_the_dream_rule_is_refused_by_name():
    r = run_cli(["recipes", "check", "demo", "--set", "generate.sampler=dream", "--set", "generate.cache=dual"])
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1, r.err
    assert lines[0].startswith("Error: --set generate.cache=dual: generate.cache: not a setting of the rule 'dream'")


def test_auto_runs_the_family_rules_checks_once_the_model_is_known(tiny):
    from dllm_align.models.load import load_model

    dream = load_model("builtin:tiny-dream")
    auto = SamplerSettings(gen_length=30, block_length=8, steps=7, cfg=1.0)  # no rule named yet: nothing to refuse
    with pytest.raises(UserError, match="generate.cfg: not a setting of the rule 'dream'") as e:
        settings_for(dream, auto)
    assert "auto" in e.value.hint
    assert settings_for(dream, auto.replace(cfg=0.0)).sampler == "dream"  # no block check for Dream
    with pytest.raises(UserError, match="generate.gen_length: 30 is not a multiple of block_length"):
        settings_for(tiny, auto.replace(cfg=0.0))


def test_rules_load_lazily_by_name():
    assert {"llada", "dream", "block", "diffusion_gemma"} <= set(components.names("rule"))
    assert rule_for("dream").name == "dream" and rule_for("llada").name == "llada"
    with pytest.raises(UserError, match="generate.sampler: no rule named 'nosuch'"):
        rule_for("nosuch")
