"""Block diffusion: the published 2L training mask, the shared clean stream (values and gradients equal to the
2L-per-draw form), and the Monte Carlo block ELBO against exact enumeration (a full bidirectional mask falls outside)."""

import math

import pytest
import torch

from dllm_align.objective.block import (
    block_of,
    draw_terms_2l,
    draw_terms_shared,
    draw_t,
    exact_block_elbo,
    mask_weight,
    hf_forward,
    hf_streams_forward,
    noise,
    streams_mask,
)

MASK_ID = 31


def tiny_body(attn="eager", seed=0, std=0.3):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    cfg._attn_implementation = attn
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random weights large enough that every position matters
        for p in model.parameters():
            p.normal_(0, std)
    return model


def test_blocks_count_from_the_sequence_start():
    assert block_of(torch.arange(9), 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]


def test_mask_weight_is_the_beta_function_and_integrates_the_floor():
    # eps = 0: B(n, N-n+1)
    assert mask_weight(2, 5) == pytest.approx(math.factorial(1) * math.factorial(3) / math.factorial(5))
    # eps > 0: against a fine numerical integral of t^(n-1) (1-t)^(N-n) over [eps, 1), divided by 1 - eps
    eps, n, N = 0.2, 2, 5
    t = torch.linspace(eps, 1, 200001, dtype=torch.float64)
    numeric = float(torch.trapezoid(t ** (n - 1) * (1 - t) ** (N - n), t)) / (1 - eps)
    assert mask_weight(n, N, eps) == pytest.approx(numeric, rel=1e-8)


def test_2l_mask_matches_the_published_three_parts():
    # L = 4, block 2: x_t rows 0-3, x_0 rows 4-7, written out by hand from the three rules.
    want = [
        # x_t block 0: own block only
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        # x_t block 1: own block + x_0 block 0
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],
        # x_0: block-causal
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    assert streams_mask(4, 2).int().tolist() == want


def test_shared_mask_never_lets_noisy_streams_see_each_other():
    m = streams_mask(4, 2, draws=3)
    for a in range(3):
        for b in range(3):
            if a != b:
                assert not m[a * 4:(a + 1) * 4, b * 4:(b + 1) * 4].any()
    # the clean stream never attends to any noisy stream
    assert not m[12:, :12].any()
    # each noisy stream sees exactly what the 2L mask gives it
    two = streams_mask(4, 2)
    for a in range(3):
        assert torch.equal(m[a * 4:(a + 1) * 4, a * 4:(a + 1) * 4], two[:4, :4])
        assert torch.equal(m[a * 4:(a + 1) * 4, 12:], two[:4, 4:])


@pytest.mark.parametrize("attn,streams", [("eager", False), ("sdpa", False), ("sdpa", True)])
def test_shared_clean_stream_equals_2l_form_values_and_gradients(attn, streams):
    """Shared stream under the dense (K+1)L mask, and under the stream-by-stream attention the benchmark times."""
    model = tiny_body(attn)
    fwd = hf_forward(model)
    g = torch.Generator().manual_seed(1)
    length, block, k = 12, 4, 4
    shared_fwd = hf_streams_forward(model, k, length, block) if streams else fwd
    x0 = torch.randint(0, 30, (length,), generator=g)
    maskable = torch.arange(length) >= 4  # prompt block 0 clean
    t = torch.rand(k, generator=g).clamp_min(0.2)
    xt, masked = noise(x0[None].expand(k, -1), maskable[None].expand(k, -1), t, MASK_ID, g)
    assert masked.any()

    model.zero_grad()
    a = draw_terms_2l(fwd, x0, xt, masked, t, block)
    a.sum().backward()
    ga = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    b = draw_terms_shared(shared_fwd, x0, xt, masked, t, block)
    b.sum().backward()
    gb = [p.grad.clone() for p in model.parameters()]
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a, b)
    worst = max(float((x - y).abs().max() / (x.abs().max() + 1e-12)) for x, y in zip(ga, gb))
    assert worst < 1e-4, worst
    if streams:  # the model stays on the streams attention, which is plain SDPA when no streams layout is passed
        assert model.config._attn_implementation == "dllm_block_sdpa"
        with torch.no_grad():
            assert torch.allclose(draw_terms_2l(fwd, x0, xt, masked, t, block), a.detach(), atol=1e-6)
    # and the equality is not vacuous: a different draw gives a different value
    assert not torch.allclose(a, draw_terms_2l(fwd, x0, xt.flip(0), masked.flip(0), t, block))


def test_monte_carlo_block_elbo_matches_exact_enumeration_and_a_wrong_mask_does_not():
    model = tiny_body(std=1.0)  # sharp enough that what a position may attend to shows in its likelihood
    fwd = hf_forward(model)
    g = torch.Generator().manual_seed(3)
    length, block = 8, 2
    x0 = torch.randint(0, 30, (length,), generator=g)
    maskable = torch.arange(length) >= 2  # 6 completion tokens, 3 blocks
    with torch.no_grad():
        exact = exact_block_elbo(fwd, x0, maskable, MASK_ID, block, eps=1e-3)
        wrong = exact_block_elbo(fwd, x0, maskable, MASK_ID, block, bidirectional=True, eps=1e-3)
        n = 4000
        t = draw_t(n, g, eps=1e-3)  # the published t ~ U[1e-3, 1)
        xt, masked = noise(x0[None].expand(n, -1), maskable[None].expand(n, -1), t, MASK_ID, g)
        terms = torch.cat([draw_terms_shared(fwd, x0, xt[i:i + 50], masked[i:i + 50], t[i:i + 50], block)
                           for i in range(0, n, 50)])
    mean = float(terms.mean())
    se = float(terms.std()) / math.sqrt(n)
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    # the full bidirectional mask lets a masked token see its own clean copy: a different likelihood
    assert abs(wrong - exact) > 6 * se, (wrong, exact, se)
