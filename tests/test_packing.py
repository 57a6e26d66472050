"""Packed rows (``data.padding: packed``): the noisy sequences of a forward share rows of max_length,
with block-diagonal bidirectional attention and positions restarting per sequence.

Tolerance: the ELBO draws are fp32 sums of O(100) over masked positions; packed
and padded rows reach them through matrices of other shapes (other summation
orders), so values are compared to 5e-5 absolute (measured ~8e-6) and
parameter gradients (entries up to ~1) to 5e-5 absolute + 1e-4 relative
(measured 3e-5 at most).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dllm_align.data.batching import collate
from dllm_align.data.batching import pack_rows, pack_sequences
from dllm_align.objective.elbo import DrawConfig, elbo_draws
from dllm_align.models.predictor import packed_attention, packed_positions
from dllm_align.data.tokenize import Example


def _examples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(3, 12, (), generator=g))
        c = int(torch.randint(2, 20, (), generator=g))
        out.append(Example(f"e{i}", torch.randint(0, 250, (p,), generator=g).tolist(),
                           torch.randint(0, 250, (c,), generator=g).tolist(), i % 2 == 0))
    return out


@pytest.fixture()
def policy(tiny):
    """The tiny model moved off its random init (std 0.02), so that gradients are not all alike."""
    mp = copy.deepcopy(tiny)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in mp.model.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.02)
    return mp


def test_packing_by_hand():
    # 5, 3, 4, 2 into rows of 8: first fit (longest first) needs 2 rows; the 14 tokens then fit rows of 7:
    # 5 opens row 0, 4 opens row 1, 3 joins row 1 (room 3), 2 joins row 0 (room 2)
    assert pack_sequences([5, 3, 4, 2], 8) == [[0, 3], [2, 1]]
    assert pack_sequences([8, 8, 1], 8) == [[0], [1], [2]]
    assert pack_sequences([9, 1], 8) == [[0], [1]]  # too long for a row: a row of its own
    # 5, 3, 4: two rows; rows of 6 would need three, rows of 7 hold [5] and [4, 3]
    assert pack_sequences([5, 3, 4], 8) == [[0], [2, 1]]
    p = pack_rows(torch.arange(40).view(4, 10), [5, 3, 4, 2], 8)
    assert p.input_ids.tolist() == [[0, 1, 2, 3, 4, 30, 31], [20, 21, 22, 23, 10, 11, 12]]
    assert p.layout.tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1]]
    assert p.row_of.tolist() == [0, 1, 1, 0] and p.offset.tolist() == [0, 4, 0, 5]
    assert packed_positions(p.layout).tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 1, 2]]
    q = pack_rows(torch.arange(30).view(3, 10), [5, 3, 4], 8)
    assert q.input_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0], [20, 21, 22, 23, 10, 11, 12]]
    assert q.layout.tolist() == [[0, 0, 0, 0, 0, -1, -1], [0, 0, 0, 0, 1, 1, 1]]  # the tail: its own block
    assert packed_positions(q.layout).tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 1, 2]]


def test_block_diagonal_masks_by_hand():
    layout = torch.tensor([[0, 0, 1, -1]])
    m, extra = packed_attention(layout, "sdpa", torch.float32)
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert m.shape == (1, 1, 4, 4) and torch.equal(m[0, 0], want) and extra == {}
    e, _ = packed_attention(layout, "eager", torch.float32)
    assert torch.equal(e[0, 0] == 0, want) and float(e.min()) == torch.finfo(torch.float32).min
    f, extra = packed_attention(layout, "flash_attention_2", torch.bfloat16)
    assert f is None and extra["is_causal"] is False  # the varlen kernel, told every sequence start
    assert extra["cu_seq_lens_q"].tolist() == [0, 2, 3, 4] and extra["max_length_q"] == 2
    # two rows flatten into one stream: a sequence never spans rows, the tail is its own run
    _, two = packed_attention(torch.tensor([[0, 0, 0, 1], [0, 1, 1, -1]]), "flash_attention_2", torch.bfloat16)
    assert two["cu_seq_lens_q"].tolist() == two["cu_seq_lens_k"].tolist() == [0, 3, 4, 5, 7, 8]
    assert two["cu_seq_lens_q"].dtype == torch.int32 and two["max_length_q"] == two["max_length_k"] == 3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_values_and_gradients_equal_padded(policy, impl):
    mp = policy
    mp.model.config._attn_implementation = impl
    exs = _examples()
    b = collate(exs, "none", 64, mp.tokenizer.pad_token_id)
    cfg = DrawConfig(n_mc=4, seed=3)
    params = list(mp.model.parameters())
    args = (b["input_ids"], b["attention_mask"], b["completion_mask"], b["ids"], cfg)
    padded = elbo_draws(mp, *args)
    g_padded = torch.autograd.grad(padded.sum(), params)
    packed = elbo_draws(mp, *args, pack_length=64)
    g_packed = torch.autograd.grad(packed.sum(), params)
    torch.testing.assert_close(packed, padded, atol=5e-5, rtol=0)  # per draw
    for a, c in zip(g_packed, g_padded):
        torch.testing.assert_close(a, c, atol=5e-5, rtol=1e-4)
    # the packing really shares rows: 24 noisy sequences of 5..31 tokens fit in fewer than 24 rows of 64
    lengths = b["attention_mask"].sum(1).repeat_interleave(4).tolist()
    assert len(pack_sequences(lengths, 64)) < 12
    # and chunked forwards (train.rows_per_forward) pack each chunk on its own, to the same values
    torch.testing.assert_close(elbo_draws(mp, *args, max_rows_per_forward=5, pack_length=64).detach(), padded.detach(),
                               atol=5e-5, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_no_token_attends_across_sequences(policy, impl):
    """Changing every token of one packed sequence leaves the others' log-probabilities as they were."""
    mp = policy
    mp.model.config._attn_implementation = impl
    ids = torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(4))
    layout = torch.tensor([[0] * 10 + [1] * 12 + [2] * 5 + [-1] * 3])
    other = ids.clone()
    other[0, 10:22] = (other[0, 10:22] + 7) % 250
    rows = torch.zeros(15, dtype=torch.long)
    cols = torch.tensor(list(range(10)) + list(range(22, 27)))
    tg = ids[0, cols]
    with torch.no_grad():  # FlexAttention has no CPU backward
        a = mp.target_logprobs(ids, None, rows, cols, tg, packed=layout)
        b = mp.target_logprobs(other, None, rows, cols, tg, packed=layout)
        # and each sequence scores as it does alone (positions restart at 0)
        alone = mp.target_logprobs(ids[:, 22:27], None, torch.zeros(5, dtype=torch.long), torch.arange(5), tg[10:])
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(a[10:], alone, atol=1e-5, rtol=0)
    # the test has teeth: without the layout the change does reach them
    with torch.no_grad():
        c = mp.target_logprobs(ids, None, rows, cols, tg)
        d = mp.target_logprobs(other, None, rows, cols, tg)
    assert float((c - d).abs().max()) > 1e-4


