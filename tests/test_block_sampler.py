"""The SDAR block sampler (issue 24): the KV-cached decode is token-identical to recomputing the prefix at every
step, and the published rules hold (the threshold rule, the even schedule, stop ids, prompt tokens untouched)."""

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


def test_stop_id_ends_after_its_block():
    model = tiny()
    torch.manual_seed(0)
    full = block_generate(model, torch.tensor([1, 2, 3, 4]), mask_id=39, gen_length=16, block_length=4, steps=4)[0]
    first = int(full[4:8][0])  # a token the first generated block is known to hold
    torch.manual_seed(0)
    stopped = block_generate(model, torch.tensor([1, 2, 3, 4]), mask_id=39, gen_length=16, block_length=4, steps=4,
                             stop_ids=[first])[0]
    assert torch.equal(stopped[:8], full[:8]) and (stopped[8:] == 39).all()
