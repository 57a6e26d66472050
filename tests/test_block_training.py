"""Block diffusion through the commands' own paths: the ELBO every command computes (``elbo_draws``) for a
block family equals the published 2L form draw by draw (values and gradients, padded or not, any split of
the draws over forward calls); its Monte Carlo mean meets the exact block ELBO by enumeration (and a
bidirectional mask does not); the step-0 invariant holds in fp32 and bf16, cached and online, with LoRA.
"""

from __future__ import annotations

import math

import pytest
import torch

from dllm_align.objective.block import draw_terms_2l, exact_block_elbo, hf_forward
from dllm_align.objective.elbo import DrawConfig, elbo_draws, make_noisy_batch

SEQS = [  # (prompt, completion) token ids of the byte-level tokenizer
    ([60, 61, 62, 63, 64], [70, 71, 72, 73, 74, 75, 76]),
    ([60, 61, 62], [80, 81, 82, 83, 84, 85, 86, 87, 88, 89]),
    ([65, 66, 67, 68, 69, 70, 71], [90, 91]),
]


def sharp_sdar(std=0.5, seed=0):
    """builtin:tiny-sdar with weights large enough that every position matters."""
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-sdar")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mp.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return mp


def batch(padded: bool, seqs=SEQS):
    T = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), T), 0, dtype=torch.long)
    am = torch.zeros(len(seqs), T, dtype=torch.long)
    cm = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[b, :n] = torch.tensor(p + c)
        am[b, :n] = 1
        cm[b, len(p):n] = True
    if not padded:  # every row alone at its own length is checked by the reference below
        return ids, None, cm
    return ids, am, cm


def reference_draws(mp, ids, am, cm, cfg):
    """The straightforward form: each draw of each row, unpadded, as its own 2L row."""
    nb = make_noisy_batch(ids, am, cm, [f"r{b}" for b in range(len(SEQS))], cfg, mp.mask_token_id)
    fwd = hf_forward(mp.model)
    out = torch.zeros(nb.B, nb.K)
    for b in range(nb.B):
        n = int(am[b].sum()) if am is not None else ids.shape[1]
        for k in range(nb.K):
            r = b * nb.K + k
            xt = nb.input_ids[r, :n]
            masked = xt == mp.mask_token_id
            term = draw_terms_2l(fwd, ids[b, :n], xt[None], masked[None], torch.ones(1), mp.block_size)
            out[b, k] = term[0] * nb.weight[r].float()
    return out


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("rows_per_forward", [None, 1, 5])
def test_block_elbo_draws_equal_the_2l_form_values_and_gradients(padded, rows_per_forward):
    mp = sharp_sdar()
    ids, am, cm = batch(padded)
    names = [f"r{b}" for b in range(len(SEQS))]
    cfg = DrawConfig(n_mc=4, seed=3)
    mp.model.zero_grad()
    got = elbo_draws(mp, ids, am, cm, names, cfg, max_rows_per_forward=rows_per_forward)
    got.sum().backward()
    g_got = [p.grad.clone() for p in mp.model.parameters()]
    mp.model.zero_grad()
    want = reference_draws(mp, ids, am, cm, cfg)
    want.sum().backward()
    g_want = [p.grad.clone() for p in mp.model.parameters()]
    assert got.shape == (3, 4)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got, want)
    worst = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(g_got, g_want))
    assert worst < 1e-4, worst
    # not vacuous: the whole-sequence (bidirectional) reading of the same draws differs
    wrong = elbo_draws(type("NoBlocks", (), {"likelihood": "masked", "mask_token_id": mp.mask_token_id,
                                             "target_logprobs": mp.target_logprobs})(), ids, am, cm, names, cfg)
    assert (wrong - got).abs().max() > 0.1


def test_block_elbo_padding_never_changes_a_row():
    mp = sharp_sdar()
    cfg = DrawConfig(n_mc=3, seed=1)
    ids, am, cm = batch(True)
    names = [f"r{b}" for b in range(len(SEQS))]
    with torch.no_grad():
        together = elbo_draws(mp, ids, am, cm, names, cfg)
        for b in range(len(SEQS)):
            n = int(am[b].sum())
            alone = elbo_draws(mp, ids[b:b + 1, :n], None, cm[b:b + 1, :n], names[b:b + 1], cfg)
            assert torch.allclose(alone[0], together[b], atol=1e-5), b