def test_training_packed_equals_padded(tmp_path):
    """One recipe trained with padding none and packed (online reference): same losses, baselines, parameters."""
    from fixtures.sort_toy import write_pairs
    from test_training import assert_same_params, final_params, metrics

    from dllm_align.config.recipe import load_recipe
    from dllm_align.training.train import train

    data = write_pairs(tmp_path / "pairs.jsonl", n=8)
    runs = {}
    for padding in ("none", "packed"):
        rec = load_recipe(None, [
            f"data.train={data}", "data.format=paired", "data.max_length=64", f"data.padding={padding}",
            "reference.n_mc=4", "reference.mode=online", "train.lr=1e-3", "train.warmup_ratio=0",
            "train.scheduler=constant", "train.batch_size=4", "train.max_steps=2",
        ], output_dir=str(tmp_path / padding))
        train(rec)
        runs[padding] = (metrics(rec.output_dir), final_params(rec.output_dir))
    (ma, pa), (mb, pb) = runs["none"], runs["packed"]
    assert ma[0]["loss"] == pytest.approx(0.5, abs=1e-5)  # margins are zero before the first update
    for x, y in zip(ma, mb):
        for key in ("loss", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4), key
        assert y["baseline"] == pytest.approx(x["baseline"], abs=1e-4)
    assert_same_params(pa, pb, atol=1e-5)


