"""``train.baseline: kl``: KTO's reference point z0 from mismatched pairs of the whole step batch.

z0 = max(0, mean over the step's pairs (x_i, y_{i-1}) of B_pol - B_ref), stop-gradient,
the same masks for policy and reference (seeded by the pair's id). Checked here
by recomputing it from the saved policy, across micro-batch splits, and cached
against online; two processes x 1 row against one process x 2 is in
tests/test_cli_train.py.
"""

from __future__ import annotations

import pytest
import torch

from dllm_align.core.errors import UserError
from dllm_align.data.examples import kl_examples, kl_pair_id
from dllm_align.data.tokenize import Example

from test_training import assert_same_params, final_params, metrics, recipe_for


def test_pairs_by_hand():
    a = Example("a", [1, 2], [10, 11, 12], True)
    b = Example("b", [3], [20], False)
    c = Example("c", [4, 5, 6], [30, 31], True)
    pairs = kl_examples([a, b, c], max_length=5)
    # row i's prompt with row i-1's completion, cyclically; a borrowed completion loses its tail to fit
    assert [p.id for p in pairs] == [kl_pair_id("a", "c"), kl_pair_id("b", "a"), kl_pair_id("c", "b")]
    assert [(p.prompt_ids, p.completion_ids) for p in pairs] == [([1, 2], [30, 31]), ([3], [10, 11, 12]), ([4, 5, 6], [20])]
    assert all(p.label is None for p in pairs)
    assert kl_examples([a, c], max_length=4)[1].completion_ids == [10]  # 3 prompt tokens leave room for 1
    with pytest.raises(UserError, match="at least 2 rows"):
        kl_examples([a], 8)


@pytest.fixture(scope="module")
def kl_toy(tmp_path_factory):
    """16 sorting pairs and a reference cache that holds the kl pairs of a global batch of 4 (3 steps)."""
    from dllm_align.training import reference as ref
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.objective.elbo_kto import planned_kl_examples
    from dllm_align.models.load import load_model

    from fixtures.sort_toy import write_pairs

    root = tmp_path_factory.mktemp("kl")
    data = write_pairs(root / "pairs.jsonl", n=16)
    cache = root / "ref_cache"
    rec = recipe_for(root, data, cache, "train.baseline=kl", "train.global_batch_size=4", "train.max_steps=3")
    mp = load_model("builtin:tiny")
    exs = load_training_examples(rec, mp.tokenizer, quiet=True)
    pairs = planned_kl_examples(rec, exs)
    assert len(pairs) == 12  # 3 steps x 4 rows, all distinct
    ref.precompute(rec, exs + pairs, make_collate(rec, mp.tokenizer), None, mp)
    return {"root": root, "data": data, "cache": cache, "examples": exs}


def _run(kl_toy, out, *sets):
    from dllm_align.training.train import train

    rec = recipe_for(kl_toy["root"], kl_toy["data"], kl_toy["cache"], "train.baseline=kl", "train.max_steps=3", *sets, out=out)
    train(rec, examples=kl_toy["examples"])
    return rec


def test_z0_is_the_clamped_mean_margin_of_the_step_pairs(kl_toy):
    """Step 1: policy = reference, so z0 = 0. Step 3: recomputed from the step-2 checkpoint with the same masks."""
    from dllm_align.data.batching import collate
    from dllm_align.objective.elbo import DrawConfig, elbo
    from dllm_align.models.load import load_model
    from dllm_align.training.train import setup_run

    rec = _run(kl_toy, "z0", "train.global_batch_size=4", "train.save_every=1", "train.keep_checkpoints=5")
    m = metrics(rec.output_dir)
    assert m[0]["baseline"] == 0.0 and m[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    # the pairs of step 3 (index 2) from the run's own plan
    from accelerate import Accelerator

    run = setup_run(rec, Accelerator(cpu=True), None, kl_toy["examples"])
    pairs = [p for mb in run.data.extra_micro_batches(2, run.plan) for p in mb]  # 4 micro-batches of 1 on one process
    assert len(pairs) == 4 and all(p.id.startswith("kl(") for p in pairs)
    pol = load_model(str(rec.output_dir) + "/checkpoints/step-2")
    base = load_model("builtin:tiny")
    b = collate(pairs, rec.data.padding, 64, pol.tokenizer.pad_token_id)
    cfg = DrawConfig(n_mc=4)
    with torch.no_grad():
        margins = elbo(pol, b, cfg) - elbo(base, b, cfg)
    want = max(0.0, float(margins.double().mean()))
    assert m[2]["baseline"] == pytest.approx(want, abs=1e-4)
    assert any(abs(x["baseline"]) > 1e-3 for x in m[1:]) or float(margins.mean()) < 0  # it moved, or was clamped


def test_kl_baseline_same_update_for_any_split_and_cached_or_online(kl_toy):
    """1 x batch 4, 1 x 4 micro-batches of 1, and the online reference: same z0, losses, parameters."""
    runs = {
        "b4": _run(kl_toy, "kl-b4", "train.global_batch_size=4", "train.batch_size=4"),
        "a4": _run(kl_toy, "kl-a4", "train.global_batch_size=4", "train.batch_size=1"),
        "online": _run(kl_toy, "kl-online", "train.global_batch_size=4", "train.batch_size=2", "reference.mode=online"),
    }
    ref_m = metrics(runs["b4"].output_dir)
    ref_p = final_params(runs["b4"].output_dir)
    for name in ("a4", "online"):
        mm = metrics(runs[name].output_dir)
        for x, y in zip(ref_m, mm):
            for key in ("loss", "baseline", "grad_norm"):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (name, x["step"], key)
        assert_same_params(ref_p, final_params(runs[name].output_dir), atol=1e-5)  # Adam turns fp32 rounding into ~5e-6


def test_cache_without_the_pairs_is_refused(kl_toy, tmp_path):
    from dllm_align.training import reference as ref
    from dllm_align.data.examples import make_collate
    from dllm_align.models.load import load_model
    from dllm_align.training.train import train

    cache = tmp_path / "plain"
    plain = recipe_for(kl_toy["root"], kl_toy["data"], cache, "train.global_batch_size=4")
    mp = load_model("builtin:tiny")
    ref.precompute(plain, kl_toy["examples"], make_collate(plain, mp.tokenizer), None, mp)
    rec = recipe_for(kl_toy["root"], kl_toy["data"], cache, "train.baseline=kl", "train.global_batch_size=4",
                     "train.max_steps=2", out="refused")
    with pytest.raises(UserError, match="holds no reference ELBOs for the kl baseline's mismatched pairs") as e:
        train(rec, examples=kl_toy["examples"])
    assert "global_mean" in e.value.message and "precompute-ref" in e.value.hint
