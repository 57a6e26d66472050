"""Objectives as components: the registry, and a toy objective written here alone that trains through `dllm-align train`.

The toy, "mean-elbo", maximises the policy's ELBO of every row (no reference, no labels): one class and one
``register_objective`` call, nothing else, is all a new objective needs.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.core.errors import UserError
from dllm_align.objective import base
from dllm_align.objective.base import LossTerms, Objective, get_objective, objective_for, register_objective

from fixtures.sort_toy import write_pairs

runner = CliRunner()


class MeanElbo(Objective):
    """Minimise -B_hat_policy(y | x), averaged over the global batch."""

    name = "mean-elbo"
    needs_reference = False

    def loss(self, policy, reference, batch, step):
        per = -policy
        return LossTerms(per.sum() / step.normalizer, {"loss_sum": float(per.detach().sum()), "n": per.numel()})


@pytest.fixture
def mean_elbo(monkeypatch):
    monkeypatch.setattr(base, "_OBJECTIVES", dict(base._OBJECTIVES))  # registered for this test only
    register_objective(MeanElbo)
    return MeanElbo


def test_the_built_in_objectives_answer_for_themselves():
    from dllm_align.config.schema import TrainSection

    kto, sft, vrpo = (objective_for(TrainSection(objective=n)) for n in ("elbo_kto", "sft", "vrpo"))
    assert (kto.rows_per_unit, sft.rows_per_unit, vrpo.rows_per_unit) == (1, 1, 2)
    assert (kto.needs_reference, sft.needs_reference, vrpo.needs_reference) == (True, False, True)
    assert not kto.uses_extra_rows and objective_for(TrainSection(baseline="kl")).uses_extra_rows
    with pytest.raises(UserError, match=r"train.objective 'ipo' is not a known objective \(known: elbo_kto, sft, vrpo\)"):
        get_objective("ipo")


def test_a_toy_objective_is_one_class_and_one_registry_line(mean_elbo, tmp_path):
    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.batching import collate
    from dllm_align.data.examples import load_training_examples
    from dllm_align.models.load import load_model
    from dllm_align.objective.elbo import DrawConfig, elbo

    data = write_pairs(tmp_path / "pairs.jsonl", n=4)  # 8 rows: one global batch per step
    recipe = {
        "name": "toy-objective",
        "model": {"name_or_path": "builtin:tiny"},
        "data": {"train": str(data), "format": "paired", "max_length": 64},
        # no cache exists: an objective without a reference never asks for one
        "reference": {"n_mc": 4, "cache": str(tmp_path / "no-cache")},
        "train": {"lr": 3e-3, "warmup_ratio": 0, "scheduler": "constant", "batch_size": 8, "max_steps": 3},
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", str(path), "-o", str(out), "--set", "train.objective=mean-elbo"])
    assert res.exit_code == 0, res.output
    assert "objective mean-elbo, 8 rows" in res.stderr
    assert not (tmp_path / "no-cache").exists()

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "reward_desirable" not in rows[0]  # the metrics are the objective's own
    # step 1 ran the untrained model: its loss is minus the mean ELBO of the 8 rows, computed here independently
    rec = load_recipe(str(path), [])
    base_mp = load_model("builtin:tiny")
    exs = load_training_examples(rec, base_mp.tokenizer, quiet=True)
    b = collate(exs, rec.data.padding, 64, base_mp.tokenizer.pad_token_id)
    with torch.no_grad():
        want = -float(elbo(base_mp, b, DrawConfig(n_mc=4)).double().mean())
    assert rows[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it trained towards a higher ELBO
    assert json.loads((out / "final" / "training_summary.json").read_text())["objective"] == "mean-elbo"
