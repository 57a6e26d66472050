"""Integrity (checksums, fingerprints) and numerical faults (README "Reliability").

The bad-input corpus (test_reliability_inputs.py) shows each damaged or
mismatched cache / checkpoint refused with one line; here: what is recorded,
that the refusal's advice works, and what happens when the numbers go bad
(NaN / inf losses, out-of-range reference ELBOs).
"""

from __future__ import annotations

import re

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dllm_align.core.errors import UserError
from dllm_align.core.io import CHECKSUMS, verify_checksums, write_checksums
from fixtures.sort_toy import write_pairs
from reliability import run_cli, run_killed, stray_temps




@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    data = write_pairs(root / "pairs.jsonl", n=16)
    recipe = {
        "name": "integrity",
        "model": {"name_or_path": "builtin:tiny"},
        "data": {"train": str(data), "test": str(data), "format": "paired", "max_length": 64},
        "reference": {"n_mc": 4, "batch_size": 8, "shard_size": 8, "cache": str(root / "ref_cache")},
        "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 5, "save_every": 2},
        "generate": {"gen_length": 8, "block_length": 8, "steps": 8, "batch_size": 4, "limit": 4},
    }
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert run_cli(["precompute-ref", path, "-o", root / "straight"]).code == 0
    r = run_cli(["train", path, "-o", root / "straight"])
    assert r.code == 0, r.err
    return {"root": root, "recipe": path, "data": data, "straight": root / "straight"}


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# --------------------------------------------------------------------------- checksums
def test_every_checkpoint_and_the_final_model_carry_checksums_of_every_file(toy):
    run = toy["straight"]
    folders = sorted((run / "checkpoints").glob("step-*")) + [run / "final"]
    assert [f.name for f in folders] == ["step-2", "step-4", "final"]
    for f in folders:
        listed = set(json.loads((f / CHECKSUMS).read_text())["files"])
        on_disk = {p.relative_to(f).as_posix() for p in f.rglob("*") if p.is_file() and p.name != CHECKSUMS}
        assert listed == on_disk, f
        assert verify_checksums(f)
    state = json.loads((run / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["model"] == "builtin:tiny" and state["step"] == 4 and state["version"] == 2


def test_checksums_catch_a_flipped_bit_of_the_same_size(tmp_path):
    (tmp_path / "w.bin").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.json").write_text("{}")
    write_checksums(tmp_path)
    assert verify_checksums(tmp_path)
    data = bytearray((tmp_path / "w.bin").read_bytes())
    data[1000] ^= 0x80
    (tmp_path / "w.bin").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"w\.bin does not match its sha256"):
        verify_checksums(tmp_path)
    (tmp_path / "sub" / "x.json").unlink()
    (tmp_path / "w.bin").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(UserError, match=r"sub/x\.json is missing"):
        verify_checksums(tmp_path)
    assert verify_checksums(tmp_path / "sub", required=False) is False  # a folder from another tool: nothing to check


def test_a_damaged_checkpoint_is_refused_and_the_hint_recovers_the_run(toy, tmp_path):
    """Killed after step 5 (checkpoints 2 and 4); step-4's weights get damaged on disk. --resume refuses it,
    naming the file and the checkpoint to fall back to; after deleting step-4 as the hint says, the resumed
    run ends bitwise equal to the uninterrupted one."""
    run = tmp_path / "run"
    args = ["train", toy["recipe"], "-o", run]
    assert run_killed(args, "kill_after_step:5").code == -9
    ck = run / "checkpoints" / "step-4"
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ck / "model.safetensors").write_bytes(bytes(data))

    r = run_cli(args + ["--resume"])
    assert r.code == 2
    assert "step-4: model.safetensors does not match its sha256 checksum" in r.err
    hint = next(line for line in r.err.splitlines() if line.startswith("Hint:"))
    assert f"delete {ck} to resume from step-2" in hint
    shutil.rmtree(ck)
    r = run_cli(args + ["--resume"])
    assert r.code == 0, r.err
    assert "(step 2 of 5)" in r.err
    a, b = _weights(toy["straight"] / "final"), _weights(run / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_generate_refuses_a_damaged_final_model(toy, tmp_path):
    model = tmp_path / "final"
    shutil.copytree(toy["straight"] / "final", model)
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (model / "model.safetensors").write_bytes(bytes(data))
    r = run_cli(["generate", toy["recipe"], "--model", model, "--output", tmp_path / "g.jsonl"])
    assert r.code == 2 and "final: model.safetensors does not match its sha256 checksum" in r.err
    assert not (tmp_path / "g.jsonl").exists() and not (tmp_path / "g.settings.json").exists()


# --------------------------------------------------------------------------- numerical faults
def test_nan_loss_stops_naming_the_step_and_keeps_a_usable_checkpoint(toy, tmp_path):
    run = tmp_path / "run"
    args = ["train", toy["recipe"], "-o", run, "--set", "train.save_every=1", "--set", "train.max_grad_norm=null",
            "--set", "train.warmup_ratio=0"]
    r = run_cli(args + ["--set", "train.lr=1e30"])
    assert r.code == 1, r.err
    err = next(line for line in r.err.splitlines() if line.startswith("Error:"))
    step = int(err.split(" at step ")[1].split(";")[0])
    assert "non-finite loss nan" in err or "non-finite gradient norm" in err
    good = run / "checkpoints" / f"step-{step - 1}"
    assert step >= 2 and f"the last good checkpoint is {good}" in err
    assert not (run / "final").exists() and stray_temps(run) == []
    assert verify_checksums(good)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, step)) and all(np.isfinite(x["loss"]) for x in rows)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(good))  # a complete model folder
    # (lr 1e30 already blew the weights up at step 1, so resuming would fail again at the same step:
    # a finite loss does not make a checkpoint healthy, and the message says only that it was the last written)


