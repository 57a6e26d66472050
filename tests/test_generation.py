"""The LLaDA sampler (docs/design.md#the-llada-rule): exact mode against a plain implementation, batching, seeding,
fast mode."""

from __future__ import annotations

import pytest
import torch

from _gen_reference import reference_generate
from dllm_align.core.errors import UserError
from dllm_align.generate.settings import SamplerSettings, SamplerStats, encode_prompt, length_batches, row_seed, transfer_schedule
from dllm_align.generate.sampler import _KVForward, generate, generate_batch
from dllm_align.models.predictor import MaskPredictor
from dllm_align.models.load import build_tiny_model, build_tiny_tokenizer



TEXTS = ["hi", "what is two plus two?", "sort these numbers: 3 1 2, quickly please"]


@pytest.fixture(scope="module")
def prompts(tiny):
    ps = [encode_prompt(tiny.tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]
    assert len({len(p) for p in ps}) == len(ps)  # different lengths: the batch is really padded
    return ps


def S(**kw) -> SamplerSettings:
    return SamplerSettings(**{"gen_length": 32, "block_length": 8, "steps": 16, **kw})


# --------------------------------------------------------------------------- pieces
def test_transfer_schedule_hand_values():
    # n // s per step plus one for the first n % s steps
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert transfer_schedule(32, 32) == [1] * 32
    assert transfer_schedule(8, 3) == [3, 3, 2]
    assert transfer_schedule(4, 6) == [1, 1, 1, 1, 0, 0]
    assert transfer_schedule(32, 1) == [32]


def test_row_seed_depends_on_seed_and_id_only():
    assert row_seed(0, "a") == row_seed(0, "a")
    assert len({row_seed(0, "a"), row_seed(1, "a"), row_seed(0, "b"), row_seed(0, 0)}) == 4
    assert 0 <= row_seed(123, "x") < 2**63


def test_length_batches_group_similar_lengths():
    lengths = [5, 50, 7, 49, 6, 51]
    assert length_batches(lengths, 2) == [[5, 1], [3, 2], [4, 0]]  # 51 50 | 49 7 | 6 5
    assert sorted(i for b in length_batches(lengths, 4) for i in b) == list(range(6))


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(sampler="llada", gen_length=30, block_length=8), "gen_length: 30 is not a multiple of block_length (8)"),
        (dict(sampler="llada", gen_length=32, block_length=8, steps=6), "steps: 6 is not a multiple of the number of blocks (4"),
        (dict(remasking="lowest"), "remasking: Input should be 'low_confidence' or 'random'"),
        (dict(temperature=-1.0), "temperature: Input should be greater than or equal to 0"),
        (dict(cfg=float("nan")), "cfg: Input should be a finite number"),
        (dict(cache="full"), "cache: Input should be 'none', 'prefix' or 'dual'"),
        (dict(threshold=1.5), "threshold: Input should be less than or equal to 1"),
        (dict(steps=0), "steps: Input should be greater than or equal to 1"),
    ],
)
def test_invalid_settings_are_user_errors(kw, msg):
    from pydantic import ValidationError

    from dllm_align.config.schema import GenerateSection

    with pytest.raises(UserError) as e:
        S(**kw)
    assert msg in e.value.message
    # The samplers' settings are the recipe section's: the recipe refuses the same values.
    with pytest.raises(ValidationError):
        GenerateSection(**{"gen_length": 32, "block_length": 8, "steps": 16, **kw})


def test_settings_from_recipe_section():
    from dllm_align.config.schema import GenerateSection

    st = SamplerSettings.from_section(GenerateSection())
    assert (st.gen_length, st.block_length, st.steps, st.temperature, st.cfg) == (512, 32, 512, 0.0, 0.0)
    assert st.remasking == "low_confidence" and st.exact and st.num_blocks == 16 and st.steps_per_block == 32