@pytest.mark.parametrize("estimator", ["l", "t"])
def test_block_elbo_monte_carlo_mean_meets_the_exact_value(estimator):
    """One row, 6 completion tokens over two blocks of 4 (prompt 3 tokens): the exact block ELBO by enumerating
    all 63 masks (t uniform on (0, 1]), against the mean of 3,000 draws; the bidirectional mask's exact value is
    far outside."""
    mp = sharp_sdar(std=1.0)
    prompt, comp = [60, 61, 62], [70, 71, 72, 73, 74, 75]
    ids = torch.tensor([prompt + comp])
    cm = torch.tensor([[False] * 3 + [True] * 6])
    with torch.no_grad():
        draws = torch.cat([elbo_draws(mp, ids, None, cm, ["x"], DrawConfig(n_mc=500, seed=s, estimator=estimator))[0]
                           for s in range(6)])
        fwd = hf_forward(mp.model)
        exact = exact_block_elbo(fwd, ids[0], cm[0], mp.mask_token_id, mp.block_size)
        wrong = exact_block_elbo(fwd, ids[0], cm[0], mp.mask_token_id, mp.block_size, bidirectional=True)
    mean, se = float(draws.mean()), float(draws.std() / math.sqrt(draws.numel()))
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    assert abs(mean - wrong) > 4 * se, (mean, wrong, se)  # the wrong mask's value is rejected by the same test


@pytest.fixture(scope="module")
def sdar_toy(tmp_path_factory):
    from fixtures.sort_toy import write_pairs

    root = tmp_path_factory.mktemp("sdar-inv")
    return {"root": root, "data": write_pairs(root / "pairs.jsonl", n=16), "caches": {}}


def _block_recipe(toy, model, mp, *sets):
    from dllm_align.config.recipe import load_recipe

    return load_recipe(None, [
        f"model.name_or_path={model}", f"data.train={toy['data']}", "data.format=paired", "data.max_length=160",
        "reference.n_mc=4", "reference.shard_size=8", "reference.batch_size=16",
        f"reference.cache={toy['root'] / ('cache-' + model.split(':')[-1] + '-' + mp)}", f"train.mixed_precision={mp}",
        "train.batch_size=4", "train.lr=1e-3", "train.warmup_ratio=0", *sets], output_dir=str(toy["root"] / "run"))


