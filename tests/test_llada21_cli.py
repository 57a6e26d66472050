"""LLaDA2.1 through the commands: a folder as the hub ships it (LLaDA2.0's config.json fields, the published weight
names, the remote code beside it; a stand-in modeling file that, like the published one, defines the editing
threshold) precomputes, trains (ELBO-KTO with the step-0 invariant, SFT, VRPO, LoRA), exports in the published layout
and decodes with its own rule; the settings LLaDA2.1 cannot go with are refused by name, one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.models.families import family_for_config, with_folder_evidence
from dllm_align.models.load import build_tiny_tokenizer
from fixtures.family_checkpoints import llada2_config, llada2_state, write_checkpoint
from fixtures.runs import read_metrics, reset_accelerate
from fixtures.sort_toy import write_pairs

runner = CliRunner()
FIXTURE = Path(__file__).parent / "fixtures" / "llada21_mini_config.json"
# Stand-ins for the hub's remote code: what tells LLaDA2.1's apart is read as text, never run.
MODELING = "class LLaDA2MoeModelLM:\n    def generate(self, inputs, threshold=0.95, editing_threshold=0.9):\n        ...\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("l21")
    tok = build_tiny_tokenizer("llada2")
    cfg = llada2_config(tok)
    cfg.update({k: v for k, v in json.loads(FIXTURE.read_text()).items()
                if k in ("model_type", "architectures", "auto_map", "sliding_window", "transformers_version")})
    hub = write_checkpoint(root / "hub", cfg, llada2_state(cfg), tok)
    (hub / "modeling_llada2_moe.py").write_text(MODELING)
    (hub / "configuration_llada2_moe.py").write_text("class LLaDA2MoeConfig:\n    pass\n")
    two = write_checkpoint(root / "two", cfg, llada2_state(cfg), tok)  # the same fields, no LLaDA2.1 code: LLaDA2.0
    return {"root": root, "hub": hub, "two": two}


def _recipe(root: Path, model: str, name: str, **train) -> Path:
    data = write_pairs(root / f"{name}.pairs.jsonl", n=8)
    rec = {"name": name, "model": {"name_or_path": model},
           "data": {"train": str(data), "test": str(data), "format": "paired", "max_length": 96},
           "reference": {"n_mc": 2, "batch_size": 8, "shard_size": 8},
           "train": {"lr": 1e-3, "batch_size": 4, "global_batch_size": 4, "max_steps": 1, **train},
           "generate": {"gen_length": 32, "block_length": 32, "batch_size": 4, "limit": 3}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


def test_elbo_kto_step_zero_margins_export_and_generate_with_editing(folders, fresh_accelerate):
    root = folders["root"]
    rec = _recipe(root, str(folders["hub"]), "kto")
    run = root / "run-kto"
    res = runner.invoke(app, ["precompute-ref", str(rec), "-o", str(run)])
    assert res.exit_code == 0, res.output
    reset_accelerate()
    res = runner.invoke(app, ["train", str(rec), "-o", str(run)])
    assert res.exit_code == 0, res.output
    (row,) = read_metrics(run)
    assert row["reward_desirable"] == 0.0 and row["reward_undesirable"] == 0.0 and row["baseline"] == 0.0
    final = run / "final"
    saved = json.loads((final / "config.json").read_text())
    # the hub's layout: LLaDA2.0's identity and the source's remote code, which says LLaDA2.1 again
    assert (saved["model_type"], saved["architectures"]) == ("llada2_moe", ["LLaDA2MoeModelLM"])
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_llada2_moe.LLaDA2MoeModelLM"
    assert (final / "modeling_llada2_moe.py").read_text() == MODELING and "dllm_align_family" not in saved
    assert family_for_config(with_folder_evidence(saved, final)).name == "llada21"
    out = root / "gen.jsonl"
    res = runner.invoke(app, ["generate", str(rec), "-m", str(final), "--output", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    auto = [json.loads(x)["completion"] for x in out.read_text().splitlines()]
    res = runner.invoke(app, ["generate", str(rec), "-m", str(final), "--output", str(root / "named.jsonl"),
                              "--device", "cpu", "--set", "generate.sampler=llada21", "--set", "generate.llada21.mode=quality"])
    assert res.exit_code == 0, res.output
    side = json.loads((root / "named.settings.json").read_text())
    assert side["sampler"]["sampler"] == "llada21" and side["sampler"]["llada21"]["mode"] == "quality"
    assert [json.loads(x)["completion"] for x in (root / "named.jsonl").read_text().splitlines()] == auto and len(auto) == 3
    # fast: the cache of finished blocks, and no shared threshold filled in (the rule has its own)
    res = runner.invoke(app, ["generate", str(rec), "-m", str(final), "--output", str(root / "fast.jsonl"),
                              "--device", "cpu", "--fast", "--set", "generate.llada21.mode=speed"])
    assert res.exit_code == 0, res.output
    side = json.loads((root / "fast.settings.json").read_text())
    assert side["sampler"]["cache"] == "prefix" and side["sampler"]["threshold"] is None


@pytest.mark.parametrize("objective,extra", [("sft", {}), ("vrpo", {}),
                                             ("elbo_kto", {"lora": {"enabled": True, "r": 4,
                                                                    "target_modules": ["query_key_value", "dense"]}})])
def test_other_objectives_and_lora(folders, objective, extra, fresh_accelerate):
    if extra:
        pytest.importorskip("peft")
    root = folders["root"]
    rec = _recipe(root, str(folders["hub"]), f"{objective}-{bool(extra)}", objective=objective, **extra)
    run = root / f"run-{objective}-{bool(extra)}"
    if objective != "sft":
        res = runner.invoke(app, ["precompute-ref", str(rec), "-o", str(run)])
        assert res.exit_code == 0, res.output
        reset_accelerate()
    res = runner.invoke(app, ["train", str(rec), "-o", str(run)])
    assert res.exit_code == 0, res.output
    (row,) = read_metrics(run)
    assert row["loss"] == row["loss"]


@pytest.mark.parametrize("model,setting,words", [
    ("hub", "generate.sampler=block", "generate.sampler: block: llada21 models decode with their own rule, llada21"),
    ("hub", "generate.sampler=llada", "generate.sampler: llada: llada21 is a block-diffusion model"),
    ("hub", "generate.cache=dual", "generate.cache: dual: the llada21 rule"),
    ("hub", "generate.steps=64", "generate.steps: not a setting of the rule 'llada21'"),
    ("two", "generate.sampler=llada21", "generate.sampler: llada21: the token-editing rule is LLaDA2.1's; llada2 models"),
])
def test_settings_llada21_cannot_go_with_are_refused_in_one_line(folders, model, setting, words):
    root = folders["root"]
    rec = _recipe(root, str(folders[model]), "refuse")
    out = root / f"refused-{model}-{setting.replace('=', '-')}" / "g.jsonl"
    out.parent.mkdir()
    res = runner.invoke(app, ["generate", str(rec), "--output", str(out), "--device", "cpu", "--set", setting])
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("Error")]
    assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output
    hint = [x for x in res.stderr.strip().splitlines() if x.startswith("Hint")]
    # a hint that names a rule names the one that decodes this model, never the block rule LLaDA2.1 refuses
    assert not any("generate.sampler: block" in x for x in hint), res.output
    assert list(out.parent.iterdir()) == []


def test_label_samples_with_the_editing_rule(folders, tmp_path):
    """`label` fills in its fast defaults for the model's rule: the cache of finished blocks, no shared threshold
    (the demo recipe's steps is put back to its default: the rule has no use for it and refuses it set)."""
    res = runner.invoke(app, ["label", "demo", "-o", str(tmp_path / "lab"), "--n", "2", "--limit", "2",
                              "--set", f"model.name_or_path={folders['hub']}", "--set", "generate.gen_length=32",
                              "--set", "generate.block_length=32", "--set", "generate.steps=512"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in next((tmp_path / "lab").glob("*.jsonl")).read_text().splitlines()]
    assert len(rows) == 4 and all(isinstance(r["label"], bool) for r in rows)


def test_the_masked_plus_replaced_bound_is_a_recorded_choice(folders, fresh_accelerate):
    """``reference.likelihood: hybrid`` on LLaDA2.1: precompute-ref and ELBO-KTO through it (step-0 rewards exactly
    0), the choice and its mask share recorded in the recipe and the cache's fingerprint."""
    root = folders["root"]
    rec = _recipe(root, str(folders["hub"]), "hybrid")
    run = root / "run-hybrid"
    sets = ["--set", "reference.likelihood=hybrid", "--set", "reference.hybrid.mask_share=0.25"]
    res = runner.invoke(app, ["precompute-ref", str(rec), "-o", str(run), *sets])
    assert res.exit_code == 0, res.output
    reset_accelerate()
    res = runner.invoke(app, ["train", str(rec), "-o", str(run), *sets])
    assert res.exit_code == 0, res.output
    (row,) = read_metrics(run)
    assert row["reward_desirable"] == 0.0 and row["reward_undesirable"] == 0.0 and row["baseline"] == 0.0
    saved = yaml.safe_load((run / "recipe.train.yaml").read_text())["reference"]
    assert saved["likelihood"] == "hybrid" and saved["hybrid"] == {"mask_share": 0.25}
    fp = json.loads((run / "ref_cache" / "manifest.json").read_text())["fingerprint"]
    assert fp["likelihood"] == "hybrid" and fp["likelihood_settings"] == {"mask_share": 0.25}


@pytest.mark.parametrize("model,sets,words", [
    ("two", ["reference.likelihood=hybrid"], "reference.likelihood: 'hybrid' does not fit llada2 models"),
    ("hub", ["reference.likelihood=uniform"], "reference.likelihood: 'uniform' does not fit llada21 models"),
    ("hub", ["reference.hybrid.mask_share=0.3"], "reference.hybrid: the settings of the likelihood 'hybrid'"),
    ("hub", ["reference.likelihood=hybrid", "reference.estimator=t"],
     "reference.estimator: not a setting of the likelihood 'hybrid'"),
    ("hub", ["reference.likelihood=hybrid", "data.padding=packed"], "data.padding: packed is not available"),
])
def test_the_bound_is_refused_where_it_does_not_fit_in_one_line(folders, model, sets, words):
    root = folders["root"]
    rec = _recipe(root, str(folders[model]), "refuse-lik")
    args = [x for s in sets for x in ("--set", s)]
    res = runner.invoke(app, ["recipes", "check", str(rec), *args])
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("Error")]
    assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output
    out = root / f"refused-lik-{model}-{len(sets)}-{sets[-1].replace('=', '-')}"
    res = runner.invoke(app, ["train", str(rec), "-o", str(out), *args])
    assert res.exit_code == 2 and words in res.stderr and not out.exists(), res.output