def test_encode_prompt_matches_training_tokenisation(tiny, shared_data):
    import json

    from dllm_align.data.rows import Row
    from dllm_align.config.schema import DataSection
    from dllm_align.data.tokenize import tokenize_rows

    lines = (shared_data / "chosen.jsonl").read_text(encoding="utf-8").splitlines()[:5]
    rows = [json.loads(x) for x in lines]
    data_rows = [Row(str(r["id"]), r["prompt"], r["completion"][0]["content"], True) for r in rows]
    examples = tokenize_rows(data_rows, tiny.tokenizer, DataSection(max_length=100_000), quiet=True)
    for r, ex in zip(rows, examples):
        assert encode_prompt(tiny.tokenizer, r["prompt"]) == ex.prompt_ids


# --------------------------------------------------------------------------- exact mode
GRID = [
    (32, 32, 32),  # one block, one token per step
    (32, 8, 16),  # four blocks, two tokens per step
    (48, 16, 12),  # n // s = 4 per step
    (16, 8, 6),  # uneven: 8 tokens in 3 steps -> 3, 3, 2
    (8, 4, 10),  # more steps than tokens: steps that commit nothing
]


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("gen_length, block_length, steps", GRID)
def test_exact_matches_straightforward_implementation(tiny, prompts, gen_length, block_length, steps, remasking):
    st = SamplerSettings(gen_length=gen_length, block_length=block_length, steps=steps, remasking=remasking, seed=7)
    seeds = [row_seed(7, i) for i in range(len(prompts))]
    got = generate_batch(tiny, prompts, st, seeds=seeds, stop_early=False)
    for p, g, sd in zip(prompts, got, seeds):
        ref = reference_generate(tiny, p, gen_length=gen_length, block_length=block_length, steps=steps, remasking=remasking, seed=sd)
        assert g.raw == ref
        assert tiny.mask_token_id not in ref  # every position decoded


@pytest.mark.parametrize("temperature, cfg, remasking", [(1.0, 0.0, "low_confidence"), (0.0, 1.5, "low_confidence"), (0.7, 0.5, "random")])
def test_exact_matches_straightforward_with_temperature_and_cfg(tiny, prompts, temperature, cfg, remasking):
    st = S(temperature=temperature, cfg=cfg, remasking=remasking, seed=3)
    seeds = [11, 22, 33]
    got = generate_batch(tiny, prompts, st, seeds=seeds, stop_early=False)
    for p, g, sd in zip(prompts, got, seeds):
        ref = reference_generate(tiny, p, gen_length=32, block_length=8, steps=16, remasking=remasking, temperature=temperature, cfg=cfg, seed=sd)
        assert g.raw == ref


def test_committed_mask_token_is_decoded_again_like_the_reference(tiny, prompts):
    # At temperature > 0 the untrained model sometimes draws the mask token itself; the
    # reference leaves that position masked and offers it again in later blocks. Seed 19
    # does that for prompts[0] (found by search; asserted below so a change shows).
    trace: list = []
    ref = reference_generate(tiny, prompts[0], gen_length=16, block_length=8, steps=8, temperature=1.0, seed=19, trace=trace)
    mask = tiny.mask_token_id
    assert mask in trace[0][:8] and mask not in ref[:8]  # left masked in block 1, decoded in block 2
    got = generate_batch(tiny, [prompts[0]], SamplerSettings(gen_length=16, block_length=8, steps=8, temperature=1.0), seeds=[19], stop_early=False)
    assert got[0].raw == ref


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, remasking="random", cfg=0.5)])
def test_batch_equals_each_prompt_alone(tiny, prompts, kw):
    st = S(**kw)
    seeds = [5, 6, 7]
    batch = generate_batch(tiny, prompts, st, seeds=seeds, stop_early=False)
    for p, sd, b in zip(prompts, seeds, batch):
        alone = generate_batch(tiny, [p], st, seeds=[sd], stop_early=False)[0]
        assert alone.raw == b.raw and alone.text == b.text
    # Length-grouped batches through generate(): input order, same tokens.
    many = generate(tiny, prompts, st, seeds=seeds, batch_size=2, stop_early=False)
    assert [m.raw for m in many] == [b.raw for b in batch]


