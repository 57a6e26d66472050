"""CLI manners shared by every command: version, help speed, error lines and exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from dllm_align import __version__
from dllm_align.cli.app import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0
    assert __version__ in r.stdout


def test_help_is_light():
    # --help must not import torch or transformers (its speed is measured by `benchmarks/run.py --only cli_startup`).
    code = "import sys, dllm_align.cli.app as a; sys.argv=['dllm-align','--help']\ntry:\n a.main()\nexcept SystemExit: pass\nprint('torch' in sys.modules, 'transformers' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_unknown_recipe_is_one_line_exit_2():
    r = runner.invoke(app, ["recipes", "show", "no_such_recipe"])
    assert r.exit_code == 2
    assert r.stderr.startswith("Error: no bundled recipe named 'no_such_recipe'")
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "argv, named",
    [
        (["online", "demo", "--rounds", "0"], "--rounds 0: online.rounds: Input should be greater than or equal to 1"),
        (["online", "demo", "--n", "0"], "--n 0: online.n: Input should be greater than or equal to 1"),
        (["online", "demo", "--limit", "0"], "--limit 0: online.limit: Input should be greater than or equal to 1"),
        (["generate", "demo", "--limit", "0"], "--limit 0: generate.limit: Input should be greater than or equal to 1"),
        (["generate", "demo", "--gen-length", "0"], "--gen-length 0: generate.gen_length: Input should be greater than or equal to 1"),
        (["judge", "a.jsonl", "b.jsonl", "--concurrency", "0"], "--concurrency 0: judge.concurrency: Input should be greater than or equal to 1"),
    ],
)
def test_a_flag_given_as_zero_reaches_the_schema(tmp_path, argv, named):
    # 0 is a value, never "not given": the schema refuses it by the flag's name (the recipe's value never replaces it).
    r = runner.invoke(app, argv + ["-o", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"Error: {named}"), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_flag_given_as_zero_is_applied(tmp_path):
    # over the recipe's value (a --set of the same key beside the flag is refused: tests/test_reliability_round5.py)
    recipe = tmp_path / "seed5.yaml"
    recipe.write_text("extends: demo\ngenerate:\n  seed: 5\n")
    r = runner.invoke(app, ["generate", str(recipe), "-o", str(tmp_path), "--limit", "1", "--seed", "0"])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load((tmp_path / "recipe.generate.yaml").read_text())["generate"]["seed"] == 0
