"""The SDAR block sampler: the KV-cached decode is token-identical to recomputing the prefix at every
step, and the published rules hold (the threshold rule, the even schedule, stop ids, prompt tokens untouched)."""

import pytest
import torch

from dllm_align.generate.block import block_generate, choose, transfer_schedule


def tiny():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    m = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4)
    return m


def test_schedule_and_threshold_rule():
    assert transfer_schedule(4, 4).tolist() == [1, 1, 1, 1]
    assert transfer_schedule(5, 3).tolist() == [2, 2, 1]
    masked = torch.tensor([True, True, False, True])
    conf = torch.tensor([0.95, 0.99, 1.0, 0.2])
    # two above the threshold, at least the scheduled one: both, and never an unmasked position
    assert choose(masked, conf, 1, "low_confidence_dynamic", 0.9).tolist() == [True, True, False, False]
    # fewer above the threshold than scheduled: the scheduled count of most confident
    assert choose(masked, conf, 3, "low_confidence_dynamic", 0.9).tolist() == [True, True, False, True]
    assert choose(masked, conf, 1, "low_confidence_static", 0.9).tolist() == [False, True, False, False]


def test_cached_decode_is_token_identical_to_recomputing_the_prefix():
    model = tiny()
    prompt = torch.tensor([3, 7, 1, 9, 4, 4])  # 6 tokens: one full block of 4 prefilled, the tail decoded
    for strategy, threshold, seed in (("low_confidence_dynamic", 0.9, 0), ("low_confidence_dynamic", 0.3, 1),
                                      ("low_confidence_static", 0.9, 2)):
        outs = []
        for cache in (True, False):
            torch.manual_seed(seed)
            outs.append(block_generate(model, prompt, mask_id=39, gen_length=14, block_length=4, steps=4,
                                       strategy=strategy, threshold=threshold, use_cache=cache))
        assert torch.equal(outs[0], outs[1]), (strategy, outs)
        x = outs[0][0]
        assert x.shape[0] == 20 and torch.equal(x[:6], prompt) and not (x == 39).any()


