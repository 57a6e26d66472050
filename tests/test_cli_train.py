"""`dllm-align precompute-ref` and `dllm-align train` end to end: CLI manners, two processes.

Kill and resume: tests/test_reliability_kill.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from dllm_align.cli.app import app

from fixtures.sort_toy import write_pairs
from fixtures.runs import read_metrics

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()




def _env() -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        DLLM_ALIGN_NO_PROGRESS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("DLLM_ALIGN_FAULT", None)
    return env


@pytest.fixture(autouse=True)
def _fresh_accelerate_per_test(fresh_accelerate):
    """Every test's runs start from a clean accelerate state: a state an earlier run left (another mixed
    precision) makes the next Accelerator refuse to start."""
    yield


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A recipe file on the toy pairs, and a run folder whose reference cache is already computed."""
    root = tmp_path_factory.mktemp("cli")
    data = write_pairs(root / "pairs.jsonl", n=16)
    recipe = {
        "name": "cli-toy",
        "model": {"name_or_path": "builtin:tiny"},
        "data": {"train": str(data), "format": "paired", "max_length": 64},
        "reference": {"n_mc": 4, "batch_size": 16, "shard_size": 8, "cache": str(root / "ref_cache")},
        "train": {"lr": 1e-3, "warmup_ratio": 0.25, "batch_size": 2, "max_steps": 5},
    }
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = runner.invoke(app, ["precompute-ref", str(path), "-o", str(root / "first")])
    assert res.exit_code == 0, res.output
    return {"root": root, "recipe": path}


def _params(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _final_params(folder: Path) -> dict:
    """A final/ model's weights under the names dllm-align trains with (final/ is written in the published layout)."""
    from dllm_align.models.load import load_model

    return {k: v.detach() for k, v in load_model(str(folder)).model.state_dict().items()}


def test_precompute_then_train_writes_a_loadable_model(toy):
    from transformers import AutoModelForCausalLM

    out = toy["root"] / "first"
    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(out), "--set", "train.save_every=2"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith(str(out / "final"))  # stdout: the result only
    assert "steps/s" in res.stderr and "examples/s" in res.stderr
    ckpt = out / "checkpoints" / "step-4"  # checkpoints keep the native layout: plain transformers reads them
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    torch.testing.assert_close(dict(model.state_dict())["lm_head.weight"], _params(ckpt)["lm_head.weight"])
    # final/ is in LLaDA's published layout (tests/test_export_roundtrip.py): dllm-align reads it back, and its
    # weights are the run's last step (not the checkpoint's)
    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == ["LLaDAModelLM"]
    final = _final_params(out / "final")
    assert final["lm_head.weight"].shape == model.state_dict()["lm_head.weight"].shape
    assert not torch.equal(final["lm_head.weight"], model.state_dict()["lm_head.weight"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for key in ("loss", "baseline", "saturation", "lr", "grad_norm", "tokens_per_s", "examples_per_s"):
        assert all(r[key] is not None for r in rows), key
    # a uniform batch of 2 may hold one class only: that class's mean margin is then undefined (null)
    for key in ("reward_desirable", "reward_undesirable"):
        assert any(r[key] is not None for r in rows), key
    assert (out / "run_info.precompute-ref.json").exists() and (out / "run_info.train.json").exists()


def test_mismatched_cache_exits_2_naming_the_field(toy):
    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(toy["root"] / "bad"), "--set", "reference.seed=7"])
    assert res.exit_code == 2
    assert "Error: reference cache" in res.stderr and "field 'seed'" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (toy["root"] / "bad" / "final").exists()


def test_missing_cache_and_contradictory_flags(toy, tmp_path):
    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(tmp_path), "--set", f"reference.cache={tmp_path / 'none'}"])
    assert res.exit_code == 2 and "no reference cache" in res.stderr and "precompute-ref" in res.stderr
    res = runner.invoke(app, ["train", str(toy["recipe"]), "--resume", "--overwrite"])
    assert res.exit_code == 2 and "contradict" in res.stderr


