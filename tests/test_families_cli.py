"""Every command per family through the CLI: precompute-ref, one ELBO-KTO step with the
step-0 invariant (policy = reference, so every margin is exactly zero before the update),
SFT / VRPO / LoRA steps, generate (each family's rule, and LLaDA's sampler with its cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.models.load import build_tiny_tokenizer

from fixtures.family_checkpoints import (dream_config, dream_state, llada2_config, llada2_state, lladamoe_config,
                                        lladamoe_state, sdar_config, sdar_state, write_checkpoint)
from fixtures.sort_toy import write_pairs
from fixtures.runs import read_metrics, reset_accelerate

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fam")
    tok = build_tiny_tokenizer()
    moe = write_checkpoint(root / "moe", lladamoe_config(tok), lladamoe_state(lladamoe_config(tok)), tok)
    dtok = build_tiny_tokenizer("dream")
    dream = write_checkpoint(root / "dream", dream_config(dtok), dream_state(dream_config(dtok)), dtok)
    sdar = write_checkpoint(root / "sdar", sdar_config(dtok), sdar_state(sdar_config(dtok)), dtok)
    llada2 = write_checkpoint(root / "llada2", llada2_config(tok), llada2_state(llada2_config(tok)), tok)
    return {"llada": "builtin:tiny", "dream": str(dream), "llada_moe": str(moe), "sdar": str(sdar), "llada2": str(llada2),
            "root": root}


def _recipe(root: Path, model: str, name: str, block: int = 6, **train) -> Path:
    data = write_pairs(root / f"{name}.pairs.jsonl", n=8)
    rec = {
        "name": name,
        "model": {"name_or_path": model},
        "data": {"train": str(data), "test": str(data), "format": "paired", "max_length": 96},
        "reference": {"n_mc": 2, "batch_size": 8, "shard_size": 8},
        "train": {"lr": 1e-3, "batch_size": 4, "global_batch_size": 4, "max_steps": 1, **train},
        "generate": {"gen_length": {6: 6, 4: 8}.get(block, block), "block_length": block,
                     "steps": {6: 6, 4: 8}.get(block, block), "batch_size": 4, "limit": 3},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("family", ["llada", "dream", "llada_moe", "sdar", "llada2"])
def test_elbo_kto_step_zero_margins_then_generate(models, family, precision, fresh_accelerate):
    root = models["root"]
    rec = _recipe(root, models[family], f"kto-{family}-{precision}", block={"sdar": 4, "llada2": 32}.get(family, 6))
    run = root / f"run-{family}-{precision}"
    mp = ["--set", f"train.mixed_precision={precision}"]
    res = runner.invoke(app, ["precompute-ref", str(rec), "-o", str(run), *mp])
    assert res.exit_code == 0, res.output
    reset_accelerate()  # a new process in real use
    res = runner.invoke(app, ["train", str(rec), "-o", str(run), *mp])
    assert res.exit_code == 0, res.output
    (row,) = read_metrics(run)
    # before the first update the policy is the reference: every margin is exactly zero
    assert row["reward_desirable"] == 0.0 and row["reward_undesirable"] == 0.0 and row["baseline"] == 0.0
    assert row["loss"] == pytest.approx(0.5 * (1.0 + 1.0) / 2)  # lambda (1 - sigmoid(0)) averaged
    saved = json.loads((run / "final" / "config.json").read_text())
    # final/ is in the family's published layout (docs/serving.md), recognised from the published fields alone
    from dllm_align.models.families import get_family
    from dllm_align.models.families import family_for_config

    assert "dllm_align_family" not in saved and family_for_config(saved).name == family
    assert saved["architectures"] == list(get_family(family).published.architectures)
    # generate from the trained folder: the family's own rule by default
    out = root / f"gen-{family}-{precision}.jsonl"
    res = runner.invoke(app, ["generate", str(rec), "-m", str(run / "final"), "--output", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3 and all("completion" in r for r in rows)


@pytest.mark.parametrize("family", ["dream", "llada_moe"])
def test_llada_sampler_fast_mode_runs_for_the_family(models, family):
    root = models["root"]
    rec = _recipe(root, models[family], f"fast-{family}")
    out = root / f"fast-{family}.jsonl"
    res = runner.invoke(app, ["generate", str(rec), "--output", str(out), "--device", "cpu", "--sampler", "llada",
                              "--block-length", "3", "--fast"])
    assert res.exit_code == 0, res.output
    assert "cache is not available" not in res.stderr  # the key/value cache applies to both bodies


@pytest.mark.parametrize("family", ["dream", "sdar", "llada2"])
@pytest.mark.parametrize("objective,extra", [("sft", {}), ("vrpo", {}), ("elbo_kto", {"lora": {"enabled": True, "r": 4}})])
def test_other_objectives_and_lora(models, family, objective, extra, fresh_accelerate):
    pytest.importorskip("peft") if extra else None
    if extra and family == "llada2":  # LLaDA2.0's attention projections: the fused query_key_value and dense
        extra = {"lora": {**extra["lora"], "target_modules": ["query_key_value", "dense"]}}
    root = models["root"]
    rec = _recipe(root, models[family], f"{objective}-{family}-{bool(extra)}", objective=objective, **extra)
    run = root / f"run-{objective}-{family}-{bool(extra)}"
    if objective != "sft":
        res = runner.invoke(app, ["precompute-ref", str(rec), "-o", str(run)])
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", str(rec), "-o", str(run)])
    assert res.exit_code == 0, res.output
    (row,) = read_metrics(run)
    assert row["loss"] == row["loss"]  # finite, not NaN


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_families_decode_exact_and_fast(models, family):
    """`generate` on a block family: exact (finished blocks recomputed at every step) and `--fast` (a KV cache
    over finished blocks and the 0.9 confidence threshold) both run the family's own block rule."""
    root = models["root"]
    block = {"sdar": 4, "llada2": 32}[family]
    rec = _recipe(root, models[family], f"blockgen-{family}", block=block)
    rows = {}
    for mode, extra in (("exact", ["--set", "generate.cache=none"]), ("fast", ["--fast"])):
        out = root / f"blockgen-{family}-{mode}.jsonl"
        res = runner.invoke(app, ["generate", str(rec), "--output", str(out), "--device", "cpu", *extra])
        assert res.exit_code == 0, res.output
        rows[mode] = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows[mode]) == 3 and all("completion" in r for r in rows[mode])
    from dllm_align.core.errors import UserError
    from dllm_align.generate.sampler import generate
    from dllm_align.generate.settings import SamplerSettings
    from dllm_align.models.load import load_model

    with pytest.raises(UserError, match="differs from the model's block size"):  # refused by name
        generate(load_model(models[family]), [[1, 2, 3]], SamplerSettings(gen_length=2 * block, block_length=2 * block,
                                                                          steps=2 * block))
    # through the command: one Error line, exit 2, and nothing left behind in the output folder
    out = root / f"foreign-{family}" / "gen.jsonl"
    out.parent.mkdir()
    res = runner.invoke(app, ["generate", str(rec), "--output", str(out), "--device", "cpu",
                              "--set", f"generate.block_length={2 * block}", "--set", f"generate.gen_length={2 * block}",
                              "--set", f"generate.steps={2 * block}"])
    assert res.exit_code == 2 and "differs from the model's block size" in res.stderr, res.output
    assert list(out.parent.iterdir()) == []
