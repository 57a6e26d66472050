"""The fifth adversarial round's classes, kept as fast refusals (docs/reliability.md, "fifth round").

Each case runs the console entry point in this process (``reliability.run_cli``) and asserts the house manners:
bad input exits 2 with one ``Error:`` line naming the key, file or flag (a fault at run time exits 1), no
traceback, no output folder left behind and nothing written outside it. Every case here is refused before a
model is trained or a prompt sampled, so the file runs in seconds.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from reliability import run_cli, snapshot


def refused(r, *needles, code: int = 2) -> str:
    """The one ``Error:`` line of a refusal, checked: exit ``code``, no traceback, the line names every needle."""
    assert r.exc is None, r.traceback
    assert r.code == code, (r.code, r.err[-2000:])
    errors = [line for line in r.err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, r.err[-2000:]
    assert "Traceback" not in r.err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "p.txt"
    p.write_text("Sort: 3 1 2\n")
    return p


# --------------------------------------------------------------------------- settings of another family or noise
@pytest.mark.parametrize("sampler", ["llada", "dream"])
def test_a_masked_diffusion_rule_on_diffusiongemma_is_refused_by_name(tmp_path, prompts, sampler):
    out = tmp_path / "g"
    r = run_cli(["generate", "demo_gemma", "-o", out, "--prompts", prompts, "--sampler", sampler])
    refused(r, "generate.sampler", sampler, "uniform")
    assert not out.exists()


def test_a_gen_length_beyond_diffusiongemmas_positions_is_refused(tmp_path, prompts):
    out = tmp_path / "g"
    r = run_cli(["generate", "demo_gemma", "-o", out, "--prompts", prompts, "--gen-length", "100000"])
    refused(r, "gen_length", "positions")
    assert not out.exists()


@pytest.mark.parametrize("recipe, key", [("demo", "reference.surrogate=flat_ce"),
                                         ("demo", "reference.parameterization=loo"),
                                         ("demo_block", "reference.self_conditioning=detached"),
                                         ("demo_block", "reference.time_power=3")])
def test_recipes_check_refuses_a_setting_of_another_noise_process(recipe, key):
    r = run_cli(["recipes", "check", recipe, "--set", key])
    refused(r, key.partition("=")[0], "likelihood")
    assert r.out == ""


def test_recipes_check_refuses_packing_on_diffusiongemma_and_demo_leaves_no_folder(tmp_path):
    refused(run_cli(["recipes", "check", "demo_gemma", "--set", "data.padding=packed"]), "data.padding")
    out = tmp_path / "d"
    refused(run_cli(["demo", "--recipe", "demo_gemma", "--set", "data.padding=packed", "-o", out]), "data.padding")
    assert not out.exists()


def test_diffusiongemmas_default_shape_passes_recipes_check(tmp_path):
    """gen_length 16 with sampler auto: the block rule's check never applies to the family's own rule."""
    recipe = tmp_path / "g16.yaml"
    recipe.write_text("extends: demo\nmodel:\n  name_or_path: builtin:tiny-diffusiongemma\n"
                      "generate:\n  gen_length: 16\n  block_length: 32\n  steps: 16\n  sampler: auto\n")
    r = run_cli(["recipes", "check", recipe])
    assert r.code == 0, r.err


# --------------------------------------------------------------------------- refusals before the work
@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "86400", "5s", "1e400"])
def test_a_bad_rule_timeout_is_refused_before_any_work(tmp_path, value):
    out = tmp_path / "lab"
    r = run_cli(["label", "demo", "-o", out, "--rule", "sort"], env={"DLLM_ALIGN_RULE_TIMEOUT": value})
    refused(r, "DLLM_ALIGN_RULE_TIMEOUT")
    assert "samples from" not in r.err and not out.exists()


def test_a_20000_character_name_is_not_echoed_whole(tmp_path):
    name = "x" * 20000
    for args in (["recipes", "check", "demo", "--set", f"generate.backend={name}"],
                 ["recipes", "check", "demo", "--set", f"generate.sampler={name}"],
                 ["recipes", "check", "demo", "--set", f"train.{name}=1"]):
        line = refused(run_cli(args))
        assert len(line) < 1000, len(line)


def test_a_trailing_space_kept_in_a_backend_name_is_refused():
    """A quoted trailing space is part of the name (an unquoted one is not, in --set as in a recipe file: YAML)."""
    refused(run_cli(["recipes", "check", "demo", "--set", 'generate.backend="in_process "']), "generate.backend")


# --------------------------------------------------------------------------- recipes check on numbers
def test_a_5000_digit_integer_is_refused_naming_the_key(tmp_path):
    r = run_cli(["recipes", "check", "demo", "--set", "train.seed=" + "9" * 5000])
    refused(r, "train.seed", "5,000 digits")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: demo\ntrain:\n  max_steps: " + "1" * 5000 + "\n")
    refused(run_cli(["recipes", "check", recipe]), "train.max_steps")


def test_a_process_group_timeout_beyond_a_week_is_refused_at_check():
    refused(run_cli(["recipes", "check", "demo", "--set", "train.process_group_timeout_minutes=1e300"]),
            "train.process_group_timeout_minutes")