def test_nan_exits_1_naming_the_step(toy, tmp_path):
    res = runner.invoke(
        app,
        ["train", str(toy["recipe"]), "-o", str(tmp_path), "--set", "train.lr=1e30", "--set", "train.max_grad_norm=null",
         "--set", "train.save_every=1", "--set", "train.warmup_ratio=0"],
    )
    assert res.exit_code == 1
    assert "Error: non-finite" in res.stderr and "at step" in res.stderr and "last good checkpoint" in res.stderr


def test_help_has_examples():
    for cmd in ("train", "precompute-ref"):
        res = runner.invoke(app, [cmd, "--help"])
        assert res.exit_code == 0 and "Example:" in res.output


@pytest.mark.multiproc
def test_two_processes_equal_one_process_with_batch_two(toy, tmp_path):
    """torchrun, 2 CPU processes (gloo) x 1 row each == 1 process x batch 2: loss, baseline, gradient norm, parameters."""
    one = tmp_path / "one"
    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(one), "--set", "train.max_steps=3"])
    assert res.exit_code == 0, res.output
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dllm_align",
           "train", str(toy["recipe"]), "-o", str(two), "--set", "train.batch_size=1", "--set", "train.max_steps=3"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 process(es) x 1 micro-batch(es) x 1" in p.stderr
    assert p.stdout.strip() == str(two / "final")  # printed once, by the main process
    m1, m2 = read_metrics(one), read_metrics(two)
    assert len(m1) == len(m2) == 3
    for x, y in zip(m1, m2):
        # ELBO sums are O(100) in fp32: rows padded in a batch vs alone differ by ~1e-5
        for key in ("baseline", "reward_desirable", "reward_undesirable"):
            assert y[key] == pytest.approx(x[key], abs=1e-4), (x["step"], key)
        for key in ("loss", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4), (x["step"], key)
    a, b = _final_params(one / "final"), _final_params(two / "final")
    from dllm_align.models.load import build_tiny_model

    init = build_tiny_model().state_dict()
    assert max(float((a[k] - init[k]).abs().max()) for k in a) > 1e-3  # the runs moved the weights
    for k in a:
        # Adam divides by sqrt(v): a near-zero gradient component can turn fp32 noise into ~1e-6 here
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)


@pytest.mark.multiproc
def test_kl_baseline_two_processes_of_one_row_equal_one_process_of_two(toy, tmp_path):
    """train.baseline kl with 1 row per process (where TRL's per-device pairs cannot exist): z0 comes from the
    global batch, so 2 gloo processes x 1 row == 1 process x 2 rows (online reference)."""
    sets = ["--set", "train.baseline=kl", "--set", "reference.mode=online", "--set", "train.global_batch_size=2",
            "--set", "train.max_steps=3", "--set", "train.lr=1e-2"]
    one = tmp_path / "one"
    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(one), *sets, "--set", "train.batch_size=2"])
    assert res.exit_code == 0, res.output
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dllm_align",
           "train", str(toy["recipe"]), "-o", str(two), *sets, "--set", "train.batch_size=1"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 process(es) x 1 micro-batch(es) x 1" in p.stderr
    m1, m2 = read_metrics(one), read_metrics(two)
    assert len(m1) == len(m2) == 3 and m1[0]["baseline"] == 0.0
    assert any(x["baseline"] > 0 for x in m1[1:]), "z0 never left its clamp: the comparison would be vacuous"
    for x, y in zip(m1, m2):
        assert y["baseline"] == pytest.approx(x["baseline"], abs=1e-4), x["step"]
        for key in ("loss", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4), (x["step"], key)
    a, b = _final_params(one / "final"), _final_params(two / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)