def _overflowing_model(folder: Path) -> Path:
    """The tiny model with an output head whose mask-token logit is +inf at every position
    (a constant offset in hidden dimension 0, and a 3e38 head weight there)."""
    from safetensors.torch import load_file, save_file

    from dllm_align.models.load import build_tiny_tokenizer, save_tiny

    save_tiny(folder)
    sd = load_file(str(folder / "model.safetensors"))
    mask = build_tiny_tokenizer().mask_token_id
    sd["model.embed_tokens.weight"][:, 0] += 1000.0
    sd["lm_head.weight"][mask] = 0.0
    sd["lm_head.weight"][mask, 0] = 3e38
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_inf_loss_stops_at_the_step(toy, tmp_path):
    model = _overflowing_model(tmp_path / "model")
    run = tmp_path / "run"
    r = run_cli(["train", toy["recipe"], "-o", run, "--set", f"model.name_or_path={model}", "--set", "train.objective=sft"])
    assert r.code == 1, r.err
    # an overflowing head gives inf or nan log-probabilities (inf - inf); either is stopped, named and not applied
    assert re.search(r"Error: non-finite loss (inf|nan) at step 1; stopped before applying it \(no checkpoint was written yet\)", r.err)
    assert "Traceback" not in r.err
    assert not (run / "final").exists() and not (run / "checkpoints").exists()


def test_precompute_reports_an_out_of_range_reference_and_writes_nothing(toy, tmp_path):
    model = _overflowing_model(tmp_path / "model")
    cache = tmp_path / "cache"
    r = run_cli(["precompute-ref", toy["recipe"], "-o", tmp_path / "run", "--set", f"model.name_or_path={model}",
                 "--set", f"reference.cache={cache}"])
    assert r.code == 1, r.err
    err = next(line for line in r.err.splitlines() if line.startswith("Error:"))
    assert "reference ELBO out of range in shard 0: example 'sort-" in err and re.search(r"is (-inf|nan) \(not finite", err)
    assert "the shard was not written" in err
    assert not list(cache.glob("*.safetensors")) and not (cache / "manifest.json").exists() and stray_temps(cache) == []


def test_elbo_range_check_by_hand():
    from dllm_align.training.cache import elbo_range_problem

    ids = ["a", "b", "c"]
    assert elbo_range_problem(np.array([[-1.0, -0.0], [-3.5, -2.0], [0.0, -1e30]]), ids) is None  # 0 is allowed: log 1
    msg = elbo_range_problem(np.array([[-1.0, -2.0], [-3.0, 0.25], [np.inf, -1.0]]), ids)
    assert msg.startswith("example 'b' draw 1 is 0.25 (a positive log-likelihood sum") and msg.endswith("2 value(s) out of range")
    msg = elbo_range_problem(np.array([[np.nan, -1.0]], dtype=np.float32), ["z"])
    assert msg.startswith("example 'z' draw 0 is nan (not finite")
