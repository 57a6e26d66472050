"""The embedded default (`dllm-align demo`) and the sweeps (`dllm-align ablate`) end to end on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dllm_align.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    res = runner.invoke(app, ["demo", "-o", str(out)])
    return out, res


def test_demo_aligns_the_toy_model(demo_run):
    # How long it takes is measured by `python benchmarks/run.py --only demo`, not asserted here.
    out, res = demo_run
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert set(results["rows"]) == {"aligned", "chosen", "rejected"}
    for row in results["rows"].values():
        assert row["n"] == 200 and row["wins"] + row["losses"] + row["ties"] == 200
        assert row["ci90"][0] <= row["awr"] <= row["ci90"][1]
    assert results["awr"] == results["rows"]["aligned"]["awr"]
    assert results["ci90"][0] > 0.5, results["rows"]["aligned"]  # a real alignment gain from unpaired labels
    assert results["rows"]["rejected"]["awr"] < 0.5
    assert results["rows"]["chosen"]["awr"] > 0.5
    # stdout carries only the table; progress and logs go to stderr
    assert "ELBO-KTO (aligned)" in res.stdout and "rejected target" in res.stdout
    assert "demo: [1/4]" in res.stderr and "demo: [1/4]" not in res.stdout
    assert (out / "results.md").read_text().count("|") > 20


def test_demo_block_aligns_the_block_diffusion_base(tmp_path):
    """`demo --recipe demo_block`: the block-diffusion base (SDAR's layout, blocks of 4) aligned by the block ELBO
    with a shared clean stream and decoded by the block sampler beats its base, the 90% interval above 50."""
    out = tmp_path / "run"
    res = runner.invoke(app, ["demo", "--recipe", "demo_block", "-o", str(out)])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    aligned = results["rows"]["aligned"]
    assert aligned["n"] == 200 and results["ci90"][0] > 0.5, aligned
    assert results["rows"]["rejected"]["awr"] < 0.5 < results["rows"]["chosen"]["awr"]
    assert "Warning" not in res.stderr, res.stderr  # nothing alarming here either (transformers' own included)


def test_demo_gemma_aligns_the_uniform_noise_base(tmp_path):
    """`demo --recipe demo_gemma`, shortened (the first 1,600 training rows, 100 steps, 100 test prompts): the packaged
    DiffusionGemma-layout base aligned by ELBO-KTO with the uniform-noise ELBO (first step's margins exactly 0) and
    decoded by transformers' own sampler beats its base, the 90% interval above 50. The full demo's figure is in
    docs/demo.md."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "demo_gemma.yaml"
    out = tmp_path / "run"
    res = runner.invoke(app, ["demo", "--recipe", str(recipe), "-o", str(out), "--set", "data.limit=1600",
                              "--set", "train.max_steps=100", "--set", "train.save_every=100", "--set", "generate.limit=100"])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["base_model"] == "builtin:toy-sort-base-gemma"
    aligned = results["rows"]["aligned"]
    assert aligned["n"] == 100 and results["ci90"][0] > 0.5, aligned  # measured: 66.0 [60.0, 72.0]
    assert results["rows"]["rejected"]["awr"] < 0.5 < results["rows"]["chosen"]["awr"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_desirable"] == 0.0 and metrics[0]["reward_undesirable"] == 0.0  # policy = reference
    assert json.loads((out / "gen.aligned.settings.json").read_text())["sampler"]["sampler"] == "diffusion_gemma"
    assert "Warning" not in res.stderr, res.stderr


def test_ablate_runs_on_the_block_family(tmp_path):
    """`ablate` on the block-diffusion demo: its sweep trains with the block ELBO and judges the block sampler's
    decodes, one row per setting."""
    out = tmp_path / "abl"
    res = runner.invoke(app, ["ablate", "baseline", "demo_block", "--betas", "0.1", "--lrs", "1e-4", "-o", str(out),
                              "--set", "ablate.baselines=[none]", "--set", "train.max_steps=2", "--set", "train.save_every=2",
                              "--set", "generate.limit=8", "--set", "data.limit=64", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)
    assert row["baseline"] == "none" and row["n"] == 8
    metrics = [json.loads(x) for x in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["reward_desirable"] == 0.0
    settings = json.loads(next(out.glob("*/gen.settings.json")).read_text())["sampler"]
    assert settings["sampler"] == "block" and settings["block_length"] == 4


def test_demo_output_reads_without_the_paper(demo_run):
    import re

    out, res = demo_run
    assert res.exit_code == 0, res.output
    # plain lines after the table: the task, what AWR and the target rows mean, exact sorts
    after = res.stdout.split("rejected target", 1)[1]
    for needle in ("Task: sort five digits", "AWR (adjusted win rate)", "chosen target / rejected target",
                   "Exact ascending sorts: base"):
        assert needle in after, res.stdout
    results = json.loads((out / "results.json").read_text())
    s = results["sorts"]
    assert s["aligned"]["ascending"] > s["base"]["ascending"] and s["aligned"]["n"] == 200
    assert f"base {s['base']['ascending']}/200, aligned {s['aligned']['ascending']}/200" in res.stdout
    # clean numbers: no float noise such as 0.20762500000000045 anywhere in the outputs
    text = (out / "results.json").read_text() + res.stdout
    assert not re.search(r"\d\.\d{7,}", text), text
    # nothing alarming on the default run, and the last line says what was written
    assert "Warning" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("demo: wrote ") and str(out / "demo.png") in last and "results.json" in last
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the step line's abbreviations are explained once
    assert res.stderr.count("r+ / r- = mean reward margin") == 1


def test_demo_rerun_reuses_every_stage(demo_run, monkeypatch):
    out, _ = demo_run
    before = json.loads((out / "results.json").read_text())
    kept = {p: p.read_bytes() for p in [*out.glob("gen.*.jsonl"), *(out / "final").rglob("*")] if p.is_file()}
    assert len(kept) > 4

    def no_training(*a, **k):
        raise AssertionError("the rerun trained again")

    monkeypatch.setattr("dllm_align.workflows.pipeline.train", no_training)
    res = runner.invoke(app, ["demo", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert "train: reusing" in res.stderr
    assert res.stderr.count("200 already in") == 2  # base and aligned generations: nothing sampled again
    assert {p: p.read_bytes() for p in kept} == kept  # the model and the samples as they were
    assert json.loads(res.stdout) == before


def test_ablate_imbalance_table_plot_and_instant_rerun(tmp_path):
    out = tmp_path / "imb"
    small = ["--set", "train.max_steps=4", "--set", "generate.limit=24", "--set", "train.save_every=4"]
    args = ["ablate", "imbalance", "demo", "--ratios", "0.1,0.5,1", "-o", str(out), *small]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    csv_rows = (out / "results.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 1 + 6  # both classes x 3 ratios
    assert (out / "imbalance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # lambda_D * n_D = lambda_U * n_U in every setting
    for f in out.glob("*/result.json"):
        r = json.loads(f.read_text())
        assert abs(r["lambda_desirable"] * r["n_desirable"] - r["lambda_undesirable"] * r["n_undesirable"]) <= 1e-3 * max(r["n_desirable"], r["n_undesirable"])
    assert "| desirable | 0.1 |" in res.stdout
    again = runner.invoke(app, args)
    assert again.exit_code == 0
    assert again.stderr.count("done, reusing") == 6  # every setting reused: nothing trained, sampled or judged again
    assert "same run as desirable_1, reusing it" in res.stderr  # ratio 1 of both sweeps trains once
    assert again.stdout == res.stdout


def test_ablate_rejects_bad_ratio(tmp_path):
    res = runner.invoke(app, ["ablate", "imbalance", "demo", "--ratios", "0,1.5", "-o", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert "ratios must be in (0, 1]" in res.stderr
    assert not (tmp_path / "x").exists()


def test_the_demo_runs_on_one_thread_unless_the_user_chose():
    """`dllm-align demo` as the README's Quick start types it (no OMP_NUM_THREADS) runs torch on one thread:
    on a loaded 2-core box the default thread count stretched it to 46 minutes."""
    import torch

    from dllm_align.workflows.demo import one_thread_unless_chosen

    env: dict = {}
    assert one_thread_unless_chosen(env) is True
    assert env == {"OMP_NUM_THREADS": "1"} and torch.get_num_threads() == 1
    chosen = {"OMP_NUM_THREADS": "2"}
    assert one_thread_unless_chosen(chosen) is False and chosen == {"OMP_NUM_THREADS": "2"}