@pytest.mark.multiproc
def test_precompute_on_two_processes_matches_one(toy, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dllm_align",
           "precompute-ref", str(toy["recipe"]), "-o", str(tmp_path), "--set", f"reference.cache={tmp_path / 'c2'}"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    from dllm_align.training.cache import ReferenceCache

    one, two = ReferenceCache.open(toy["root"] / "ref_cache"), ReferenceCache.open(tmp_path / "c2")
    assert one.manifest["fingerprint"] == two.manifest["fingerprint"]
    assert len(two.manifest["shards"]) == 4  # 32 rows in shards of 8
    # rows are dealt out interleaved within each shard (no process idles for a whole shard)
    assert "the rows of each shard dealt out over 2 processes" in p.stderr
    ids = sorted(one._values)
    torch.testing.assert_close(two.lookup(ids, 4), one.lookup(ids, 4), atol=1e-4, rtol=1e-5)


def test_shipped_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    folder = REPO / "recipes" / "accelerate"
    names = sorted(p.name for p in folder.glob("*.yaml"))
    assert names == ["ddp_2x8gpu.yaml", "ddp_8gpu.yaml", "fsdp1_8gpu.yaml", "fsdp2_2x8gpu.yaml", "fsdp_8gpu.yaml",
                     "single_gpu.yaml"]  # the 2x8 (two-node) ones: tests/test_launch_scripts.py
    # the shipped FSDP setup is FSDP2; FSDP1 stays as a fallback (both run by test_invariants_distributed)
    fsdp = load_config_from_file(str(folder / "fsdp_8gpu.yaml"))
    assert fsdp.distributed_type == "FSDP" and fsdp.num_processes == 8 and fsdp.mixed_precision == "bf16"
    assert fsdp.fsdp_config["fsdp_version"] == 2
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert fsdp.fsdp_config["fsdp_activation_checkpointing"] is True
    assert fsdp.fsdp_config["fsdp_reshard_after_forward"] is True
    fsdp1 = load_config_from_file(str(folder / "fsdp1_8gpu.yaml"))
    assert fsdp1.fsdp_config["fsdp_version"] == 1 and fsdp1.fsdp_config["fsdp_reshard_after_forward"] == "FULL_SHARD"
    ddp = load_config_from_file(str(folder / "ddp_8gpu.yaml"))
    assert ddp.distributed_type == "MULTI_GPU" and ddp.num_processes == 8
    single = load_config_from_file(str(folder / "single_gpu.yaml"))
    assert single.num_processes == 1


@pytest.mark.parametrize("precision", ["bf16-set", pytest.param("auto-on-gpu", marks=pytest.mark.gpu)])
def test_bf16_autocast_step(toy, tmp_path, precision):
    """A bf16 run after fp32 ones in the same process (the module's fixture and earlier tests): accelerate's
    process-wide state, made by the first run, refuses another mixed precision unless reset between tests
    (the autouse fixture below). On the GPU ``auto`` picks bf16; on the CPU the recipe asks for it."""
    if precision == "auto-on-gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: train.mixed_precision auto picks bf16 only on GPU")
    # (the module's cache is fp32 on the CPU: the bf16 run computes its reference online)
    sets = ["--set", "train.mixed_precision=bf16", "--set", "reference.mode=online"] if precision == "bf16-set" else []
    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(tmp_path), "--set", "train.max_steps=2", *sets])
    assert res.exit_code == 0, res.output
    assert "mixed precision bf16" in res.stderr
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(tmp_path))


def test_trackers_are_used_when_installed_else_named(toy, tmp_path):
    from accelerate.utils import is_tensorboard_available

    res = runner.invoke(app, ["train", str(toy["recipe"]), "-o", str(tmp_path), "--set", "train.max_steps=1",
                              "--set", "train.trackers=[tensorboard]"])
    assert res.exit_code == 0, res.output
    if is_tensorboard_available():
        assert any(tmp_path.rglob("events.out.tfevents.*"))
    else:
        assert "tensorboard is not installed" in res.stderr