# --------------------------------------------------------------------------- every backend, every R
def _fake_flash_kernels():
    """CPU stand-ins for flash_attn's dense and variable-length kernels (exact attention through SDPA).

    Same call signatures as flash-attn 2 (transformers reads the varlen one's parameters to decide which
    keyword arguments it passes); inputs are [B, T, H, D] (dense) and [total, H, D] (varlen).
    """
    import torch.nn.functional as F

    def attend(q, k, v, scale, causal):  # [H, T, D]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        calls["dense"] += 1
        return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal).transpose(1, 2)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        calls["varlen"] += 1
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and int(cu_seqlens_q[-1]) == q.shape[0]
        assert int(max_seqlen_q) == int(cu_seqlens_q.diff().max())
        out = torch.empty_like(q)
        bounds = cu_seqlens_q.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            out[s:e] = attend(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                              softmax_scale, causal).transpose(0, 1)
        return out

    calls = {"dense": 0, "varlen": 0}
    return flash_attn_func, flash_attn_varlen_func, calls


@pytest.fixture()
def fake_flash(monkeypatch):
    """Patch the stand-in kernels into transformers' own flash dispatch (``_lazy_imports``)."""
    import inspect
    import re

    from transformers import modeling_flash_attention_utils as fa

    dense, varlen, calls = _fake_flash_kernels()
    # what the dispatch unpacks: (dense, varlen, [with_kvcache,] pad, unpad); the kvcache entry came with 5.2x
    names = re.search(r"([\w, ]+)= _lazy_imports\(", inspect.getsource(fa.lazy_import_flash_attention)).group(1)
    fns = (dense, varlen, None) if "kvcache" in names else (dense, varlen)
    monkeypatch.setattr(fa, "_lazy_imports", lambda *a, **k: (*fns, fa._pad_input, fa._unpad_input))
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    yield calls


def _sequences(seed=5):
    g = torch.Generator().manual_seed(seed)
    lengths = [23, 17, 30, 9, 14, 26, 11]
    return [torch.randint(0, 250, (L,), generator=g) for L in lengths]


