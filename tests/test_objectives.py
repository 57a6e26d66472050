"""Objectives as components: the registry, and a toy objective written here alone that trains through `dllm-align train`.

The toy, "mean_elbo", maximises the policy's ELBO of every row times its own setting ``train.mean_elbo.weight``
(no reference, no labels): one class and one ``Component`` declaration with its settings model, nothing else, is
all a new objective needs.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.core.errors import UserError
from pydantic import Field

from dllm_align.config import components as registry
from dllm_align.objective.base import LossTerms, Objective, get_objective, objective_for

from fixtures.sort_toy import write_pairs

runner = CliRunner()


class MeanElboSettings(registry.ComponentSettings):
    weight: float = Field(1.0, gt=0, description="Scale of the loss.")


class MeanElbo(Objective):
    """Minimise -weight * B_hat_policy(y | x), averaged over the global batch."""

    name = "mean_elbo"
    needs_reference = False

    def loss(self, policy, reference, batch, step):
        per = -self.settings.weight * policy
        return LossTerms(per.sum() / step.normalizer, {"loss_sum": float(per.detach().sum()), "n": per.numel()})


@pytest.fixture
def mean_elbo():
    comp = registry.register(registry.Component("objective", "mean_elbo", f"{__name__}:MeanElbo",
                                                settings=MeanElboSettings))
    yield MeanElbo
    registry.unregister("objective", comp.name)  # declared for this test only


def test_the_built_in_objectives_answer_for_themselves():
    from dllm_align.config.schema import TrainSection

    kto, sft, vrpo = (objective_for(TrainSection(objective=n)) for n in ("elbo_kto", "sft", "vrpo"))
    assert (kto.rows_per_unit, sft.rows_per_unit, vrpo.rows_per_unit) == (1, 1, 2)
    assert (kto.needs_reference, sft.needs_reference, vrpo.needs_reference) == (True, False, True)
    assert not kto.uses_extra_rows and objective_for(TrainSection(baseline="kl")).uses_extra_rows
    with pytest.raises(UserError, match=r"train.objective: no objective named 'ipo'; known: elbo_kto, sft, vrpo"):
        get_objective("ipo")


def test_a_toy_objective_is_one_class_and_one_declaration(mean_elbo, tmp_path):
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
        "train": {"objective": "mean_elbo", "mean_elbo": {"weight": 2.0}, "lr": 3e-3, "warmup_ratio": 0,
                  "scheduler": "constant", "batch_size": 8, "max_steps": 3},
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    shown = runner.invoke(app, ["recipes", "show", str(path)])
    assert shown.exit_code == 0 and yaml.safe_load(shown.stdout)["train"]["mean_elbo"] == {"weight": 2.0}
    bad = runner.invoke(app, ["recipes", "check", str(path), "--set", "train.mean_elbo.weight=-1"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.output
    assert "train.mean_elbo.weight" in bad.stderr and "greater than 0" in bad.stderr
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", str(path), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "objective mean_elbo, 8 rows" in res.stderr
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
        want = -2.0 * float(elbo(base_mp, b, DrawConfig(n_mc=4)).double().mean())
    assert rows[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it trained towards a higher ELBO
    assert json.loads((out / "final" / "training_summary.json").read_text())["objective"] == "mean_elbo"


def test_recipes_check_refuses_an_unknown_objective_without_importing_torch():
    """The name is checked against the declarations, which import nothing heavy."""
    import subprocess
    import sys

    code = ("import sys\nfrom typer.testing import CliRunner\nfrom dllm_align.cli.app import app\n"
            "r = CliRunner().invoke(app, ['recipes', 'check', 'demo', '--set', 'train.objective=elbo_ktoo'])\n"
            "print(r.exit_code, 'torch' in sys.modules)\nprint(r.stderr, end='')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "2 False"
    assert out[1:] == ["Error: --set train.objective=elbo_ktoo: train.objective: no objective named 'elbo_ktoo' "
                       "(did you mean 'elbo_kto'?); known: elbo_kto, sft, vrpo"]


def test_an_objective_refuses_the_train_keys_it_ignores_and_vrpo_checks_its_data():
    from dllm_align.config.recipe import load_recipe

    with pytest.raises(UserError, match=r"train.baseline: not a setting of the objective 'sft'"):
        load_recipe("demo", ["train.objective=sft", "train.baseline=kl"])
    with pytest.raises(UserError, match=r"train.sft_rows: not a setting of the objective 'vrpo'"):
        load_recipe("demo", ["train.objective=vrpo", "train.sft_rows=desirable"])
    with pytest.raises(UserError, match=r"train.objective 'vrpo' needs paired data, but data.format is 'unpaired'"):
        load_recipe("demo", ["train.objective=vrpo", "data.format=unpaired"])
    assert load_recipe("demo", ["train.objective=sft"]).train.objective == "sft"  # defaults of ignored keys pass
