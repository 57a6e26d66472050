"""Run folders and hostile inputs, class by class.

1. No command writes over one of its own inputs (one guard in io, used by every writer).
2. A resumed or reused folder refuses every setting that changes the results, naming
   each key (exit 2), unless the user lets it through; a second writer of one output
   is refused.
4. Values are validated where they are read.
5. Every failure is one ``Error:`` line naming the user's path, line, key or flag.

Also: ``-o`` is the run folder in every command, and each command keeps its own record.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.core.errors import UserError

from fixtures.sort_toy import write_pairs

runner = CliRunner()


def error_lines(r) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.startswith("Error:")]


def one_error(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    lines = error_lines(r)
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def prompts_file(tmp: Path, n: int = 3) -> Path:
    p = tmp / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"sort {i} 2 1"}) + "\n" for i in range(n)), encoding="utf-8")
    return p


def gen_recipe(tmp: Path, **gen) -> Path:
    prompts = prompts_file(tmp)
    g = {"gen_length": 8, "block_length": 8, "steps": 4, "batch_size": 2, **gen}
    path = tmp / "gen.yaml"
    path.write_text(yaml.safe_dump({"name": "g", "output_dir": str(tmp / "run"), "data": {"test": str(prompts)}, "generate": g}))
    return path


# --------------------------------------------------------------------------- class 1
def test_generate_overwrite_never_replaces_the_prompts_or_the_recipes_test_file(tmp_path):
    recipe = gen_recipe(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    before = prompts.read_bytes()
    # the prompts given with --prompts
    r = runner.invoke(app, ["generate", str(recipe), "--prompts", str(prompts), "--output", str(prompts), "--overwrite"])
    assert "refusing to overwrite the input" in one_error(r) and str(prompts) in r.stderr
    # the recipe's own data.test file, through a different spelling of the same path
    other = tmp_path / "sub" / ".." / "prompts.jsonl"
    (tmp_path / "sub").mkdir()
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(other), "--overwrite"])
    assert "refusing to overwrite the input" in one_error(r)
    assert prompts.read_bytes() == before
    assert not (tmp_path / "prompts.settings.json").exists()


def test_judge_never_writes_over_an_input_in_its_output_folder(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    rows = [{"id": str(i), "prompt": "p", "completion": "x" * i} for i in range(3)]
    a = out / "outcomes.jsonl"  # the name judge gives its own per-prompt file
    b = tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(x) + "\n" for x in rows))
    b.write_text("".join(json.dumps(dict(x, completion="yy")) + "\n" for x in rows))
    before = a.read_bytes()
    r = runner.invoke(app, ["judge", str(a), str(b), "-o", str(out), "--judge", "rule:longer", "--bootstrap", "100"])
    assert "refusing to overwrite the input" in one_error(r)
    assert a.read_bytes() == before


def test_every_io_writer_refuses_a_noted_input(tmp_path):
    from dllm_align.core import io

    src = tmp_path / "rows.jsonl"
    src.write_text('{"a": 1}\n')
    io.forget_inputs()
    io.note_input(src, "input data")
    try:
        with pytest.raises(UserError, match="refusing to overwrite the input"):
            io.atomic_write_text(src, "x")
        with pytest.raises(UserError, match="refusing to overwrite the input"):
            io.JsonlAppender(src)
        with pytest.raises(UserError, match="refusing to overwrite the input"):
            io.FileLock(src, "busy").__enter__()
        io.atomic_write_text(tmp_path / "other.jsonl", "fine")  # other paths are untouched
    finally:
        io.forget_inputs()
    assert src.read_text() == '{"a": 1}\n'


# --------------------------------------------------------------------------- class 2
@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("runfolders")
    data = write_pairs(root / "pairs.jsonl", n=8)
    recipe = {
        "name": "rf-toy",
        "model": {"name_or_path": "builtin:tiny"},
        "data": {"train": str(data), "format": "paired", "max_length": 48},
        "reference": {"n_mc": 2, "batch_size": 16, "shard_size": 8},
        "train": {"lr": 1e-3, "warmup_ratio": 0.0, "batch_size": 4, "max_steps": 2, "save_every": 1},
    }
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return {"root": root, "recipe": path}


def test_train_resume_refuses_changed_settings_naming_each_unless_let_through(toy, tmp_path):
    out = tmp_path / "run"
    rec = str(toy["recipe"])
    assert runner.invoke(app, ["precompute-ref", rec, "-o", str(out)]).exit_code == 0
    r = runner.invoke(app, ["train", rec, "-o", str(out), "--set", "train.max_steps=1"])
    assert r.exit_code == 0, r.output
    record = (out / "recipe.train.yaml").read_bytes()

    r = runner.invoke(
        app, ["train", rec, "-o", str(out), "--resume", "--set", "train.lr=0.01", "--set", "train.beta=0.2",
              "--set", "train.objective=vrpo", "--set", "train.max_steps=1"],
    )
    line = one_error(r)
    for needle in ("train.lr (was 0.001, now 0.01)", "train.beta (was 0.1, now 0.2)", 'train.objective (was "elbo_kto", now "vrpo")'):
        assert needle in line, line
    assert "--allow-change train.lr" in r.stderr
    assert (out / "recipe.train.yaml").read_bytes() == record  # the record still describes the run

    # settings that do not change the numbers (how often to log or save) are free
    r = runner.invoke(app, ["train", rec, "-o", str(out), "--resume", "--set", "train.log_every=5", "--set", "train.max_steps=1"])
    assert r.exit_code == 0, r.output

    # explicitly let through: the run continues and its record keeps the change
    r = runner.invoke(app, ["train", rec, "-o", str(out), "--resume", "--set", "train.lr=0.01",
                            "--allow-change", "train.lr", "--allow-change", "train.max_steps"])
    assert r.exit_code == 0, r.output
    assert "train.lr changed on resume" in r.stderr
    info = json.loads((out / "run_info.train.json").read_text())
    assert info["changes"] == [
        {"key": "train.lr", "was": 0.001, "now": 0.01, "at_step": 1},
        {"key": "train.max_steps", "was": 1, "now": 2, "at_step": 1},
    ]
    assert yaml.safe_load((out / "recipe.train.yaml").read_text())["train"]["lr"] == 0.01


def test_precompute_refuses_to_replace_a_cache_made_with_other_settings(toy, tmp_path):
    out = tmp_path / "run"
    rec = str(toy["recipe"])
    assert runner.invoke(app, ["precompute-ref", rec, "-o", str(out)]).exit_code == 0
    manifest = out / "ref_cache" / "manifest.json"
    shard = out / "ref_cache" / "shard-00000.safetensors"
    before = (manifest.read_bytes(), shard.read_bytes())
    r = runner.invoke(app, ["precompute-ref", rec, "-o", str(out), "--set", "reference.seed=1", "--set", "reference.n_mc=3"])
    line = one_error(r)
    assert "reference.seed (was 0, now 1)" in line and "reference.n_mc (was 2, now 3)" in line, line
    assert (manifest.read_bytes(), shard.read_bytes()) == before  # nothing deleted or recomputed
    # an interrupted cache (no manifest) whose shard has other settings is refused too
    manifest.unlink()
    r = runner.invoke(app, ["precompute-ref", rec, "-o", str(out), "--set", "reference.seed=1"])
    assert "shard-00000.safetensors" in one_error(r)
    assert shard.read_bytes() == before[1]
    # said explicitly: replaced
    r = runner.invoke(app, ["precompute-ref", rec, "-o", str(out), "--set", "reference.seed=1", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert json.loads(manifest.read_text())["fingerprint"]["seed"] == 1


def test_a_second_generate_onto_the_same_output_is_refused(tmp_path):
    from dllm_align.core.io import FileLock

    recipe = gen_recipe(tmp_path)
    out = tmp_path / "run" / "gen.test.jsonl"
    with FileLock(out, "held by the test"):  # a first `generate` still writing
        r = runner.invoke(app, ["generate", str(recipe), "-o", str(tmp_path / "run"), "--temperature", "0.5"])
        assert "another `dllm-align generate` is writing to" in one_error(r)
    assert not (tmp_path / "run" / "gen.test.settings.json").exists()
    # once it is done, the same command runs; the run folder holds generate's own record only
    r = runner.invoke(app, ["generate", str(recipe), "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out)
    assert (tmp_path / "run" / "recipe.generate.yaml").exists() and not (tmp_path / "run" / "recipe.train.yaml").exists()


def test_generate_into_a_training_folder_keeps_trains_record(tmp_path):
    recipe = gen_recipe(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.train.yaml").write_text("train record\n")
    assert runner.invoke(app, ["generate", str(recipe), "-o", str(run), "--output", str(run / "gen.base.jsonl")]).exit_code == 0
    assert (run / "recipe.train.yaml").read_text() == "train record\n"
    assert (run / "gen.base.jsonl").exists() and (run / "recipe.generate.yaml").exists()


def test_o_is_the_run_folder_everywhere(tmp_path):
    recipe = gen_recipe(tmp_path)
    r = runner.invoke(app, ["generate", str(recipe), "-o", str(tmp_path / "g.jsonl")])
    assert "-o names the run folder" in one_error(r) and "--output" in r.stderr
    src = prompts_file(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "prompt": "p", "completion": "c", "label": i % 2 == 0}) + "\n" for i in range(4)))
    r = runner.invoke(app, ["convert", str(rows), "-o", str(tmp_path / "conv")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "conv" / "unpaired.jsonl").exists()
    r = runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "c.jsonl")])
    assert "-o names the run folder" in one_error(r)
    for cmd in (["generate", "x"], ["convert", "x"], ["train", "x"], ["precompute-ref", "x"], ["judge", "a", "b"], ["demo"], ["evaluate", "x"]):
        h = runner.invoke(app, [*cmd, "--help"])
        assert "-o" in h.stdout and "--output-dir" in h.stdout, cmd


# --------------------------------------------------------------------------- class 4
def test_duplicate_yaml_keys_are_an_error(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: d\ntrain:\n  beta: 0.3\ngenerate:\n  steps: 8\ntrain:\n  lr: 1.0\n")
    line = one_error(runner.invoke(app, ["recipes", "check", str(p)]))
    assert f"{p}:6" in line and "duplicate key 'train' (first on line 2)" in line


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused_by_recipes_check(tmp_path, value):
    p = tmp_path / "r.yaml"
    p.write_text(f"name: r\ntrain:\n  beta: {value}\n")
    line = one_error(runner.invoke(app, ["recipes", "check", str(p)]))
    assert "train.beta" in line and "finite" in line


def test_mask_token_id_outside_the_vocabulary_is_refused(tmp_path):
    recipe = gen_recipe(tmp_path)
    r = runner.invoke(app, ["generate", str(recipe), "--set", "model.mask_token_id=999999"])
    line = one_error(r)
    assert "mask token id 999999 is outside the model's vocabulary" in line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_generation_beyond_the_models_positions_is_refused_before_decoding(tmp_path):
    recipe = gen_recipe(tmp_path)
    r = runner.invoke(app, ["generate", str(recipe), "--gen-length", "8192", "--block-length", "8192", "--steps", "1"])
    line = one_error(r)
    assert "beyond the model's 4096 positions" in line and "--allow-long" in r.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing left behind


# --------------------------------------------------------------------------- class 5
def test_lone_surrogates_are_one_line_naming_file_and_line(tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "ok", "completion": "ok", "label": true}\n{"prompt": "bad \\ud800", "completion": "x", "label": false}\n')
    r = runner.invoke(app, ["convert", str(src), "--output", str(tmp_path / "o.jsonl")])
    line = one_error(r)
    assert f"{src}:2" in line and "surrogate" in line
    assert not (tmp_path / "o.jsonl").exists()
    j = tmp_path / "s.json"
    j.write_text('[{"prompt": "\\udc00", "completion": "x", "label": true}]')
    line = one_error(runner.invoke(app, ["convert", str(j), "--output", str(tmp_path / "o.jsonl")]))
    assert f"{j} row 0" in line and "surrogate" in line


def _rows(tmp: Path) -> Path:
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "prompt": "p", "completion": "c", "label": i % 2 == 0}) + "\n" for i in range(4)))
    return rows


def test_output_that_is_a_folder_names_the_users_path(tmp_path):
    target = tmp_path / "out.jsonl"
    target.mkdir()
    line = one_error(runner.invoke(app, ["convert", str(_rows(tmp_path)), "--output", str(target)]))
    assert f"cannot write {target}: it is a folder" in line
    # and the other way round: a file where the run folder should be
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = one_error(runner.invoke(app, ["convert", str(_rows(tmp_path)), "-o", str(afile)]))
    assert f"{afile} is a file, not a folder" in line
    line = one_error(runner.invoke(app, ["precompute-ref", "demo", "-o", str(afile), "--set", "data.limit=4"]))
    assert f"{afile} is a file, not a folder" in line
    assert afile.read_text() == "x"


@pytest.mark.parametrize(
    "code, needle, exit_code",
    [(errno.ENOSPC, "no space left on the device", 1), (errno.EROFS, "permission denied or read-only", 2),
     (errno.EACCES, "permission denied or read-only", 2)],
)
def test_full_or_read_only_disk_names_the_users_path_not_our_temp_file(tmp_path, monkeypatch, code, needle, exit_code):
    import dllm_align.core.io as dio

    real = dio.os.fsync

    def failing(fd):  # the data reaches the disk at fsync: a full disk fails here
        raise OSError(code, os.strerror(code))

    target = tmp_path / "o.jsonl"
    monkeypatch.setattr(dio.os, "fsync", failing)
    r = runner.invoke(app, ["convert", str(_rows(tmp_path)), "--output", str(target)])
    monkeypatch.setattr(dio.os, "fsync", real)
    line = one_error(r, exit_code)
    assert f"cannot write {target}: {needle}" in line and ".tmp" not in line, line
    assert not target.exists() and not list(tmp_path.glob(".o.jsonl.*"))


def test_a_failed_write_outside_our_writers_names_the_users_file():
    from dllm_align.core.io import user_path

    assert user_path("/r/ckpt/.model.safetensors.1a2b3c4d-77.x8k_.tmp") == Path("/r/ckpt/model.safetensors")
    assert user_path("/r/plain.json") == Path("/r/plain.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path):
    line = one_error(runner.invoke(app, ["generate", str(gen_recipe(tmp_path)), "--device", "cuda"]))
    assert "--device cuda: CUDA is not available" in line
    line = one_error(runner.invoke(app, ["generate", str(gen_recipe(tmp_path)), "--device", "gpu0"]))
    assert "--device gpu0" in line


def test_a_function_that_is_not_a_judging_rule_is_refused(tmp_path):
    rows = [{"id": "1", "prompt": "p", "completion": "x"}]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(rows[0]) + "\n")
    b.write_text(json.dumps(rows[0]) + "\n")
    r = runner.invoke(app, ["judge", str(a), str(b), "-o", str(tmp_path / "j"), "--judge", "rule:json:loads"])
    assert "not a judging rule" in one_error(r)


def test_errors_from_flags_and_set_are_blamed_on_them_not_the_recipe_file(tmp_path):
    recipe = gen_recipe(tmp_path)
    line = one_error(runner.invoke(app, ["generate", str(recipe), "--temperature", "-1"]))
    assert line.startswith("Error: --temperature -1.0: generate.temperature"), line
    line = one_error(runner.invoke(app, ["recipes", "check", "demo", "--set", "train.beta=-1"]))
    assert line.startswith("Error: --set train.beta=-1: train.beta"), line
    # a check across fields of a section: the file *with* the flag that took part
    line = one_error(runner.invoke(app, ["generate", str(recipe), "--block-length", "3"]))
    assert f"{recipe} with --block-length 3" in line, line


def test_a_local_name_never_silently_hides_a_bundled_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # a run folder called demo: the bundled recipe is still used
    r = runner.invoke(app, ["recipes", "check", "demo"])
    assert r.exit_code == 0, r.output
    (tmp_path / "demo").rmdir()
    (tmp_path / "demo").write_text("name: mine\n")  # a file of that name: ambiguous, refused
    r = runner.invoke(app, ["recipes", "check", "demo"])
    assert "both a bundled recipe and a file here" in one_error(r) and "./demo" in r.stderr
    r = runner.invoke(app, ["recipes", "check", "./demo"])
    assert r.exit_code == 0 and "mine" in r.stdout