@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("impl", ["flash_attention_2", "sdpa", "eager", "flex_attention"])
def test_every_backend_attends_within_sequences_for_every_row_count(policy, fake_flash, impl, R):
    """Seven sequences packed into R rows: every token's log-probability equals the sequence's own
    (scored alone, sdpa, no packing), under every backend, and changing every other sequence of the
    batch (same row or not) changes nothing. transformers 5.23 infers flash's sequence starts from
    restarting positions only for a single row, so R >= 2 needs the layout passed explicitly."""
    mp = policy
    seqs = _sequences()
    lengths = [len(s) for s in seqs]
    cap = {1: sum(lengths), 2: -(-sum(lengths) // 2) + 6, 3: 50}[R]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    p = pack_rows(ids, lengths, cap)
    assert p.input_ids.shape[0] == R
    rows = torch.cat([torch.full((L,), int(p.row_of[i])) for i, L in enumerate(lengths)])
    cols = torch.cat([int(p.offset[i]) + torch.arange(L) for i, L in enumerate(lengths)])
    tg = torch.cat(seqs)
    mp.model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        alone = torch.cat([mp.target_logprobs(s[None], None, torch.zeros(len(s), dtype=torch.long), torch.arange(len(s)),
                                              s) for s in seqs])
    mp.model.config._attn_implementation = impl
    with torch.no_grad():  # FlexAttention has no CPU backward
        packed = mp.target_logprobs(p.input_ids, None, rows, cols, tg, packed=p.layout)
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=0)
    # every other sequence replaced: sequence 0's tokens score as before
    other = (p.input_ids + 11) % 250
    r0, o0, L0 = int(p.row_of[0]), int(p.offset[0]), lengths[0]
    other[r0, o0:o0 + L0] = p.input_ids[r0, o0:o0 + L0]
    with torch.no_grad():
        moved = mp.target_logprobs(other, None, rows[:L0], cols[:L0], tg[:L0], packed=p.layout)
    torch.testing.assert_close(moved, packed[:L0], atol=2e-5, rtol=0)
    if impl.startswith("flash"):
        assert fake_flash["varlen"] > 0 and fake_flash["dense"] == 0  # the layout went to the varlen kernel


def test_shifted_family_clamps_at_its_own_sequence_when_packed():
    """Dream scores position j from the output at j - 1, clamped at the sequence's first position. A packed
    sequence whose completion starts at its first column (empty prompt) must clamp there, not read the
    last output of the sequence before it in the row: its values equal the unpacked ones."""
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-dream")
    assert mp.family.logit_shift == 1
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(0, 250, (9,), generator=g), torch.randint(0, 250, (7,), generator=g)
    ids = torch.cat([a, b])[None]
    layout = torch.tensor([[0] * 9 + [1] * 7])
    rows = torch.zeros(7, dtype=torch.long)
    with torch.no_grad():
        packed = mp.target_logprobs(ids, None, rows, torch.arange(9, 16), b, packed=layout)
        alone = mp.target_logprobs(b[None], None, rows, torch.arange(7), b)
        other = ids.clone()
        other[0, :9] = (other[0, :9] + 5) % 250
        moved = mp.target_logprobs(other, None, rows, torch.arange(9, 16), b, packed=layout)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(moved, packed, atol=1e-6, rtol=0)


@pytest.mark.parametrize("T", [128, 300, 517])
def test_flex_block_mask_from_offsets_equals_the_evaluated_mask(T):
    """The block mask built from sequence ranges (no [R, 1, T, T] evaluation) lists the same blocks, and the
    same full blocks, as torch's create_block_mask evaluating the same-sequence test everywhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dllm_align.models.predictor import flex_block_mask

    g = torch.Generator().manual_seed(T)
    layout = torch.full((3, T), -1, dtype=torch.long)
    for r in range(3):
        o, j = 0, 0
        while True:
            L = int(torch.randint(5, 200, (), generator=g))
            if o + L > T - 3 * r:
                break
            layout[r, o:o + L] = j
            o, j = o + L, j + 1
    ours = flex_block_mask(layout)

    def same(b, h, q, kv):
        return layout[b, q] == layout[b, kv]

    ref = create_block_mask(same, 3, None, T, T, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    n = ours.kv_num_blocks
    for b in range(3):
        for q in range(n.shape[-1]):
            k = int(n[b, 0, q])
            assert sorted(ours.kv_indices[b, 0, q, :k].tolist()) == sorted(ref.kv_indices[b, 0, q, :k].tolist())


def test_flex_attention_over_several_blocks_scores_each_sequence_alone(policy):
    """Packed rows wider than one 128-token block under FlexAttention: every sequence as alone (sdpa)."""
    mp = policy
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, 250, (L,), generator=g) for L in (150, 90, 120, 60, 170)]
    lengths = [len(s) for s in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    p = pack_rows(ids, lengths, 320)
    assert p.input_ids.shape[0] == 2 and p.input_ids.shape[1] > 256
    rows = torch.cat([torch.full((L,), int(p.row_of[i])) for i, L in enumerate(lengths)])
    cols = torch.cat([int(p.offset[i]) + torch.arange(L) for i, L in enumerate(lengths)])
    tg = torch.cat(seqs)
    mp.model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        alone = torch.cat([mp.target_logprobs(s[None], None, torch.zeros(len(s), dtype=torch.long), torch.arange(len(s)), s)
                           for s in seqs])
        mp.model.config._attn_implementation = "flex_attention"
        packed = mp.target_logprobs(p.input_ids, None, rows, cols, tg, packed=p.layout)
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=0)


def test_flex_packed_widths_are_rounded_to_whole_blocks(policy):
    """Under flex the body sees packed widths rounded up to 128 (shapes recur for the compiled kernels);
    the values are those of the unrounded rows, and hidden() still returns the caller's width."""
    mp = policy
    seen = []
    hook = mp.model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    ids = torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(4))
    layout = torch.tensor([[0] * 10 + [1] * 12 + [2] * 5 + [-1] * 3])
    try:
        mp.model.config._attn_implementation = "flex_attention"
        with torch.no_grad():
            h = mp.hidden(ids, None, layout)
        mp.model.config._attn_implementation = "sdpa"
        with torch.no_grad():
            ref = mp.hidden(ids, None, layout)
    finally:
        hook.remove()
    assert seen == [128, 30] and h.shape[1] == 30
    keep = layout[0] >= 0
    torch.testing.assert_close(h[0, keep], ref[0, keep], atol=2e-5, rtol=0)