def test_cached_decode_passes_the_cache_under_the_bodys_own_name():
    """transformers 5.2x renamed the forward's ``past_key_values`` to ``cache`` (the old name warns at every
    call): the sampler asks the body which name it takes, so a decode raises no deprecation warning."""
    import inspect
    import warnings

    from dllm_align.generate.block import cache_argument

    model = tiny()
    want = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert cache_argument(model) == want
    grad = []
    model.register_forward_hook(lambda *_: grad.append(torch.is_grad_enabled()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block_generate(model, torch.tensor([3, 7, 1, 9, 4, 4]), mask_id=39, gen_length=8, block_length=4, steps=4)
    assert grad and not any(grad)  # decoding records no graph


def test_stop_id_ends_after_its_block():
    model = tiny()
    torch.manual_seed(0)
    full = block_generate(model, torch.tensor([1, 2, 3, 4]), mask_id=39, gen_length=16, block_length=4, steps=4)[0]
    first = int(full[4:8][0])  # a token the first generated block is known to hold
    torch.manual_seed(0)
    stopped = block_generate(model, torch.tensor([1, 2, 3, 4]), mask_id=39, gen_length=16, block_length=4, steps=4,
                             stop_ids=[first])[0]
    assert torch.equal(stopped[:8], full[:8]) and (stopped[8:] == 39).all()


def _llada2_reference(model, prompt, mask_id, gen, block, steps, threshold):
    """LLaDA2's published rule, written out plainly (greedy): canvas of whole blocks, the prompt's full blocks
    skipped, each block re-run with its whole prefix under the block-causal mask for at most ``steps`` rounds;
    a round takes every masked position above the threshold if they are at least the schedule's count, else
    the count (never more than are masked) most confident."""
    plen = len(prompt)
    nb = -(-(plen + gen) // block)
    total = nb * block
    x = torch.full((1, total), mask_id)
    x[0, :plen] = prompt
    blk = torch.arange(total) // block
    allowed = blk[:, None] >= blk[None, :]
    sched = [block // steps + (1 if i < block % steps else 0) for i in range(steps)]
    for b in range(plen // block, nb):
        end = (b + 1) * block
        for step in range(steps):
            masked = x[0, end - block:end] == mask_id
            if not masked.any():
                break
            bias = torch.zeros(end, end).masked_fill(~allowed[:end, :end], float("-inf"))[None, None]
            logits = model(input_ids=x[:, :end], attention_mask=bias, position_ids=torch.arange(end)[None],
                           use_cache=False).logits[0, -block:]
            probs = torch.softmax(logits.float(), -1)
            conf, tok = probs.max(-1)
            conf = torch.where(masked, conf, torch.tensor(float("-inf")))
            high = (conf > threshold) & masked
            if int(high.sum()) >= sched[step]:
                take = high
            else:
                take = torch.zeros_like(masked)
                take[torch.topk(conf, min(sched[step], int(masked.sum()))).indices] = True
            x[0, end - block:end][take] = tok[take]
    return x


@pytest.mark.parametrize("cache", [False, True])
def test_llada2_rule_matches_a_plain_reading_of_the_published_loop(cache):
    """The LLaDA2 rule (``rule="llada2"``) against the published loop written out plainly (greedy, fp32): token for
    token, with and without the cache. (Against dllm's own LLaDA2Sampler, fetched: 48/48 identical, docs/block_diffusion.md.)"""
    from dllm_align.generate.block import block_generate
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-sdar")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mp.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    rng = torch.Generator().manual_seed(1)
    for trial in range(6):
        prompt = torch.randint(0, 250, (int(torch.randint(3, 11, (1,), generator=rng)),), generator=rng)
        steps, thr = [4, 2, 3][trial % 3], [0.95, 0.5, 0.2][trial % 3]
        want = _llada2_reference(mp.model, prompt, mp.mask_token_id, 12, 4, steps, thr)
        got = block_generate(mp.model, prompt, mp.mask_token_id, 12, 4, steps, temperature=0.0, threshold=thr,
                             use_cache=cache, rule="llada2")
        assert torch.equal(got, want), (trial, got.tolist(), want.tolist())


# --------------------------------------------------------------------------- SDAR's rule at T -> 0
def _sdar_published(model, prompt, mask_id, gen, block, steps, temperature, strategy, threshold, seed):
    """SDAR's published ``block_diffusion_generate`` written out plainly (no cache: the prefix recomputed under the
    block-causal mask, the same values): temperature-scaled softmax, one multinomial draw per position, its
    probability as the confidence; dynamic: every masked position above the threshold when they are at least the
    step's count, else the count most confident; static: always the latter."""
    torch.manual_seed(seed)
    plen = len(prompt)
    nb = -(-(plen + gen) // block)
    total = nb * block
    x = torch.full((1, total), mask_id)
    x[0, :plen] = prompt
    blk = torch.arange(total) // block
    allowed = blk[:, None] >= blk[None, :]
    sched = [block // steps + (1 if i < block % steps else 0) for i in range(steps)]
    for b in range(plen // block, nb):
        lo, hi = b * block, (b + 1) * block
        for step in range(steps + 1):
            masked = x[0, lo:hi] == mask_id
            if not masked.any():
                break
            bias = torch.zeros(hi, hi).masked_fill(~allowed[:hi, :hi], float("-inf"))[None, None]
            logits = model(input_ids=x[:, :hi], attention_mask=bias, position_ids=torch.arange(hi)[None],
                           use_cache=False).logits[0, lo:hi].float()
            probs = torch.softmax(logits / temperature, -1)
            tok = torch.multinomial(probs, 1)[:, 0]
            conf = torch.where(masked, probs.gather(-1, tok[:, None])[:, 0], torch.tensor(-torch.inf))
            take = torch.zeros_like(masked)
            high = conf > threshold
            if strategy == "low_confidence_dynamic" and int(high.sum()) >= sched[step]:
                take = high
            else:
                take[torch.topk(conf, sched[step]).indices] = True
            x[0, lo:hi][take] = tok[take]
    return x


def _toy_prompts(tokenizer, n):
    from dllm_align.data.toy import make_prompts, prompt_text

    out = []
    for digits in make_prompts(n, 4, seed=5):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(digits)}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def test_limit_draw_is_the_argmax_with_confidence_one_ranked_by_the_logit_gap():
    from dllm_align.generate.block import limit_draw

    logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 5.0, 4.9], [3.0, -1.0, 0.5]]])
    tok, conf, rank = limit_draw(logits)
    assert tok.tolist() == [[0, 1, 0]] and conf.tolist() == [[1.0, 1.0, 1.0]]
    assert torch.allclose(rank, torch.tensor([[1.0, 0.1, 2.5]]))
    # as T -> 0 the published confidences order as the gaps do
    p = torch.softmax(logits.double() / 0.05, -1).max(-1).values[0]
    assert torch.argsort(p, descending=True).tolist() == torch.argsort(rank[0], descending=True).tolist() == [2, 0, 1]
    masked = torch.tensor([True, True, True])
    assert choose(masked, conf[0], 1, "low_confidence_static", 1.0, rank[0]).tolist() == [False, False, True]
    assert choose(masked, conf[0], 1, "low_confidence_dynamic", 0.9, rank[0]).tolist() == [True, True, True]


@pytest.mark.parametrize("threshold", [0.9, 0.5])
def test_sdar_temperature_zero_is_the_limit_of_its_published_rule(threshold, monkeypatch):
    """``temperature: 0`` under SDAR's rule decodes the toy prompts token for token as the published rule does at
    T = 1e-3 (20/20 under the recipe's low_confidence_dynamic). The T = 1 probability as the confidence (LLaDA2's
    greedy convention, which the SDAR rule used before) is a different rule: at threshold 0.9 it agrees on 15/20.
    (``low_confidence_static`` at T = 1e-3 is not a usable reference: float32 rounds most confidences to exactly 1
    and the published topk then breaks the ties by position; 16/20 there.)"""
    import dllm_align.generate.block as blockmod
    from dllm_align.models.load import load_model

    mp = load_model("builtin:toy-sort-base-sdar")
    model, mask = mp.model.eval(), mp.mask_token_id
    prompts = _toy_prompts(mp.tokenizer, 20)
    want = [_sdar_published(model, p, mask, 8, 4, 4, 1e-3, "low_confidence_dynamic", threshold, seed=i)
            for i, p in enumerate(prompts)]

    def agree():
        return sum(torch.equal(block_generate(model, p, mask, 8, 4, 4, temperature=0.0, threshold=threshold), w)
                   for p, w in zip(prompts, want))

    assert agree() == 20
    if threshold == 0.9:
        def t1_confidence(logits):
            tok, p = blockmod.draw(logits, 0.0)
            return tok, p, p
        monkeypatch.setattr(blockmod, "limit_draw", t1_confidence)
        assert agree() < 20


def test_block_rule_records_only_the_settings_it_reads():
    from dllm_align.generate.settings import SamplerSettings

    block = SamplerSettings(sampler="block", gen_length=8, block_length=4, steps=8).to_dict()
    assert "remasking" not in block and block["top_k"] is None and block["sampler"] == "block"
    llada = SamplerSettings(sampler="llada", gen_length=8, block_length=4, steps=8).to_dict()
    assert llada["remasking"] == "low_confidence"


def test_top_k_and_top_p_help_names_each_rule_that_reads_them():
    from dllm_align.config.schema import GenerateSection

    for key in ("top_k", "top_p"):
        text = GenerateSection.model_fields[key].description
        assert "Dream" in text and "block" in text, text
