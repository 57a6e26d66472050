"""The step-0 invariant on realistic lengths, where a reference scored in another call layout shows: real kto-mix
rows of a few hundred tokens on the ``builtin:small`` body, through precompute -> cache -> training and the online reference.

Kernels block their reductions by shape, so one row scored among other rows (another batch width,
other packed row-mates, another chunking) can differ in the last bits: under bf16 autocast up to
~0.07 nats per draw on these rows. Precompute therefore scores every training row in the micro-batch,
row order and call layout training uses at epoch 0 (``training.reference.micro_batch_groups``): the
policy and the reference then run the very same forward shapes, and every margin is exactly 0 on the
CPU, fp32 and bf16, packed and padded. The tests below check 16 rows in 4 micro-batches of 4 rows,
grouped differently from the old precompute (longest first, 16 at a time), whose values do differ.
"""

from __future__ import annotations

import pytest
import torch

from dllm_align.config.recipe import load_recipe


@pytest.fixture(scope="module")
def real(tmp_path_factory, shared_data):
    """16 real kto-mix rows (prompt + completion 150..600 byte tokens), written as one unpaired file."""
    from fixtures.real_rows import write_real_rows

    root = tmp_path_factory.mktemp("real")
    path = write_real_rows(shared_data, root / "rows.jsonl")
    return {"root": root, "data": path}


def _recipe(real, mp, padding, mode, out):
    return load_recipe(None, [
        f"data.train={real['data']}", "data.format=unpaired", "data.max_length=640", f"data.padding={padding}",
        "model.name_or_path=builtin:small", "reference.n_mc=4", "reference.batch_size=16", "reference.shard_size=6",
        f"reference.mode={mode}", f"reference.cache={real['root'] / f'cache-{mp}-{padding}'}",
        f"train.mixed_precision={mp}", "train.batch_size=4", "train.global_batch_size=8", "train.lr=1e-3",
    ], output_dir=str(real["root"] / out))


@pytest.mark.parametrize("mp", ["no", "bf16"])
@pytest.mark.parametrize("padding", ["packed", "none"])
def test_step0_margins_exact_on_real_rows_cached_and_online(real, fresh_accelerate, mp, padding):
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.training import reference as ref
    from dllm_align.training.loop import invariant_margins
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator

    rec = _recipe(real, mp, padding, "cached", f"run-{mp}-{padding}")
    ref_mp = ref.load_reference(rec, "cpu")
    exs = load_training_examples(rec, ref_mp.tokenizer, quiet=True)
    lengths = sorted(ex.length for ex in exs)
    assert lengths[0] >= 150 and lengths[-1] >= 400  # realistic: hundreds of tokens, varied
    ref.precompute(rec, exs, make_collate(rec, ref_mp.tokenizer), None, ref_mp)
    for mode in ("cached", "online"):
        r = _recipe(real, mp, padding, mode, f"run-{mp}-{padding}-{mode}")
        run = setup_run(r, make_accelerator(r), None, exs)
        margins = invariant_margins(run, steps=2)
        assert len(margins) == 16
        worst = max(abs(v) for v in margins.values())
        assert worst == 0.0, (mp, padding, mode, worst)


def test_batch_mates_change_bf16_values_so_precompute_follows_training_micro_batches(real, fresh_accelerate):
    """The test above has teeth: the old precompute (longest first, 16 rows a call) gives other values."""
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.training import reference as ref

    rec = _recipe(real, "bf16", "packed", "cached", "teeth")
    ref_mp = ref.load_reference(rec, "cpu")
    exs = load_training_examples(rec, ref_mp.tokenizer, quiet=True)
    collate = make_collate(rec, ref_mp.tokenizer)
    cfg = ref.draw_config(rec)
    pack = rec.data.max_length
    old = ref.reference_values(ref_mp, exs, collate, cfg, 16, pack_length=pack)
    groups = ref.micro_batch_groups(rec, exs)
    assert sorted(len(g) for g in groups) == [4, 4, 4, 4] and sorted(i for g in groups for i in g) == list(range(16))
    new = torch.zeros(16, 4)
    for g in groups:
        new[g] = torch.from_numpy(ref.group_values(ref_mp, [exs[i] for i in g], collate, cfg, 4, None, pack))
    diff = (new - torch.from_numpy(old)).abs()
    assert float(diff.max()) > 1e-3  # batch-mates move bf16 draws (measured ~0.05 nats)
