"""Kill and resume, for every command that writes while it works (README "Reliability").

Each command is SIGKILLed at three or four points chosen with DLLM_ALIGN_FAULT
(``dllm_align.core.faults``): after the first records, in the middle of writing a
record (a torn log line, or a shard's temporary file written but not renamed),
and after the last record but before the final files. Then the same command
is run again (``train --resume``) and must end with exactly the files of an
uninterrupted run: no record lost, none duplicated, no temporary file left.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from fixtures.sort_toy import write_pairs
from judge_server import JudgeServer, answer
from reliability import run_cli, run_killed, stray_temps

KEY = "sk-test-kill-0123456789abcdef"




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A toy recipe (16 pairs = 32 rows, 4 cache shards, 6 test prompts) and its uninterrupted runs."""
    root = tmp_path_factory.mktemp("kill")
    data = write_pairs(root / "pairs.jsonl", n=16)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Sort: {i} 3 1 2"}) + "\n" for i in range(6)))
    recipe = {
        "name": "kill-toy",
        "model": {"name_or_path": "builtin:tiny"},
        "data": {"train": str(data), "test": str(prompts), "format": "paired", "max_length": 64},
        "reference": {"n_mc": 4, "batch_size": 8, "shard_size": 8},
        "train": {"lr": 1e-3, "warmup_ratio": 0.25, "batch_size": 2, "max_steps": 5, "save_every": 2},
        "generate": {"gen_length": 16, "block_length": 8, "steps": 8, "batch_size": 2, "temperature": 0.7, "seed": 3},
    }
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    straight = root / "straight"
    r = run_cli(["precompute-ref", path, "-o", straight])
    assert r.code == 0, r.err
    r = run_cli(["train", path, "-o", straight])
    assert r.code == 0, r.err
    r = run_cli(["generate", path, "--output", straight / "gen.jsonl"])
    assert r.code == 0, r.err
    return {"root": root, "recipe": path, "straight": straight}


def _cache_files(folder: Path) -> dict:
    """Every shard's values and metadata, and the manifest without its creation time and file hashes.

    (safetensors writes its metadata in hash-map order, so equal shards need not be equal bytes.)
    """
    from safetensors import safe_open

    files = {}
    for p in sorted(folder.iterdir()):
        if p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                files[p.name] = (f.get_tensor("elbo").numpy().tobytes(), f.metadata())
        else:
            files[p.name] = p.name
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("created")
    for entry in manifest["shards"]:
        entry.pop("sha256")
    files["manifest.json"] = manifest
    return files


# --------------------------------------------------------------------------- precompute-ref
@pytest.mark.parametrize("fault, shards_on_disk", [
    ("kill_after_records:1", 1),   # one shard renamed into place, three to go
    ("kill_mid_record:2", 1),      # shard 2 written to its temporary file, not renamed
    ("kill_after_records:4", 4),   # every shard done, the manifest not yet written
])
def test_precompute_ref(setup, tmp_path, fault, shards_on_disk):
    out = tmp_path / "run"
    args = ["precompute-ref", setup["recipe"], "-o", out]
    k = run_killed(args, fault)
    assert k.code == -9, k.err
    cache = out / "ref_cache"
    assert len(list(cache.glob("shard-*.safetensors"))) == shards_on_disk
    assert not (cache / "manifest.json").exists()  # an interrupted cache is never mistaken for a complete one
    if fault.startswith("kill_mid"):
        assert len(stray_temps(cache)) == 1  # the kill left the shard's temporary file behind

    r = run_cli(args)
    assert r.code == 0, r.err
    assert f"{shards_on_disk} already done" in r.err
    assert stray_temps(out) == []
    assert _cache_files(cache) == _cache_files(setup["straight"] / "ref_cache")


