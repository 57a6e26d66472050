"""Likelihoods as components: the declarations, the families' choices, and a toy likelihood with its own setting,
written here alone, that runs through `precompute-ref`, `train` and the memory model with one declaration and
one family field."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from pydantic import Field

from dllm_align.cli.app import app
from dllm_align.config import components as registry
from dllm_align.core.errors import UserError
from dllm_align.models.families import FAMILIES
from dllm_align.models.families.llada import LLADA
from dllm_align.objective.elbo import LIKELIHOODS, DrawConfig, draw_masks, get_likelihood
from dllm_align.objective.likelihood import Footprint, Likelihood

from fixtures.sort_toy import write_pairs

runner = CliRunner()


def test_every_family_names_a_registered_likelihood():
    for fam in FAMILIES.values():
        assert fam.likelihood in LIKELIHOODS, fam.name
        assert (fam.likelihood == "block") == bool(fam.block_size), fam.name  # the block likelihood reads it
    assert {f.name for f in FAMILIES.values() if f.likelihood == "block"} == {"sdar", "llada2", "llada21"}


def test_an_unknown_likelihood_is_refused_naming_the_known_ones():
    with pytest.raises(UserError) as e:
        get_likelihood("uniform-noise")
    assert e.value.message == ("the model family's likelihood: no likelihood named 'uniform-noise' (did you mean "
                               "'uniform'?); known: block, hybrid, masked, uniform")


@pytest.mark.parametrize("name", ["masked", "block"])
def test_the_absorbing_mask_likelihoods_draw_the_shared_masks(name):
    cfg = DrawConfig(n_mc=5, seed=2)
    mask, weight = get_likelihood(name).draws("row-1", 9, cfg)
    want_mask, want_weight = draw_masks("row-1", 9, cfg)
    assert np.array_equal(mask, want_mask) and np.array_equal(weight, want_weight)


class AllMaskedSettings(registry.ComponentSettings):
    scale: float = Field(1.0, gt=0, description="Factor on every draw's term.")


class AllMasked(Likelihood):
    """A toy noise process: every draw hides the whole completion (weight 1), so every draw's term is
    scale * sum_i log p(y_i | x, y all masked), whatever the seed. Not a bound; only the interface matters here."""

    name = "all_masked"

    def __init__(self):
        self.calls = 0

    def draws(self, example_id, length, cfg):
        return np.ones((cfg.n_mc, length), dtype=bool), np.ones(cfg.n_mc)

    def draw_terms(self, mp, input_ids, attention_mask, completion_mask, ids, cfg, *, max_rows_per_forward=None,
                   draws=None, pack_length=None):
        self.calls += 1
        cm = completion_mask.bool()
        noisy = torch.where(cm, torch.full_like(input_ids, mp.mask_token_id), input_ids)
        rows, cols = cm.nonzero(as_tuple=True)
        lp = mp.target_logprobs(noisy, attention_mask, rows, cols, input_ids[rows, cols])
        total = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=lp.device).index_add(0, rows, lp)
        return cfg.settings_of(self.name).scale * total[:, None].repeat(1, cfg.n_mc if draws is None else len(draws))

    def footprint(self, shape, draws, length, compute_bytes, *, attn="sdpa", packed=False):
        return Footprint(rows=1, scored_rows=1)  # one forward row per unit, whatever K


ALL_MASKED = AllMasked()
TOY_LLADA = dataclasses.replace(LLADA, likelihood="all_masked")  # LLaDA with the toy as its likelihood


@pytest.fixture
def all_masked():
    """The toy declared, and the built-in tiny model's family (LLaDA's) pointed at it, for this test only."""
    lik = registry.register(registry.Component("likelihood", "all_masked", f"{__name__}:ALL_MASKED",
                                               settings=AllMaskedSettings))
    llada = registry.get("family", "llada")
    registry.redeclare(dataclasses.replace(llada, target=f"{__name__}:TOY_LLADA"))
    ALL_MASKED.calls = 0
    yield ALL_MASKED
    registry.redeclare(llada)
    registry.unregister("likelihood", lik.name)


def test_a_new_likelihood_is_one_class_and_one_declaration(all_masked, tmp_path):
    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.models.load import load_model
    from dllm_align.training.cache import ReferenceCache
    from dllm_align.training.memory import Launch, estimate, model_shape

    K, T = 3, 64
    data = write_pairs(tmp_path / "pairs.jsonl", n=4)
    recipe = {
        "name": "toy-likelihood",
        "model": {"name_or_path": "builtin:tiny"},
        "data": {"train": str(data), "format": "paired", "max_length": T},
        "reference": {"n_mc": K, "batch_size": 8, "shard_size": 8, "cache": str(tmp_path / "ref_cache"),
                      "all_masked": {"scale": 2.0}},
        "train": {"lr": 1e-3, "warmup_ratio": 0, "batch_size": 2, "max_steps": 2},
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    shown = runner.invoke(app, ["recipes", "show", str(path)])
    assert shown.exit_code == 0 and yaml.safe_load(shown.stdout)["reference"]["all_masked"] == {"scale": 2.0}
    bad = runner.invoke(app, ["recipes", "check", str(path), "--set", "reference.all_masked.scale=0"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.output
    assert "reference.all_masked.scale" in bad.stderr and "greater than 0" in bad.stderr

    # precompute-ref through the toy: every cached draw is the all-masked sum, computed here independently
    res = runner.invoke(app, ["precompute-ref", str(path), "-o", str(tmp_path / "ref")])
    assert res.exit_code == 0, res.output
    assert all_masked.calls > 0
    mp = load_model("builtin:tiny")
    assert mp.likelihood == "all_masked"
    rec = load_recipe(str(path), [], output_dir=str(tmp_path / "ref"))
    exs = load_training_examples(rec, mp.tokenizer, quiet=True)
    collate = make_collate(rec, mp.tokenizer)
    cache = ReferenceCache.open(tmp_path / "ref_cache")
    stock = LIKELIHOODS["masked"]
    for ex in exs:
        b = collate([ex])
        ids, cm = b["input_ids"], b["completion_mask"].bool()
        with torch.no_grad():
            logp = torch.log_softmax(mp.logits(torch.where(cm, mp.mask_token_id, ids), b["attention_mask"]).float(), -1)
            want = 2.0 * logp[0].gather(-1, ids[0, :, None])[:, 0][cm[0]].sum()  # scale 2
            other = stock.draw_terms(mp, ids, b["attention_mask"], cm, b["ids"], DrawConfig(n_mc=K))
        got = cache.lookup([ex.id], K)[0]
        torch.testing.assert_close(got, want.expand(K), atol=2e-5, rtol=1e-5)
        assert (other[0] - got).abs().max() > 1e-3  # not what the stock masked likelihood gives

    # train through the toy with a resident reference: at step 1 policy == reference, every margin exactly 0
    calls = all_masked.calls
    res = runner.invoke(app, ["train", str(path), "-o", str(tmp_path / "train"), "--set", "reference.mode=online"])
    assert res.exit_code == 0, res.output
    assert all_masked.calls > calls
    first = json.loads((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()[0])
    rewards = [first[k] for k in ("reward_desirable", "reward_undesirable") if first[k] is not None]
    assert rewards and all(r == 0.0 for r in rewards) and first["baseline"] == 0.0, first

    # the memory model asks the same component: one row of T tokens per unit, not K
    est = estimate(model_shape(rec), rec, Launch(), autocast=False)
    assert est.tokens == rec.train.batch_size * T


def test_a_uniform_noise_setting_on_a_masked_model_is_refused_by_name(tmp_path):
    """The uniform likelihood's settings are its own: on a masked-diffusion model (no recipe key selects the
    likelihood; the checkpoint's family does) they are refused once the family is known, before anything runs."""
    res = runner.invoke(app, ["precompute-ref", "demo", "--set", "reference.surrogate=flat_ce", "-o", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        "Error: reference.surrogate: not a setting of the likelihood 'masked' (it has no use for it; leave it at "
        "'elbo') (llada models use the masked likelihood)"]
    assert not (tmp_path / "r").exists()
    from dllm_align.config.recipe import load_recipe

    gemma = load_recipe("demo", ["model.name_or_path=builtin:tiny-diffusiongemma", "reference.surrogate=flat_ce"])
    assert gemma.reference.own_settings("uniform").surrogate == "flat_ce"  # its own likelihood's: accepted
    with pytest.raises(UserError, match=r"reference.uniform: the settings of the likelihood 'uniform' are written "
                                        r"without its name: reference.time_power"):
        load_recipe("demo", ["reference.uniform.time_power=3"])
