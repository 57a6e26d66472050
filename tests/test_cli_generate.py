"""`dllm-align generate` through the CLI: outputs, settings guard, a torn last line, two processes.

Kill and resume at chosen points: tests/test_reliability_kill.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dllm_align.cli.app import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]

PROMPTS = [
    "hi",
    "what is two plus two?",
    "sort 3 1 2",
    "a much longer prompt about many different things at once",
    "name a colour",
    "why is the sky blue?",
]




def write_setup(tmp: Path, gen: dict | None = None) -> Path:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": [{"role": "user", "content": t}]}) + "\n" for i, t in enumerate(PROMPTS)),
        encoding="utf-8",
    )
    train = tmp / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"id": f"t{i}", "prompt": f"train prompt {i}", "completion": "ok", "label": True}) + "\n" for i in range(3)),
        encoding="utf-8",
    )
    g = {"gen_length": 16, "block_length": 8, "steps": 8, "batch_size": 2, **(gen or {})}
    recipe = {"name": "t", "output_dir": str(tmp / "run"), "data": {"test": str(prompts), "train": str(train)}, "generate": g}
    path = tmp / "recipe.yaml"
    path.write_text(json.dumps(recipe), encoding="utf-8")  # JSON is YAML
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def env() -> dict:
    e = dict(os.environ)
    e.update(PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", DLLM_ALIGN_NO_PROGRESS="1", HF_HUB_OFFLINE="1")
    return e


def test_generate_writes_rows_settings_and_run_info(tmp_path):
    recipe = write_setup(tmp_path)
    out = tmp_path / "gen" / "out.jsonl"
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(out)])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == str(out)
    rows = read_rows(out)
    assert [x["id"] for x in rows] == [f"p{i}" for i in range(len(PROMPTS))]  # input order
    for x, t in zip(rows, PROMPTS):
        assert x["prompt"] == [{"role": "user", "content": t}]
        assert isinstance(x["completion"], str) and x["finish_reason"] in ("stop", "length")
        assert 0 <= x["num_tokens"] <= 16
        assert x["settings"]["sampler"]["gen_length"] == 16
    side = json.loads((tmp_path / "gen" / "out.settings.json").read_text())
    assert side == rows[0]["settings"]
    assert side["model"] == "builtin:tiny" and side["dtype"] == "float32" and side["split"] == "test"
    assert side["sampler"] == {
        "gen_length": 16, "block_length": 8, "steps": 8, "remasking": "low_confidence", "temperature": 0.0,
        "cfg": 0.0, "cache": "none", "threshold": None, "seed": 0,
        "sampler": "auto", "alg": "origin", "alg_temp": 0.0, "top_p": None, "top_k": None, "eps": 1e-3,
    }
    assert (tmp_path / "gen" / "recipe.generate.yaml").exists() and (tmp_path / "gen" / "run_info.generate.json").exists()
    assert "6 prompts in" in r.stderr and "tokens/s" in r.stderr

    # A rerun has nothing to do and leaves the file as it was.
    before = out.read_bytes()
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(out)])
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes() == before and "6 already in" in r.stderr


def test_completions_match_the_library_sampler(tmp_path, tiny):
    from dllm_align.generate.settings import SamplerSettings, encode_prompt, row_seed
    from dllm_align.generate.sampler import generate_batch

    recipe = write_setup(tmp_path, {"temperature": 0.5, "remasking": "random", "seed": 4})
    out = tmp_path / "o.jsonl"
    assert runner.invoke(app, ["generate", str(recipe), "--output", str(out), "--limit", "2"]).exit_code == 0
    st = SamplerSettings(gen_length=16, block_length=8, steps=8, temperature=0.5, remasking="random", seed=4)
    for row, text in zip(read_rows(out), PROMPTS):
        ids = encode_prompt(tiny.tokenizer, [{"role": "user", "content": text}])
        c = generate_batch(tiny, [ids], st, seeds=[row_seed(4, row["id"])])[0]
        assert row["completion"] == c.text and row["num_tokens"] == len(c.ids)


def test_flags_override_the_recipe_and_fast_sets_cache_and_threshold(tmp_path):
    recipe = write_setup(tmp_path)
    out = tmp_path / "f.jsonl"
    r = runner.invoke(
        app,
        ["generate", str(recipe), "--output", str(out), "--fast", "--gen-length", "32", "--block-length", "16", "--steps", "4",
         "--cfg", "0.5", "--temperature", "0.3", "--seed", "9", "--batch-size", "4", "--limit", "3"],
    )
    assert r.exit_code == 0, r.stderr
    s = json.loads((tmp_path / "f.settings.json").read_text())["sampler"]
    assert (s["gen_length"], s["block_length"], s["steps"], s["cfg"], s["temperature"], s["seed"]) == (32, 16, 4, 0.5, 0.3, 9)
    assert s["cache"] == "dual" and s["threshold"] == 0.9
    assert len(read_rows(out)) == 3
    # --fast keeps an explicit cache choice.
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(tmp_path / "g.jsonl"), "--fast", "--cache", "prefix", "--limit", "1"])
    assert r.exit_code == 0, r.stderr
    assert json.loads((tmp_path / "g.settings.json").read_text())["sampler"]["cache"] == "prefix"


def test_split_train_and_prompts_file(tmp_path):
    recipe = write_setup(tmp_path)
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(tmp_path / "tr.jsonl"), "--split", "train"])
    assert r.exit_code == 0, r.stderr
    assert [x["prompt"][0]["content"] for x in read_rows(tmp_path / "tr.jsonl")] == [f"train prompt {i}" for i in range(3)]
    txt = tmp_path / "p.txt"
    txt.write_text("first line prompt\nsecond line prompt\n", encoding="utf-8")
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(tmp_path / "txt.jsonl"), "--prompts", str(txt)])
    assert r.exit_code == 0, r.stderr
    assert [x["prompt"][0]["content"] for x in read_rows(tmp_path / "txt.jsonl")] == ["first line prompt", "second line prompt"]


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--sampler", "llada", "--gen-length", "30"], "generate.gen_length: 30 is not a multiple of block_length (8)"),
        (["--sampler", "llada", "--steps", "3"], "generate.steps: 3 is not a multiple of the number of blocks (2"),
        (["--remasking", "lowest"], "generate.remasking"),
        (["--temperature", "-1"], "generate.temperature"),
        (["--cache", "full"], "generate.cache"),
        (["--set", "generate.gen_lenght=8"], "did you mean 'generate.gen_length'"),
        (["--output", "x.json"], "expected a .jsonl file name"),
    ],
)
def test_bad_settings_exit_2(tmp_path, args, msg):
    recipe = write_setup(tmp_path)
    argv = ["generate", str(recipe)] + (args if "--output" in args else ["--output", str(tmp_path / "o.jsonl")] + args)
    r = runner.invoke(app, argv)
    assert r.exit_code == 2, r.stderr
    assert msg in r.stderr and r.stderr.startswith("Error:")
    assert not (tmp_path / "o.jsonl").exists()


def test_no_prompt_source_exit_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("generate: {gen_length: 8, block_length: 8, steps: 8}\n", encoding="utf-8")
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 2 and "the recipe has no data.test" in r.stderr


def test_refuses_to_mix_settings_and_overwrite_starts_afresh(tmp_path):
    recipe = write_setup(tmp_path)
    out = tmp_path / "o.jsonl"
    assert runner.invoke(app, ["generate", str(recipe), "--output", str(out), "--limit", "2"]).exit_code == 0
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(out), "--temperature", "0.7"])
    assert r.exit_code == 2
    assert "made with other settings" in r.stderr and "sampler.temperature (was 0.0, now 0.7)" in r.stderr
    assert len(read_rows(out)) == 2  # untouched
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(out), "--temperature", "0.7", "--overwrite"])
    assert r.exit_code == 0, r.stderr
    assert len(read_rows(out)) == len(PROMPTS)
    assert json.loads((tmp_path / "o.settings.json").read_text())["sampler"]["temperature"] == 0.7
    # An output without its settings file is not appended to either.
    (tmp_path / "o.settings.json").unlink()
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(out), "--temperature", "0.7"])
    assert r.exit_code == 2 and "has no o.settings.json" in r.stderr


def test_torn_last_line_is_recovered_and_every_id_written_once(tmp_path):
    recipe = write_setup(tmp_path)
    whole, out = tmp_path / "whole.jsonl", tmp_path / "o.jsonl"
    assert runner.invoke(app, ["generate", str(recipe), "--output", str(whole)]).exit_code == 0
    assert runner.invoke(app, ["generate", str(recipe), "--output", str(out), "--limit", "3"]).exit_code == 0
    with open(out, "ab") as f:
        f.write(b'{"id": "p3", "prompt": [{"role": "us')  # a kill in the middle of a write
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(out)])
    assert r.exit_code == 0, r.stderr
    assert "3 already in" in r.stderr
    rows = read_rows(out)
    assert [x["id"] for x in rows] == [f"p{i}" for i in range(len(PROMPTS))]
    # Completions are per-prompt (own seed, batch-independent): same file as one uninterrupted run.
    assert rows == read_rows(whole)


@pytest.mark.multiproc
def test_two_processes_write_the_same_file_as_one(tmp_path):
    recipe = write_setup(tmp_path, {"temperature": 0.8, "remasking": "random", "batch_size": 2})
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    r = runner.invoke(app, ["generate", str(recipe), "--output", str(one)])
    assert r.exit_code == 0, r.stderr
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "dllm_align", "generate", str(recipe), "--output", str(two)]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert two.read_bytes() == one.read_bytes()
    assert p.stdout.strip() == str(two)  # only rank 0 reports the result
    assert "rank 0:" in p.stderr and "rank 1:" in p.stderr
    assert not list(tmp_path.glob("two.part*"))