# --------------------------------------------------------------------------- train
def _metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock columns."""
    timing = ("tokens_per_s", "examples_per_s", "seconds")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("fault, checkpoints, resumes_at", [
    ("kill_after_step:1", [], 0),                    # before the first checkpoint: starts again
    ("kill_after_step:3", ["step-2"], 2),            # between checkpoints: step 3 is redone
    ("kill_in_checkpoint:4", ["step-2"], 2),         # half of checkpoint 4 written: ignored, removed
    ("kill_in_final", ["step-2", "step-4"], None),   # final/ complete but not renamed: finished on resume
])
def test_train(setup, tmp_path, fault, checkpoints, resumes_at):
    out = tmp_path / "run"
    shutil.copytree(setup["straight"] / "ref_cache", out / "ref_cache")
    args = ["train", setup["recipe"], "-o", out]
    k = run_killed(args, fault)
    assert k.code == -9, k.err
    assert not (out / "final").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == checkpoints

    r = run_cli(args + ["--resume"])
    assert r.code == 0, r.err
    if resumes_at is None:
        assert "finished the final export" in r.err and "already finished" in r.err
    elif resumes_at:
        assert f"resuming from {out / 'checkpoints' / f'step-{resumes_at}'} (step {resumes_at} of 5)" in r.err
    else:
        assert "starting from step 0" in r.err
    straight = setup["straight"]
    assert _metrics(out) == _metrics(straight)  # every step once, same numbers
    a, b = _weights(straight / "final"), _weights(out / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert stray_temps(out) == []


# --------------------------------------------------------------------------- generate
@pytest.mark.parametrize("fault, lines_before", [
    ("kill_after_records:1", 1),   # in the middle of a batch of two prompts
    ("kill_mid_record:3", 2),      # half of row 3 on disk: a torn last line
    ("kill_after_records:6", 6),   # every row written, the final ordered file not yet
])
def test_generate(setup, tmp_path, fault, lines_before):
    out = tmp_path / "gen.jsonl"
    args = ["generate", setup["recipe"], "--output", out]
    k = run_killed(args, fault)
    assert k.code == -9, k.err
    raw = out.read_bytes()
    assert raw.count(b"\n") == lines_before
    if fault.startswith("kill_mid"):
        assert not raw.endswith(b"\n")  # torn

    r = run_cli(args)
    assert r.code == 0, r.err
    assert f"{lines_before:,} already in" in r.err
    want = setup["straight"] / "gen.jsonl"
    assert out.read_bytes() == want.read_bytes()  # same rows, same order, each once
    assert (tmp_path / "gen.settings.json").read_bytes() == (setup["straight"] / "gen.settings.json").read_bytes()
    assert stray_temps(tmp_path) == []


# --------------------------------------------------------------------------- judge
IDS = [f"p{i}" for i in range(8)]


def _gen_file(path: Path, model: str) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Q {i}?", "completion": answer(model, i)}) + "\n" for i in IDS))
    return path


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    a, b = _gen_file(root / "a.jsonl", "A"), _gen_file(root / "b.jsonl", "B")
    with JudgeServer(KEY) as srv:
        for n, i in enumerate(IDS):  # a fixed mix of wins, losses and ties
            srv.verdicts[("j", i, "AB")] = "ABC"[n % 3]
            srv.verdicts[("j", i, "BA")] = "BAC"[(n // 2) % 3]
        args = ["judge", a, b, "--judge", "j", "--base-url", srv.url, "--bootstrap", "200", "--concurrency", "2",
                "--timeout", "5", "--retry-delay", "0.01"]
        r = run_cli(args + ["-o", root / "straight"], env={"OPENAI_API_KEY": KEY})
        assert r.code == 0, r.err
        yield {"root": root, "args": args, "server": srv, "straight": root / "straight", "table": r.out}


@pytest.mark.parametrize("fault, cached_before", [
    ("kill_after_records:3", 3),
    ("kill_mid_record:6", 5),      # judgement 6 torn in the cache file
    ("kill_after_records:16", 16), # all 8 x 2 judgements cached, no results yet
])
def test_judge(judged, tmp_path, fault, cached_before):
    out = tmp_path / "out"
    srv = judged["server"]
    env = {"OPENAI_API_KEY": KEY}
    k = run_killed(judged["args"] + ["-o", out], fault, env=env)
    assert k.code == -9, k.err
    cache = out / "cache.jsonl"
    assert cache.read_bytes().count(b"\n") == cached_before
    assert not (out / "results.json").exists()
    finished = {json.loads(x)["key"] for x in cache.read_bytes().split(b"\n")[:cached_before]}

    before = len(srv.log)
    r = run_cli(judged["args"] + ["-o", out], env=env)
    assert r.code == 0, r.err
    asked = srv.log[before:]
    assert len(asked) == 16 - cached_before  # no finished judgement is requested again
    rows = [json.loads(x) for x in cache.read_text().splitlines()]
    assert len(rows) == 16 and len({x["key"] for x in rows}) == 16 and finished <= {x["key"] for x in rows}
    assert r.out == judged["table"]
    for name in ("results.json", "outcomes.jsonl", "results.md"):
        want = (judged["straight"] / name).read_text().replace(str(judged["straight"]), str(out))
        assert (out / name).read_text() == want, name
    assert stray_temps(out) == []