@pytest.mark.parametrize("mp", ["no", "bf16"])
@pytest.mark.parametrize("mode", ["cached", "online"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("model,block", [("builtin:tiny-sdar", 4), ("builtin:tiny-llada2", 8)])
def test_step0_margins_are_zero_for_a_block_family(sdar_toy, fresh_accelerate, model, block, mp, mode, lora):
    """Policy = reference before the first update: every margin exactly 0 (CPU; the cache made in batches of
    16, training in micro-batches of 4, each row's streams computed alone), SDAR's dense body and LLaDA2.0's MoE."""
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.models.load import BUILTIN_SPECS, build_tiny_tokenizer
    from dllm_align.training import reference as ref
    from dllm_align.training.loop import invariant_margins
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator

    tok = build_tiny_tokenizer(BUILTIN_SPECS[model].family)
    if (model, mp) not in sdar_toy["caches"]:
        rec = _block_recipe(sdar_toy, model, mp)
        exs = load_training_examples(rec, tok, quiet=True)
        ref.precompute(rec, exs, make_collate(rec, tok), None, None)
        sdar_toy["caches"][model, mp] = exs
    sets = [f"reference.mode={mode}"] + (["train.lora.enabled=true", "train.lora.r=4"] if lora else [])
    if lora and "llada2" in model:
        sets.append("train.lora.target_modules=[query_key_value,dense]")
    rec = _block_recipe(sdar_toy, model, mp, *sets)
    run = setup_run(rec, make_accelerator(rec), None, sdar_toy["caches"][model, mp])
    assert run.mp.block_size == block
    margins = invariant_margins(run, steps=3)
    assert len(margins) == 12
    assert max(abs(v) for v in margins.values()) == 0.0


UNEVEN = SEQS + [([60, 61], [92, 93, 94]), ([62, 63, 64], [95, 96]), ([61], [97, 98, 99, 100])]


@pytest.mark.parametrize("pack_length,rows_per_forward", [(16, None), (24, None), (16, 4)])
def test_packed_block_rows_equal_padded_values_and_gradients(pack_length, rows_per_forward):
    """`padding: packed` for a block family: several sequences per packed row, every stream of the row holding
    them at the same columns, none seeing another; the draws and gradients equal the padded layout's, and the
    body sees fewer tokens."""
    mp = sharp_sdar()
    ids, am, cm = batch(True, UNEVEN)
    names = [f"r{b}" for b in range(len(UNEVEN))]
    cfg = DrawConfig(n_mc=3, seed=2)
    widths = []
    real = mp.target_logprobs

    def spy(input_ids, *a, **kw):
        widths.append(input_ids.numel())
        return real(input_ids, *a, **kw)

    mp.model.zero_grad()
    want = elbo_draws(mp, ids, am, cm, names, cfg)
    want.sum().backward()
    g_want = [p.grad.clone() for p in mp.model.parameters()]
    mp.model.zero_grad()
    mp.target_logprobs = spy
    got = elbo_draws(mp, ids, am, cm, names, cfg, max_rows_per_forward=rows_per_forward, pack_length=pack_length)
    got.sum().backward()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got, want)
    worst = max(float((p.grad - g).abs().max() / (g.abs().max() + 1e-12)) for p, g in zip(mp.model.parameters(), g_want))
    assert worst < 1e-4, worst
    if rows_per_forward is None:  # (a small budget recomputes the clean streams per call: more tokens)
        assert sum(widths) < 0.75 * ids.numel() * (cfg.n_mc + 1)  # 6 rows of 13 padded: 312 tokens of body


@pytest.mark.parametrize("padding", ["none", "packed"])
@pytest.mark.parametrize("mp", ["no", "bf16"])
def test_step0_margins_are_zero_for_a_block_family_on_real_rows(shared_data, tmp_path, fresh_accelerate, mp, padding):
    """16 real kto-mix rows of 150-520 tokens (about 40-130 blocks of 4) on builtin:small-sdar: the cache made in
    batches of 16, training in micro-batches of 4, every step-0 margin exactly 0."""
    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.models.load import build_tiny_tokenizer
    from dllm_align.training import reference as ref
    from dllm_align.training.loop import invariant_margins
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator

    from fixtures.real_rows import write_real_rows

    data = write_real_rows(shared_data, tmp_path / "real.jsonl")
    rec = load_recipe(None, [
        f"data.train={data}", "data.format=unpaired", "data.max_length=720", f"data.padding={padding}",
        "model.name_or_path=builtin:small-sdar", "reference.n_mc=2", "reference.batch_size=16", "reference.shard_size=8",
        f"reference.cache={tmp_path / 'cache'}", f"train.mixed_precision={mp}", "train.batch_size=4", "train.lr=1e-3",
    ], output_dir=str(tmp_path / "run"))
    tok = build_tiny_tokenizer("sdar")
    exs = load_training_examples(rec, tok, quiet=True)
    assert min(ex.length for ex in exs) >= 150
    ref.precompute(rec, exs, make_collate(rec, tok), None, None)
    run = setup_run(rec, make_accelerator(rec), None, exs)
    margins = invariant_margins(run, steps=2)
    assert len(margins) == 8 and max(abs(v) for v in margins.values()) == 0.0


@pytest.mark.parametrize("impl", ["eager", "flex_attention"])
def test_every_streams_kernel_gives_the_same_draws(impl):
    """The streams layout under a dense eager mask and under FlexAttention's BlockMask equals the per-stream SDPA
    (forward; FlexAttention has no CPU backward, so its gradients are a CUDA check), padded rows included."""
    from dllm_align.models.block_attention import VARIANTS, use_streams_attention

    mp = sharp_sdar()
    ids, am, cm = batch(True)
    names = [f"r{b}" for b in range(len(SEQS))]
    cfg = DrawConfig(n_mc=3, seed=4)
    want = elbo_draws(mp, ids, am, cm, names, cfg)
    want.sum().backward()
    g_want = [p.grad.clone() for p in mp.model.parameters()]
    mp.model.zero_grad()
    use_streams_attention(mp.model, impl)
    assert mp.model.config._attn_implementation == VARIANTS[impl]
    if impl == "flex_attention":
        with torch.no_grad():
            got = elbo_draws(mp, ids, am, cm, names, cfg)
    else:
        got = elbo_draws(mp, ids, am, cm, names, cfg)
        got.sum().backward()
        worst = max(float((p.grad - g).abs().max() / (g.abs().max() + 1e-12)) for p, g in zip(mp.model.parameters(), g_want))
        assert worst < 1e-4, worst
    assert torch.allclose(got, want.detach(), atol=1e-4, rtol=1e-5), (got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA; this machine has none")
def test_flex_streams_gradients_equal_sdpa_streams_on_cuda():
    from dllm_align.models.block_attention import use_streams_attention

    mp = sharp_sdar()
    mp.model.to("cuda")
    ids, am, cm = (None if x is None else x.cuda() for x in batch(True))
    names = [f"r{b}" for b in range(len(SEQS))]
    cfg = DrawConfig(n_mc=3, seed=4)
    grads = []
    for impl in ("sdpa", "flex_attention"):
        use_streams_attention(mp.model, impl)
        mp.model.zero_grad()
        v = elbo_draws(mp, ids, am, cm, names, cfg)
        v.sum().backward()
        grads.append((v.detach(), [p.grad.clone() for p in mp.model.parameters()]))
    (a, ga), (b, gb) = grads
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)
    assert max(float((x - y).abs().max() / (x.abs().max() + 1e-12)) for x, y in zip(ga, gb)) < 1e-3


# --------------------------------------------------------------------------- the published layout (filled rows)
FILLED = [(p, c + [257] * (-(len(p) + len(c)) % 4)) for p, c in UNEVEN]  # each row filled to whole blocks of 4


def test_filled_rows_count_blocks_from_each_sequence_start_under_left_padding_and_packing():
    """Rows in the published layout (a whole number of blocks each) give the values they give alone, unpadded,
    whether the batch is left-padded (blocks counted from the first real token, not from column 0) or packed (from
    each sequence's own start); counting blocks from the batch's column 0 instead would change them."""
    mp = sharp_sdar()
    names = [f"r{b}" for b in range(len(FILLED))]
    cfg = DrawConfig(n_mc=3, seed=4)
    T = max(len(p) + len(c) for p, c in FILLED)
    left = torch.zeros(len(FILLED), T, dtype=torch.long)
    am = torch.zeros_like(left)
    cm = torch.zeros(len(FILLED), T, dtype=torch.bool)
    for b, (p, c) in enumerate(FILLED):
        n = len(p) + len(c)
        assert n % 4 == 0
        left[b, T - n:] = torch.tensor(p + c)
        am[b, T - n:] = 1
        cm[b, T - n + len(p):] = True
    ids_r, am_r, cm_r = batch(True, FILLED)
    with torch.no_grad():
        alone = torch.stack([elbo_draws(mp, ids_r[b:b + 1, :len(p) + len(c)], None, cm_r[b:b + 1, :len(p) + len(c)],
                                        names[b:b + 1], cfg)[0] for b, (p, c) in enumerate(FILLED)])
        padded_left = elbo_draws(mp, left, am, cm, names, cfg)
        packed = elbo_draws(mp, ids_r, am_r, cm_r, names, cfg, pack_length=24)
        # not vacuous: the same left-padded rows with blocks counted from column 0 (positions ignoring the padding)
        shifted = elbo_draws(mp, left, None, cm, names, cfg)
    assert torch.allclose(padded_left, alone, atol=1e-5), (padded_left - alone).abs().max()
    assert torch.allclose(packed, alone, atol=1e-4), (packed - alone).abs().max()
    assert (shifted - alone).abs().max() > 1e-3


def test_rewards_under_the_default_scoring_equal_the_published_trainers_exactly():
    """The published trainers (SDAR's LlamaFactory fork, dllm's BD3LM) score reply + `<|im_end|>\\n` + pad filler to
    whole blocks; with the default ``data.block_scoring`` dllm-align tokenises exactly that layout and scores exactly
    those positions, so the implicit rewards beta (ELBO_policy - ELBO_ref), each by exact enumeration of the masks
    with t on [1e-3, 1), are equal on every row. ``completion_only`` scores another layout and gives other rewards."""
    from dllm_align.config.schema import DataSection
    from dllm_align.data.examples import block_layout_for
    from dllm_align.data.rows import Row
    from dllm_align.data.tokenize import tokenize_rows
    from test_tokenize import published_sdar_layout

    policy, reference = sharp_sdar(seed=0), sharp_sdar(seed=1)
    tok, b, beta = policy.tokenizer, policy.block_size, 0.1
    user = [{"role": "user", "content": "s"}]
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen's, no system turn
    replies = ["1", "12", "3 1", "21"]
    rows = [Row(f"r{i}", user, r, True) for i, r in enumerate(replies)]

    def reward(ids, scored):
        x0, m = torch.tensor(ids), torch.tensor(scored)
        with torch.no_grad():
            e = [exact_block_elbo(hf_forward(mp.model), x0, m, mp.mask_token_id, b, eps=1e-3) for mp in (policy, reference)]
        return beta * (e[0] - e[1])

    data = DataSection(max_length=64)
    assert data.block_scoring == "published"
    ours = tokenize_rows(rows, tok, data, block=block_layout_for(data, tok, b))
    only = tokenize_rows(rows, tok, DataSection(max_length=64, block_scoring="completion_only", end_of_turn="none"),
                         block=block_layout_for(DataSection(block_scoring="completion_only"), tok, b))
    diffs = []
    for ex, co, reply in zip(ours, only, replies):
        ids, labels = published_sdar_layout(tok, user, reply, b)
        published = reward(ids, [lab != -100 for lab in labels])
        got = reward(ex.prompt_ids + ex.completion_ids, [False] * len(ex.prompt_ids) + [True] * len(ex.completion_ids))
        assert got == published, (reply, got, published)
        diffs.append(abs(reward(co.prompt_ids + co.completion_ids,
                                [False] * len(co.prompt_ids) + [True] * len(co.completion_ids)) - published))
    assert max(diffs) > 1e-3, diffs