def test_temperature_and_cfg_are_seeded(tiny, prompts):
    st = S(temperature=1.0, cfg=1.0, remasking="random", seed=1)
    a = generate_batch(tiny, prompts, st, stop_early=False)
    b = generate_batch(tiny, prompts, st, stop_early=False)
    c = generate_batch(tiny, prompts, S(temperature=1.0, cfg=1.0, remasking="random", seed=2), stop_early=False)
    assert [x.raw for x in a] == [x.raw for x in b]
    assert [x.raw for x in a] != [x.raw for x in c]
    # A prompt's tokens depend on its own seed, not on its place in the batch.
    swapped = generate_batch(tiny, prompts[::-1], st, seeds=[row_seed(1, i) for i in (2, 1, 0)], stop_early=False)
    assert [x.raw for x in swapped[::-1]] == [x.raw for x in a]


class _EotLoving(MaskPredictor):
    """The tiny model with the end-of-turn logit raised, so completions stop early."""

    def head(self, h):
        out = super().head(h)
        out[..., self.stop_token_ids[0]] += 1.0
        return out


def test_text_stops_at_end_of_turn_and_early_stop_changes_nothing(tiny, prompts):
    mp = _EotLoving(tiny.model, tiny.tokenizer)
    st = SamplerSettings(gen_length=48, block_length=8, steps=24)
    full_stats, early_stats = SamplerStats(), SamplerStats()
    full = generate_batch(mp, prompts, st, stop_early=False, stats=full_stats)
    early = generate_batch(mp, prompts, st, stop_early=True, stats=early_stats)
    assert all(f.stopped for f in full)
    for f, e in zip(full, early):
        stop = f.raw.index(next(t for t in f.raw if t in mp.stop_token_ids))
        assert f.ids == f.raw[:stop] == e.ids and f.text == e.text
        assert e.raw[: stop + 1] == f.raw[: stop + 1]
        assert f.text == mp.tokenizer.decode(f.raw[:stop], skip_special_tokens=True)
        assert f.forwards == 24 and e.forwards < 24
    assert early_stats.forwards < full_stats.forwards
    for p, f in zip(prompts, full):
        assert f.raw == reference_generate(mp, p, gen_length=48, block_length=8, steps=24)


