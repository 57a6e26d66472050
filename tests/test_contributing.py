"""CONTRIBUTING.md's "Adding a component" steps for a family, an objective and a likelihood, followed as written:
one module holding each component and its declaration, given to the commands as a plugin
(``DLLM_ALIGN_PLUGINS``), then checked and trained from the command line in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import yaml

from fixtures.sort_toy import write_pairs

PLUGIN = textwrap.dedent('''
    """A contributor's components: a family, its likelihood and an IPO objective, each with its declaration."""
    import dataclasses

    from pydantic import Field

    from dllm_align.config.components import Component, ComponentSettings, register
    from dllm_align.objective.base import LossTerms
    from dllm_align.objective.masked import MaskedDiffusion
    from dllm_align.objective.paired import PairedObjective
    from dllm_align.models.families.llada import LLADA, build_llada_model


    def build_walk(tok, *shape):
        model = build_llada_model(tok, *shape)
        model.config.dllm_align_family = "walk"
        return model


    # A model family: its record, and a built-in model named in its declaration.
    WALK = dataclasses.replace(LLADA, name="walk", model_types=(), architectures=(), signature=(), published=None,
                               build_tiny=build_walk, likelihood="walk_masked")
    register(Component("family", "walk", f"{__name__}:WALK",
                       traits={"builtin_models": {"builtin:tiny-walk": {"hidden_size": 32, "layers": 1}}}))


    # A likelihood: an instance of a Likelihood subclass (here the masked one under its own name).
    class WalkMasked(MaskedDiffusion):
        name = "walk_masked"


    WALK_MASKED = WalkMasked()
    register(Component("likelihood", "walk_masked", f"{__name__}:WALK_MASKED"))


    # An objective over pairs: only its loss, and its own setting.
    class IpoSettings(ComponentSettings):
        tau: float = Field(0.1, gt=0, description="IPO's regularisation: the margin aimed at is 1 / (2 tau).")


    class Ipo(PairedObjective):
        name = "ipo_walk"

        def pair_loss(self, policy_chosen, policy_rejected, ref_chosen, ref_rejected, step):
            h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected).detach()
            per = (h - 1 / (2 * self.settings.tau)) ** 2
            metrics = {"loss_sum": float(per.detach().sum()), "n": int(per.numel()),
                       "reward_sum_chosen": float((policy_chosen - ref_chosen).detach().sum()),
                       "reward_sum_rejected": float((policy_rejected - ref_rejected).detach().sum()),
                       "accuracy_sum": float((h > 0).float().sum()), "saturated": 0}
            return LossTerms(per.sum() / step.normalizer, metrics)


    register(Component("objective", "ipo_walk", f"{__name__}:Ipo", settings=IpoSettings, ignores=("baseline", "sft_rows")))
''')


def _cli(args, env, cwd):
    code = "import sys\nfrom dllm_align.cli.app import main\nsys.argv = ['dllm-align', *sys.argv[1:]]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd)


def test_the_documented_steps_add_a_family_a_likelihood_and_an_objective(tmp_path):
    (tmp_path / "walk_components.py").write_text(PLUGIN)
    env = {**os.environ, "DLLM_ALIGN_PLUGINS": "walk_components",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    recipe = {"model": {"name_or_path": "builtin:tiny-walk"},
              "data": {"train": str(write_pairs(tmp_path / "pairs.jsonl", n=2)), "format": "paired", "max_length": 64},
              "reference": {"mode": "online", "n_mc": 2},
              "train": {"objective": "ipo_walk", "ipo_walk": {"tau": 0.5}, "batch_size": 2, "max_steps": 1,
                        "warmup_ratio": 0}}
    path = tmp_path / "walk.yaml"
    path.write_text(yaml.safe_dump(recipe))

    shown = _cli(["recipes", "show", str(path)], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["train"]["ipo_walk"] == {"tau": 0.5}
    bad = _cli(["recipes", "check", str(path), "--set", "train.ipo_walk.tau=0"], env, tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "train.ipo_walk.tau" in bad.stderr

    res = _cli(["train", str(path), "-o", str(tmp_path / "run")], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "objective ipo_walk" in res.stderr
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # step 1: policy == reference, every h is 0, so the loss is (1 / (2 tau))^2 = 1 exactly
    assert step["loss"] == 1.0 and step["reward_desirable"] == 0.0
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["dllm_align_family"] == "walk"
