"""The LLaDA2.1 demo base's training corruption (``reference.replace_share``: masked plus uniformly replaced tokens,
scored against the clean tokens), its recipe checks, and `demo --recipe demo_llada21` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.config import components as registry
from dllm_align.config.recipe import load_recipe
from dllm_align.config.schema import component_problems
from dllm_align.objective.draws import DrawConfig, draw_masks, draw_replacements, make_noisy_batch

runner = CliRunner()
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_replacements_avoid_masked_positions_and_the_mask_token():
    cfg = DrawConfig(n_mc=64, seed=3)
    mask, _ = draw_masks("row-1", 40, cfg)
    replaced, tokens = draw_replacements("row-1", mask, cfg, 0.25, 50, 49, range(64))
    again, tokens_again = draw_replacements("row-1", mask, cfg, 0.25, 50, 49, range(64))
    assert np.array_equal(replaced, again) and np.array_equal(tokens, tokens_again)  # a pure function of the id
    assert not (replaced & mask).any()
    assert (tokens != 49).all() and tokens.min() >= 0 and tokens.max() <= 49
    share = replaced.sum() / (~mask).sum()
    assert 0.2 < share < 0.3, share
    # a subset of the draws gets the same replacements as the whole set
    sub, _ = draw_replacements("row-1", mask, cfg, 0.25, 50, 49, [5, 7])
    assert np.array_equal(sub, replaced[[5, 7]])


def test_noisy_batch_scores_the_replaced_tokens_against_the_clean_ones():
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (2, 12))
    completion = torch.zeros(2, 12, dtype=torch.bool)
    completion[:, 4:] = True
    cfg = DrawConfig(n_mc=4, seed=1)
    plain = make_noisy_batch(ids, None, completion, ["a", "b"], cfg, mask_token_id=49)
    mixed = make_noisy_batch(ids, None, completion, ["a", "b"], cfg, mask_token_id=49, replace=(0.5, 50))
    # the masks are the plain batch's; the replaced positions are scored too, with the clean token as target
    assert torch.equal(plain.input_ids == 49, mixed.input_ids == 49)
    assert torch.equal(plain.weight, mixed.weight)
    clean = ids.repeat_interleave(4, dim=0)
    assert torch.equal(mixed.targets, clean[mixed.rows, mixed.cols])
    changed = (mixed.input_ids != clean) & (mixed.input_ids != 49)
    assert changed.any() and not changed[:, :4].any()  # the prompt is never replaced
    scored = torch.zeros_like(changed)
    scored[mixed.rows, mixed.cols] = True
    assert (scored | ~changed).all()  # every replaced token is scored
    assert mixed.rows.numel() > plain.rows.numel()


def _problems(name: str, *sets: str) -> list[str]:
    recipe = load_recipe(str(RECIPES / f"{name}.yaml"), list(sets))
    return component_problems(recipe, registry.get("likelihood", "block"))


def test_replace_share_is_an_sft_option():
    assert _problems("toy_sort_base_llada21") == []
    assert any("only train.objective 'sft'" in p for p in _problems("toy_sort_base_llada21", "train.objective=elbo_kto"))
    assert any("packed" in p for p in _problems("toy_sort_base_llada21", "data.padding=packed"))
    # the whole-sequence and uniform likelihoods ignore it: set away from 0 it is refused by name
    recipe = load_recipe(str(RECIPES / "toy_sort_base_llada21.yaml"), [])
    for name in ("masked", "uniform"):
        assert any(p.startswith("reference.replace_share") for p in component_problems(recipe, registry.get("likelihood", name)))


def test_demo_llada21_aligns_the_editing_base(tmp_path):
    """`demo --recipe demo_llada21`, shortened (the first 1,600 training rows, 100 test prompts; 21 s on the idle
    2-core box, 97 s at load 13): the packaged
    LLaDA2.1-layout base aligned by ELBO-KTO with the block ELBO (first step's margins exactly 0) and decoded by the
    joint-threshold rule beats its base, the 90% interval above 50. The full demo's figure is in docs/llada21.md."""
    out = tmp_path / "run"
    res = runner.invoke(app, ["demo", "--recipe", str(RECIPES / "demo_llada21.yaml"), "-o", str(out),
                              "--set", "data.limit=1600", "--set", "generate.limit=100"])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["base_model"] == "builtin:toy-sort-base-llada21"
    aligned = results["rows"]["aligned"]
    assert aligned["n"] == 100 and results["ci90"][0] > 0.5, aligned
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_desirable"] == 0.0 and metrics[0]["reward_undesirable"] == 0.0  # policy = reference
    assert json.loads((out / "gen.aligned.settings.json").read_text())["sampler"]["sampler"] == "llada21"


def test_an_export_from_a_saved_llada21_folder_still_reads_as_llada21(tmp_path):
    """The demo's aligned final/ comes from the packaged base, a folder dllm-align saved (LLaDA2.0's published
    identity plus ``dllm_align_family``, no remote code): the export keeps the key, or it would load as LLaDA2.0.
    LLaDA2.0 itself, which needs no such evidence, still drops it."""
    from dllm_align.models.export import write_published_layout

    asset = Path(__file__).resolve().parents[1] / "src" / "dllm_align" / "assets" / "toy_sort_base_llada21"
    source = json.loads((asset / "config.json").read_text())
    assert source["dllm_align_family"] == "llada21" and not list(asset.glob("*.py"))
    for family, kept in (("llada21", True), ("llada2", False)):
        out = tmp_path / family
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**source, "dllm_align_family": family}))
        cfg = write_published_layout(out, family, asset)
        assert ("dllm_align_family" in cfg) == kept, cfg
        assert json.loads((out / "config.json").read_text()) == cfg