# --------------------------------------------------------------------------- fast mode
def test_kv_forward_equals_the_model_and_reuses_keys_exactly(tiny, prompts):
    mask = tiny.mask_token_id
    P = max(len(p) for p in prompts)
    T = P + 24
    x = torch.full((3, T), 0)
    attn = torch.zeros((3, T), dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, P - len(p) : P] = torch.tensor(p)
        attn[i, P - len(p) :] = 1
    x[:, P:] = mask
    pos = tiny.position_ids(attn, x.shape, x.device)
    kvf = _KVForward(tiny.model)
    h_model = tiny.hidden(x, attn)
    h, kvs = kvf(x, pos, attn, want_kv=True)
    real = attn.bool()
    torch.testing.assert_close(h[real], h_model[real], rtol=1e-5, atol=1e-5)
    # Nothing changed since the keys were kept: the window's outputs equal the full pass.
    bs, be = P + 8, P + 16
    dual = [(torch.cat([k[:, :, :bs], k[:, :, be:]], 2), torch.cat([v[:, :, :bs], v[:, :, be:]], 2)) for k, v in kvs]
    km = torch.cat([attn[:, :bs], attn[:, be:]], 1)
    hw, _ = kvf(x[:, bs:be], pos[:, bs:be], torch.cat([km, attn[:, bs:be]], 1), past=dual)
    torch.testing.assert_close(hw, h[:, bs:be], rtol=1e-5, atol=1e-5)
    prefix = [(k[:, :, :bs], v[:, :, :bs]) for k, v in kvs]
    hp, _ = kvf(x[:, bs:], pos[:, bs:], attn, past=prefix)
    torch.testing.assert_close(hp, h[:, bs:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_with_one_step_per_block_equals_exact(tiny, prompts, cache):
    # Every commit then comes from the full pass at the block's start: nothing is stale.
    st = SamplerSettings(gen_length=32, block_length=8, steps=4)
    exact = generate_batch(tiny, prompts, st, stop_early=False)
    fast = generate_batch(tiny, prompts, SamplerSettings(**{**st.to_dict(), "cache": cache}), stop_early=False)
    assert [f.raw for f in fast] == [e.raw for e in exact]


def test_fast_settings_without_cache_or_threshold_are_exact(tiny, prompts):
    st = SamplerSettings(gen_length=32, block_length=8, steps=32, cache="none", threshold=None)
    assert st.exact
    got = generate_batch(tiny, prompts, st, stop_early=False)
    for p, g in zip(prompts, got):
        assert g.raw == reference_generate(tiny, p, gen_length=32, block_length=8, steps=32)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_positions_processed(tiny, prompts, cache):
    # Hand count for one prompt, 2 blocks of 8, 4 steps a block: the block's first step runs
    # all T positions, the other 3 run T - block_start (prefix) or the 8 block positions (dual).
    p = prompts[1]
    P, G, L = len(p), 16, 8
    T = P + G
    stats = SamplerStats()
    generate_batch(tiny, [p], SamplerSettings(gen_length=G, block_length=L, steps=8, cache=cache), stop_early=False, stats=stats)
    if cache == "prefix":
        expected = (T + 3 * (T - P)) + (T + 3 * (T - P - L))
    else:
        expected = 2 * (T + 3 * L)
    assert stats.forwards == 8 and stats.positions == expected
    exact = SamplerStats()
    generate_batch(tiny, [p], SamplerSettings(gen_length=G, block_length=L, steps=8), stop_early=False, stats=exact)
    assert exact.positions == 8 * T


def test_fast_agreement_with_exact_is_measured(tiny, prompts, capsys):
    st = SamplerSettings(gen_length=64, block_length=16, steps=64)
    exact = generate_batch(tiny, prompts, st, stop_early=False)
    n = sum(len(e.raw) for e in exact)
    agreement = {}
    for cache in ("prefix", "dual"):
        fast = generate_batch(tiny, prompts, SamplerSettings(**{**st.to_dict(), "cache": cache}), stop_early=False)
        agreement[cache] = sum(a == b for e, f in zip(exact, fast) for a, b in zip(e.raw, f.raw)) / n
        # The first step of each block comes from a full pass: the first commit always agrees.
    with capsys.disabled():
        print(f"\nfast-mode token agreement with exact (random tiny model, gen 64 / block 16 / steps 64): {agreement}")
    # Measured 0.83 (prefix) and 0.68 (dual) on this model; a broken cache lands near chance.
    assert agreement["prefix"] > 0.6 and agreement["dual"] > 0.4


def test_threshold_commits_at_least_one_and_everything_above_it(tiny, prompts):
    base = dict(gen_length=32, block_length=8, steps=32)
    # Threshold 1: no probability exceeds it, so exactly one (the best) per step = exact at 1 per step.
    s1 = SamplerStats()
    one = generate_batch(tiny, prompts, SamplerSettings(**base, threshold=1.0), stop_early=False, stats=s1)
    exact = generate_batch(tiny, prompts, SamplerSettings(**base), stop_early=False)
    assert [o.raw for o in one] == [e.raw for e in exact] and s1.forwards == 32
    # A tiny threshold: the whole block at its first step = exact with one step per block.
    s2 = SamplerStats()
    allin = generate_batch(tiny, prompts, SamplerSettings(**base, threshold=1e-9), stop_early=False, stats=s2)
    exact4 = generate_batch(tiny, prompts, SamplerSettings(**{**base, "steps": 4}), stop_early=False)
    assert [o.raw for o in allin] == [e.raw for e in exact4] and s2.forwards == 4
    # With the cache too: every block finishes, never committing the mask token.
    fast = generate_batch(tiny, prompts, SamplerSettings(**base, cache="dual", threshold=0.9), stop_early=False)
    assert all(tiny.mask_token_id not in f.raw for f in fast)


def test_models_without_cache_support_fall_back_to_exact(prompts, capsys):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    model.config.model_type = "not-llama"
    mp = MaskPredictor(model, tok)
    st = SamplerSettings(gen_length=16, block_length=8, steps=16)
    exact = generate_batch(mp, prompts[:1], st, stop_early=False)
    fast = generate_batch(mp, prompts[:1], SamplerSettings(**{**st.to_dict(), "cache": "dual"}), stop_early=False)
    assert fast[0].raw == exact[0].raw
    assert "fast mode cache is not available" in capsys.readouterr().err
