"""CLI manners shared by every command: version, help speed, error lines and exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from typer.testing import CliRunner

from dllm_align import __version__
from dllm_align.cli.app import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0
    assert __version__ in r.stdout


def test_help_is_fast_and_light():
    # --help must not import torch or transformers.
    code = "import sys, dllm_align.cli.app as a; sys.argv=['dllm-align','--help']\ntry:\n a.main()\nexcept SystemExit: pass\nprint('torch' in sys.modules, 'transformers' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    elapsed = time.perf_counter() - t
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"
    assert elapsed < 5.0  # generous for a loaded CI box; typically ~0.3 s


def test_unknown_recipe_is_one_line_exit_2():
    r = runner.invoke(app, ["recipes", "show", "no_such_recipe"])
    assert r.exit_code == 2
    assert r.stderr.startswith("Error: no bundled recipe named 'no_such_recipe'")
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
