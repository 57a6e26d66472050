"""Recipe loading: every problem at once, with dotted paths, did-you-mean and exit code 2."""

from __future__ import annotations

import json

import pytest
from pathlib import Path
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.core.errors import UserError
from dllm_align.config.recipe import bundled_names, load_recipe, write_run_info

runner = CliRunner()

BAD = """\
name: bad
model:
  name_or_pth: builtin:tiny
train:
  beta: "high"
  lr: -1
  n_mc: 16
reference:
  n_mc: 8
generate:
  sampler: llada
  gen_length: 100
  block_length: 32
bogus_section: {}
"""


def test_all_problems_reported_at_once(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(BAD)
    with pytest.raises(UserError) as ei:
        load_recipe(str(p))
    msg = ei.value.message
    assert "unknown key 'model.name_or_pth' (did you mean 'model.name_or_path'?)" in msg
    assert "train.beta: Input should be a valid number" in msg
    assert "train.lr: Input should be greater than 0" in msg
    assert "generate.gen_length: 100 is not a multiple of block_length (32)" in msg
    assert "unknown key 'bogus_section'" in msg
    assert msg.startswith("5 problems in recipe")


def test_contradiction_across_sections(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  n_mc: 16\nreference:\n  n_mc: 8\n")
    with pytest.raises(UserError, match=r"train.n_mc \(16\) exceeds reference.n_mc \(8\)"):
        load_recipe(str(p))


def test_overrides_are_validated_like_the_file(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("train:\n  beta: 0.1\n")
    r = load_recipe(str(p), ["train.beta=0.2", "generate.steps=64", "generate.gen_length=64", "generate.block_length=32"])
    assert r.train.beta == 0.2 and r.generate.steps == 64
    with pytest.raises(UserError, match=r"unknown key 'train.betta' \(did you mean 'train.beta'\?\)"):
        load_recipe(str(p), ["train.betta=0.2"])
    with pytest.raises(UserError, match="expected section.key=value"):
        load_recipe(str(p), ["train.beta"])


def test_cli_check_exit_2_one_block_no_traceback(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(BAD)
    r = runner.invoke(app, ["recipes", "check", str(p)])
    assert r.exit_code == 2
    assert r.stderr.startswith("Error: 5 problems in recipe")
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_invalid_yaml_names_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("train:\n  beta: [0.1\n  lr: 1\n")
    r = runner.invoke(app, ["recipes", "check", str(p)])
    assert r.exit_code == 2
    assert str(p) in r.stderr and "invalid YAML" in r.stderr


def test_missing_recipe_file(tmp_path):
    r = runner.invoke(app, ["recipes", "check", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2
    assert "recipe file not found" in r.stderr


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_recipe(str(p))


def test_run_info_written(tmp_path):
    r = load_recipe(None, ["train.beta=0.3"], output_dir=str(tmp_path / "run"))
    out = write_run_info(r, r.output_dir, "train")
    resolved = (out / "recipe.train.yaml").read_text()
    assert "beta: 0.3" in resolved
    info = json.loads((out / "run_info.train.json").read_text())
    assert "torch" in info["versions"] and "git_revision" in info


@pytest.mark.parametrize("name", bundled_names())
def test_every_bundled_recipe_loads(name):
    r = load_recipe(name)
    assert r.name == name


@pytest.mark.parametrize("name", bundled_names())
def test_every_bundled_recipe_dry_runs(name):
    """Each shipped recipe passes the checks its commands make before loading any model or data."""
    from dllm_align.workflows.ablate import baseline_settings
    from dllm_align.generate.settings import SamplerSettings

    r = load_recipe(name)
    SamplerSettings.from_section(r.generate)  # the samplers accept every bundled recipe's settings
    assert r.model.name_or_path
    assert r.data.train is not None or r.evaluate.tasks  # something to train on, or to evaluate
    assert baseline_settings(r)  # the sweep expands
    if r.evaluate.tasks:
        from dllm_align.evaluate.run import plan_tasks

        plans = plan_tasks(r)
        assert len(plans) == len(r.evaluate.tasks)
    if r.judge.judges and all(j.startswith("rule:") for j in r.judge.judges):
        from dllm_align.judge.run import get_rule

        for j in r.judge.judges:
            get_rule(j.removeprefix("rule:"))


def test_extends_merges_sections_and_detects_cycles(tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\ntrain:\n  beta: 0.3\n  lr: 2.0e-6\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nname: child\ntrain:\n  lr: 5.0e-6\n")
    r = load_recipe(str(tmp_path / "child.yaml"))
    assert (r.name, r.train.beta, r.train.lr) == ("child", 0.3, 5e-6)
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        load_recipe(str(tmp_path / "a.yaml"))
    # a bundled parent by name; an unknown key in the child is still caught
    (tmp_path / "c.yaml").write_text("extends: kto_mix_14k\ntrain:\n  betaa: 1\n")
    with pytest.raises(UserError, match="did you mean 'train.beta'"):
        load_recipe(str(tmp_path / "c.yaml"))


def test_accelerate_configs_ship_and_parse():
    import yaml

    from dllm_align.config.recipe import bundled_dir

    configs = sorted((bundled_dir() / "accelerate").glob("*.yaml"))
    assert {p.stem for p in configs} >= {"single_gpu", "ddp_8gpu", "fsdp_8gpu"}
    for p in configs:
        assert isinstance(yaml.safe_load(p.read_text()), dict)


# The recipes that reproduce the paper: its two training recipes and everything extending them.
PAPER_RECIPES = ["kto_mix_14k", "ultrafeedback_binary", "table1_kto_mix_14k", "table1_ultrafeedback",
                 "table2_two_judges", "table3_baseline", "figure1_imbalance"]  # table4_downstream only evaluates


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_paper_recipes_sample_uniformly_and_score_like_the_paper_code(name):
    """The paper samples S uniformly (section 3.2) and its code scores no end-of-turn token (docs/design.md#tokens-padding-and-packing)."""
    r = load_recipe(name)
    assert r.data.group_by_length is False
    assert r.data.end_of_turn == "none"
    assert r.data.padding == "paper"
    assert r.train.baseline == "global_mean"


@pytest.mark.parametrize("name", ["dream_kto_mix_14k", "llada_moe_kto_mix_14k", "sdar_kto_mix_14k", "llada2_mini_kto_mix_14k"])
def test_family_recipes_score_as_their_family_does(name):
    """The paper's EOS padding belongs to the LLaDA paper recipe: other families' recipes keep the paper's
    KTO settings but score without a visible end-of-text tail, and say why in the file."""
    r = load_recipe(name)
    assert r.data.padding in ("none", "packed")
    assert (r.train.beta, r.train.lr, r.reference.n_mc, r.data.end_of_turn) == (0.1, 1e-6, 8, "none")
    text = (Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml").read_text()
    assert "Recipe choice" in text and "padding: paper" in text


def test_defaults_are_uniform_batches():
    r = load_recipe(None)
    assert r.data.group_by_length is False
    for objective in ("elbo_kto", "vrpo"):
        assert load_recipe(None, [f"train.objective={objective}", "data.format=paired"]).data.group_by_length is False


def test_grouping_scoring_and_baseline_are_recorded(tmp_path):
    """The run's recipe record (recipe.<command>.yaml, formerly recipe.resolved.yaml) and the cache fingerprint
    both carry the three choices."""
    import yaml

    from dllm_align.training import cache as refcache
    from dllm_align.models.load import load_model
    from dllm_align.data.tokenize import Example

    rec = load_recipe(None, ["data.group_by_length=true", "data.end_of_turn=none", "train.baseline=none"],
                      output_dir=str(tmp_path / "run"))
    write_run_info(rec, tmp_path / "run", "train")
    from dllm_align.core.runfolder import recipe_record

    resolved = yaml.safe_load(recipe_record(tmp_path / "run", "train").read_text())
    assert resolved["data"]["group_by_length"] is True
    assert resolved["data"]["end_of_turn"] == "none"
    assert resolved["train"]["baseline"] == "none"
    mp = load_model("builtin:tiny")
    exs = [Example("a", [1, 2], [3, 4], True)]
    fp = refcache.fingerprint(rec, tokenizer=mp.tokenizer, mask_token_id=mp.mask_token_id, device="cpu", examples=exs)
    assert (fp.fields["group_by_length"], fp.fields["end_of_turn"], fp.fields["baseline"]) == (True, "none", "none")
    assert "end_of_turn" in fp.strict()  # changes the tokens scored: a cache must match it
    other = load_recipe(None, ["data.group_by_length=true", "train.baseline=none"])
    fp2 = refcache.fingerprint(other, tokenizer=mp.tokenizer, mask_token_id=mp.mask_token_id, device="cpu", examples=exs)
    assert fp2.digest() != fp.digest()


def test_yaml_merge_keys_work_and_explicit_keys_override_them(tmp_path):
    """Anchors and ``<<: *defaults`` are ordinary YAML; they were refused as an unknown tag."""
    p = tmp_path / "r.yaml"
    p.write_text("extends: demo\ntrain: &t\n  beta: 0.2\n  lr: 2.0e-5\nablate:\n  train_overrides:\n    <<: *t\n    lr: 3.0e-5\n")
    from dllm_align.config.recipe import read_yaml

    raw = read_yaml(p)
    assert raw["train"] == {"beta": 0.2, "lr": 2e-5}
    assert raw["ablate"]["train_overrides"] == {"beta": 0.2, "lr": 3e-5}
    p.write_text("extends: demo\nx: &d {beta: 0.3}\ntrain:\n  <<: *d\n  beta: 0.4\n  beta: 0.5\n")
    with pytest.raises(UserError, match="duplicate key 'beta'"):
        read_yaml(p)  # a key given twice beside a merge is still refused


def test_the_flash_recipe_trains_a_shrunk_llada2_with_adapters_on_attention_and_the_shared_expert_only(tmp_path):
    """llada2_flash_kto_mix_14k as shipped (LoRA targets, bf16 base, cached reference, global batch 16) on a shrunk
    LLaDA2.0 checkpoint (the family fixture's fields, 8 experts of width 16): precompute-ref and one step run, and the
    adapters sit on attention and the shared expert, never on a routed expert."""
    pytest.importorskip("peft")
    import yaml

    from dllm_align.models.load import build_tiny_tokenizer
    from fixtures.family_checkpoints import llada2_config, llada2_state, write_checkpoint
    from fixtures.sort_toy import write_pairs

    repo = Path(__file__).resolve().parents[1]
    flash = repo / "recipes" / "llada2_flash_kto_mix_14k.yaml"
    r = load_recipe(str(flash))
    assert r.train.lora.enabled and r.model.dtype == "bfloat16" and r.reference.mode == "cached"
    assert r.train.global_batch_size % 16 == 0 and r.train.global_batch_size % 8 == 0  # 8 GPUs and 2 x 8
    tok = build_tiny_tokenizer()
    model = write_checkpoint(tmp_path / "llada2", llada2_config(tok), llada2_state(llada2_config(tok)), tok)
    data = write_pairs(tmp_path / "pairs.jsonl", n=8)
    sets = [f"model.name_or_path={model}", f"data.train={data}", f"data.test={data}", "data.format=paired",
            "data.max_length=96", "reference.n_mc=2", "reference.batch_size=8", "reference.shard_size=8",
            "train.global_batch_size=4", "train.max_steps=1", "train.save_every=null", "train.warmup_ratio=0"]
    args = [a for s in sets for a in ("--set", s)]
    run = tmp_path / "run"
    runner = CliRunner()
    res = runner.invoke(app, ["precompute-ref", str(flash), "-o", str(run), *args])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", str(flash), "-o", str(run), *args])
    assert res.exit_code == 0, res.output
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["loss"] == row["loss"]
    from dllm_align.models.load import load_model
    from dllm_align.training.policy import apply_lora

    mp = load_model(str(model))
    apply_lora(mp.model, r.train.lora, None)  # what train did to the policy: the trainable parameters
    names = [n for n, p in mp.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and (".attention." in n or ".shared_experts." in n) for n in names), names[:5]
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == {"query_key_value", "dense", "gate_proj", "up_proj", "down_proj"}
    assert not any(".experts." in n.replace(".shared_experts.", "") for n in names)  # routed experts frozen
    assert yaml.safe_load((run / "recipe.train.yaml").read_text())["train"]["lora"]["target_modules"][2:] == [
        "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]


# --------------------------------------------------------------------------- bounded work on hostile YAML
def _billion_laughs(levels: int = 9, width: int = 9) -> str:
    lines = ["laughs:", f"  l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels + 1):
        lines.append(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "extends: demo\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("command", [["recipes", "check"], ["recipes", "show"], ["train"], ["judge", "a.jsonl", "b.jsonl", "--recipe"]])
def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, monkeypatch, command):
    """Nested anchors used 9 times each would expand to 9^10 values; the loader sizes the alias graph and refuses."""
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "bomb.yaml"
    p.write_text(_billion_laughs())
    r = runner.invoke(app, [*command, str(p), "-o", str(tmp_path / "out")] if command[0] != "recipes" else [*command, str(p)])
    if command[0] == "recipes" and command[1] == "show":  # show prints the file as written (no aliases expanded)
        assert r.exit_code == 0 and r.stdout == p.read_text()
        return
    assert r.exit_code == 2, r.output
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert line == f"Error: {p}: refused: its aliases expand to more than 100,000 values (an alias bomb?)"
    assert r.stdout == "" and not (tmp_path / "out").exists()


def test_too_many_aliases_are_refused_with_the_limit(tmp_path):
    from dllm_align.config.recipe import MAX_ALIASES, read_yaml

    p = tmp_path / "r.yaml"
    p.write_text("extends: demo\nx: &a 1\ny: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n")
    with pytest.raises(UserError) as e:
        read_yaml(p)
    assert e.value.message == f"{p}:3: refused: more than {MAX_ALIASES} aliases (*name); a recipe needs a few at most"
    p.write_text("extends: demo\nx: &a 1\ny: [" + ", ".join(["*a"] * MAX_ALIASES) + "]\n")
    assert read_yaml(p)["y"] == [1] * MAX_ALIASES  # up to the limit, aliases are ordinary YAML


def test_a_48_mb_recipe_is_refused_by_its_size(tmp_path):
    p = tmp_path / "big.yaml"
    with open(p, "w") as f:
        f.write("extends: demo\ntrain:\n")
        line = "  # " + "x" * 1020 + "\n"
        for _ in range(48 << 10):
            f.write(line)
    r = runner.invoke(app, ["recipes", "check", str(p)])
    assert r.exit_code == 2, r.output
    size = p.stat().st_size
    assert r.stderr.splitlines()[0] == f"Error: {p}: {size:,} bytes, more than the 64 KiB a recipe file may hold"
    assert r.stdout == ""
    r = runner.invoke(app, ["recipes", "show", str(p)])  # printed as written: bounded the same way
    assert r.exit_code == 2 and r.stderr.startswith(f"Error: {p}: {size:,} bytes") and r.stdout == ""
    # an --set value is bounded too
    from dllm_align.config.recipe import MAX_YAML_BYTES

    with pytest.raises(UserError, match=r"--set train.beta: 65,537 characters, more than the 64 KiB a recipe may hold"):
        load_recipe("demo", ["train.beta=" + "1" * (MAX_YAML_BYTES + 1)])


def test_an_accelerate_config_is_read_with_the_same_bounds(tmp_path):
    from dllm_align.training.memory import read_launch

    p = tmp_path / "acc.yaml"
    p.write_text(_billion_laughs().replace("extends: demo\n", "distributed_type: NO\n"))
    with pytest.raises(UserError, match=r"acc.yaml: refused: its aliases expand to more than 100,000 values"):
        read_launch(str(p))
