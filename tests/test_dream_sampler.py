"""Dream's decoding rule reproduces the published ``diffusion_generate`` token for token (fp32).

``published_rule`` below is an independent transcription of the published algorithm
(docs/design.md#the-dream-rule): one canvas, ``timesteps = linspace(1, eps, steps + 1)``, the
shifted logits of the raw model, ``sample_tokens`` with temperature / top-p / top-k,
the four ``alg`` rules and ``alg_temp``, one global random stream seeded with
``torch.manual_seed``. The library draws from a per-prompt generator seeded the same
way, so a prompt alone must give identical tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm_align.generate.settings import SamplerSettings, encode_prompt
from dllm_align.generate.sampler import generate, generate_batch
from dllm_align.models.load import build_tiny_tokenizer, load_model

from fixtures.family_checkpoints import dream_config, dream_state, write_checkpoint


def _published_sample_tokens(logits, temperature, top_p, top_k, margin=False, neg_entropy=False):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = 0
        m = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove)
        logits = logits.masked_fill(m, torch.finfo(logits.dtype).min)
    if top_k is not None:
        k = min(top_k, logits.size(-1))
        logits = logits.masked_fill(logits < torch.topk(logits, k)[0][..., -1, None], torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        try:
            x0 = torch.distributions.Categorical(probs=probs).sample()
            conf = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        except Exception:
            conf, x0 = probs.max(dim=-1)
    else:
        conf, x0 = probs.max(dim=-1)
    if margin:
        sp, _ = torch.sort(probs, dim=-1, descending=True)
        conf = sp[:, 0] - sp[:, 1]
    if neg_entropy:
        conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf, x0


@torch.no_grad()
def published_rule(model, prompt, mask_id, gen_length, steps, eps, alg, alg_temp, temperature, top_p, top_k, seed):
    torch.manual_seed(seed)
    x = F.pad(torch.tensor([prompt]), (0, gen_length), value=mask_id)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        logits = model(input_ids=x).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + mask_id
            move = torch.rand(*x0.shape) < p_transfer
            _, x0[move] = _published_sample_tokens(mask_logits[move], temperature, top_p, top_k)
            x[mask_index] = x0.clone()
        else:
            conf, x0 = _published_sample_tokens(mask_logits, temperature, top_p, top_k,
                                                margin=alg == "topk_margin", neg_entropy=alg == "entropy")
            n = mask_index.sum() / mask_index.shape[0]
            k = int(n * (1 - s / t)) if i < steps - 1 else int(n)
            full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
            full[mask_index] = conf
            if k > 0:
                if alg_temp is None or alg_temp == 0:
                    _, idx = torch.topk(full, k)
                else:
                    idx = torch.multinomial(F.softmax(full / alg_temp, dim=-1), num_samples=k)
                x_ = torch.zeros_like(x) + mask_id
                x_[mask_index] = x0.clone()
                rows = torch.arange(x.size(0)).unsqueeze(1).expand_as(idx)
                x[rows, idx] = x_[rows, idx]
    return x[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    tok = build_tiny_tokenizer("dream")
    cfg = dream_config(tok)
    folder = write_checkpoint(tmp_path_factory.mktemp("dream") / "m", cfg, dream_state(cfg, seed=1), tok)
    return load_model(str(folder))


CASES = [
    # (alg, alg_temp, temperature, top_p, top_k)
    ("origin", 0.0, 0.0, None, None),
    ("origin", 0.0, 0.8, 0.9, None),
    ("maskgit_plus", 0.0, 0.0, None, None),
    ("maskgit_plus", 0.0, 0.7, None, 20),
    ("topk_margin", 0.0, 0.0, 0.5, None),
    ("topk_margin", 0.5, 0.9, None, None),
    ("entropy", 0.0, 0.0, None, None),
    ("entropy", 0.0, 0.2, 0.95, None),  # the model card's settings
    ("entropy", 1.0, 0.0, None, 5),
]


@pytest.mark.parametrize("alg,alg_temp,temperature,top_p,top_k", CASES)
def test_reproduces_published_rule_token_for_token(dream, alg, alg_temp, temperature, top_p, top_k):
    prompt = encode_prompt(dream.tokenizer, [{"role": "user", "content": "sort: 4 1 3"}])
    for steps, gen in ((12, 12), (5, 12)):  # one token per step; several per step
        st = SamplerSettings(gen_length=gen, block_length=gen, steps=steps, alg=alg, alg_temp=alg_temp,
                             temperature=temperature, top_p=top_p, top_k=top_k)
        ours = generate_batch(dream, [prompt], st, seeds=[1234])[0].raw
        ref = published_rule(dream.model, prompt, dream.mask_token_id, gen, steps, 1e-3, alg, alg_temp,
                             temperature, top_p, top_k, seed=1234)
        assert ours == ref, (steps, ours, ref)
        assert dream.mask_token_id not in ours or alg != "origin"  # origin fills every position at the last step


def test_auto_uses_the_family_rule_and_llada_is_still_available(dream):
    prompt = encode_prompt(dream.tokenizer, [{"role": "user", "content": "hi"}])
    auto = SamplerSettings(gen_length=8, block_length=8, steps=8, alg="entropy")
    ref = published_rule(dream.model, prompt, dream.mask_token_id, 8, 8, 1e-3, "entropy", 0.0, 0.0, None, None, seed=7)
    assert generate_batch(dream, [prompt], auto, seeds=[7])[0].raw == ref
    llada = SamplerSettings(gen_length=8, block_length=4, steps=8, sampler="llada")
    out = generate_batch(dream, [prompt], llada, seeds=[7])[0]
    assert dream.mask_token_id not in out.raw


@pytest.mark.parametrize("alg,temperature", [("entropy", 0.0), ("origin", 0.7), ("maskgit_plus", 0.5)])
def test_batched_prompts_equal_each_alone(dream, alg, temperature):
    tok = dream.tokenizer
    prompts = [encode_prompt(tok, [{"role": "user", "content": t}]) for t in ("a", "sort: 9 8 7 6 5", "xyz")]
    st = SamplerSettings(gen_length=10, block_length=10, steps=6, alg=alg, temperature=temperature, top_p=0.9)
    together = generate(dream, prompts, st, seeds=[1, 2, 3], batch_size=3)
    for i, p in enumerate(prompts):
        assert generate(dream, [p], st, seeds=[i + 1])[0].raw == together[i].raw


def test_dream_rule_refuses_llada_only_options():
    from dllm_align.core.errors import UserError

    for key, kw in (("cache", {"cache": "dual"}), ("threshold", {"threshold": 0.9}), ("cfg", {"cfg": 1.0})):
        with pytest.raises(UserError, match=f"{key}: not a setting of the rule 'dream'"):
            SamplerSettings(gen_length=8, block_length=8, steps=8, sampler="dream", **kw)
    with pytest.raises(UserError, match="top_p: not a setting of the rule 'llada'"):
        SamplerSettings(gen_length=8, block_length=8, steps=8, sampler="llada", top_p=0.9)
    with pytest.raises(UserError, match="cfg: not a setting of the rule 'block'"):
        SamplerSettings(gen_length=8, block_length=4, steps=8, sampler="block", cfg=1.0)


def test_text_is_rendered_as_the_published_code_renders_it(dream):
    # Dream's published demo decodes every token before the end of text; skip_special_tokens=True (LLaDA's
    # rendering) would drop added tokens such as Qwen2's <|box_end|>: here <|im_start|> plays that part.
    from dllm_align.generate.canvas import completion
    from dllm_align.generate.settings import SamplerStats

    tok = dream.tokenizer
    start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("ab", add_special_tokens=False) + [start] + tok.encode("cd", add_special_tokens=False)
    gen = torch.tensor(ids + [tok.convert_tokens_to_ids("<|im_end|>")] + ids)
    stops = torch.tensor(dream.stop_token_ids)
    c = completion(dream, gen, stops, 1, SamplerStats(prompts=1))
    assert c.text == "ab<|im_start|>cd" and c.stopped
    assert tok.decode(ids, skip_special_tokens=True) == "abcd"  # what the LLaDA rendering would have given


def test_diffucoder_padding_token_ends_the_text(dream):
    # DiffuCoder (a Dream-family checkpoint) has <|dlm_pad|> in its vocabulary and its published generate
    # stops there; Dream's vocabulary lacks it, and the stop list simply skips it.
    import copy

    from dllm_align.generate.canvas import completion
    from dllm_align.generate.settings import SamplerStats
    from dllm_align.models.predictor import MaskPredictor

    assert dream.tokenizer.convert_tokens_to_ids("<|dlm_pad|>") not in dream.stop_token_ids
    tok = copy.deepcopy(dream.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|dlm_pad|>"]})
    pad = tok.convert_tokens_to_ids("<|dlm_pad|>")
    coder = MaskPredictor(dream.model, tok, mask_token_id=dream.mask_token_id)
    assert pad in coder.stop_token_ids
    ids = tok.encode("ab", add_special_tokens=False)
    c = completion(coder, torch.tensor(ids + [pad, pad] + ids), torch.tensor(coder.stop_token_ids), 1, SamplerStats(prompts=1))
    assert c.text == "ab" and c.stopped
