"""The native LLaDA2.0 MoE body (``dllm_align.models.families.llada2_body``) and its loader.

``fixtures/llada2_mini_config.json`` is a field-for-field copy of LLaDA2.0-mini's published config.json
(as inclusionAI/dFactory ships it in ``configs/model_configs/llada2_mini/config.json``, commit c29d72cc,
with ``model_type`` put back to the hub's ``llada2_moe``: dFactory's own setup script rewrites it to
``llada2_moe_veomni`` for its merged-expert layout) with the sizes shrunk: 3 layers (the first dense, as
``first_k_dense_replace: 1``), hidden 32, 4 heads of 8 with 2 key/value heads, 8 experts in 4 groups (2
kept), 3 experts per token, one shared expert, vocabulary 64, ``rotary_dim`` 4 (= 8 * 0.5), pad 60. The
published config.json names no mask, bos or eos token.

The parity tests run the published modeling code (the dllm library's
``dllm/pipelines/llada2/models/{configuration,modeling}_llada2_moe.py``) from a checkout of ZHZisZZ/dllm under
``$DLLM_ALIGN_PUBLISHED_DIR`` (tests/fixtures/published.py says how; never committed); they skip, saying how to
enable them, when it is not there. The independent
reference below (loops over tokens, heads and experts; brute-force group selection) always runs.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from dllm_align.core.errors import UserError
from dllm_align.models.families import native_family
from dllm_align.models.families.block import LLADA2, build_llada2_model, llada2_config, load_llada2_native
from dllm_align.models.families.llada2_body import Llada2MoeModelLM, Llada2Router, group_limited_topk
from dllm_align.objective.block import hf_forward, hf_streams_forward, streams_mask

FIXTURE = Path(__file__).parent / "fixtures" / "llada2_mini_config.json"
PUBLISHED_REPO, PUBLISHED_FILE = "ZHZisZZ/dllm", "dllm/pipelines/llada2/models/modeling_llada2_moe.py"
# A second shape: dense-output and qkv biases, one expert per token (no renormalisation), no dense
# layer, head_dim 16 != hidden / heads, a quarter of each head rotated, no shared expert.
VARIANT = {"use_bias": True, "use_qkv_bias": True, "num_experts_per_tok": 1, "first_k_dense_replace": 0,
           "head_dim": 16, "partial_rotary_factor": 0.25, "rotary_dim": 4, "num_shared_experts": None}


def fixture_cfg(**over) -> dict:
    cfg = json.loads(FIXTURE.read_text())
    cfg.update(over)
    return cfg


def randomize(model, seed: int = 0) -> None:
    """Weights large enough that routing, masks and norms all move the logits; a nonzero expert bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def block_causal(length: int, block: int) -> torch.Tensor:
    blk = torch.arange(length) // block
    return blk[:, None] >= blk[None, :]


@pytest.fixture
def published(monkeypatch):
    """The published modeling module, imported under transformers 5.23 with two shims that leave its
    arithmetic alone: ``is_torch_fx_available`` (gone in transformers 5) -> False, and the ``default``
    rotary initialiser (gone too) -> transformers 4.x's: inv_freq = theta ** -(arange(0, d, 2) / d),
    d = int(head_dim * partial_rotary_factor)."""
    from fixtures.published import require

    published_dir = require(PUBLISHED_REPO, PUBLISHED_FILE).parent
    import transformers.modeling_rope_utils as ru
    import transformers.utils.import_utils as iu

    def default_rope(config, device=None, seq_len=None, **_):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (config.rope_theta ** exps), 1.0

    monkeypatch.setattr(iu, "is_torch_fx_available", lambda: False, raising=False)
    monkeypatch.setitem(ru.ROPE_INIT_FUNCTIONS, "default", default_rope)
    name = "_llada2_published"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(published_dir)]
        monkeypatch.setitem(sys.modules, name, pkg)
    try:
        return importlib.import_module(name + ".modeling_llada2_moe")
    except ImportError as e:  # e.g. transformers 5.24 dropped modeling_attn_mask_utils, which it imports
        import transformers

        pytest.skip(f"the published LLaDA2.0 modeling code does not import under transformers {transformers.__version__} "
                    f"({e}); run this check under transformers 5.23")


def published_checkpoint(published, cfg: dict, folder: Path, seed: int = 0):
    """A random published model saved as the hub stores it (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    keys = set(published.LLaDA2MoeConfig.__init__.__code__.co_varnames) - {"self", "kwargs"}
    pc = published.LLaDA2MoeConfig(**{k: v for k, v in cfg.items() if k in keys})
    pc._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = published.LLaDA2MoeModelLM(pc)
    randomize(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return model


# --------------------------------------------------------------------------- (a) the published forward
@pytest.mark.parametrize("shape", ["mini", "variant"])
@pytest.mark.parametrize("train_mode", [False, True])
def test_logits_equal_the_published_forward(published, tmp_path, shape, train_mode):
    cfg = fixture_cfg(**(VARIANT if shape == "variant" else {}))
    pub = published_checkpoint(published, cfg, tmp_path / "ckpt")
    mine = load_llada2_native(tmp_path / "ckpt", cfg, torch.float32)
    pub.train(train_mode)  # the published MoE has a separate training path
    mine.train(train_mode)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    n = 12
    two_l = streams_mask(n, 4, 1)[None, None].expand(2, 1, -1, -1)
    pos = torch.arange(n).repeat(2)[None].expand(2, -1)
    cases = {"full": {}, "block-causal": {"attention_mask": block_causal(24, 4)[None, None].expand(2, 1, -1, -1)},
             "2L": {"attention_mask": two_l, "position_ids": pos}}
    with torch.no_grad():
        for case, kw in cases.items():
            a, b = pub(ids, **kw).logits, mine(ids, **kw).logits
            assert a.dtype == b.dtype == torch.float32
            assert (a - b).abs().max().item() <= 1e-5, case
        # not vacuous: the mask moves the published logits
        assert (pub(ids).logits - pub(ids, **cases["block-causal"]).logits).abs().max() > 0.1


def test_cache_prefill_equals_the_published_cache(published, tmp_path):
    from transformers import DynamicCache

    cfg = fixture_cfg()
    pub = published_checkpoint(published, cfg, tmp_path / "ckpt").eval()
    mine = load_llada2_native(tmp_path / "ckpt", cfg, torch.float32)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outs = []
        for model in (pub, mine):  # explicit masks: with a cache and no mask the published code is causal
            cache = DynamicCache()
            model(ids[:, :8], attention_mask=block_causal(8, 4)[None, None], past_key_values=cache, use_cache=True)
            current = torch.ones(1, 1, 4, 12, dtype=torch.bool)
            outs.append(model(ids[:, 8:], attention_mask=current, past_key_values=cache, use_cache=True).logits)
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- (b) an independent reference
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _swiglu(sd, prefix, x):
    g = x @ sd[prefix + "gate_proj.weight"].T
    return (torch.nn.functional.silu(g) * (x @ sd[prefix + "up_proj.weight"].T)) @ sd[prefix + "down_proj.weight"].T


def _route(s, biased, n_group, topk_group, top_k):
    """Brute force: the best-scoring set of topk_group groups, then the best set of top_k experts in them."""
    e = len(s)
    per = e // n_group
    group_score = [max(biased[g * per + i] + biased[g * per + j] for i, j in itertools.combinations(range(per), 2))
                   for g in range(n_group)]
    groups = max(itertools.combinations(range(n_group), topk_group), key=lambda c: sum(group_score[g] for g in c))
    pool = [g * per + i for g in groups for i in range(per)]
    return list(max(itertools.combinations(pool, top_k), key=lambda c: sum(biased[x] for x in c)))


def reference_logits(model, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """LLaDA2.0's forward for one sequence, written out from the facts with loops (float32)."""
    c = model.config
    sd = {k: v.float() for k, v in model.state_dict().items()}
    nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    rd = int(hd * c.partial_rotary_factor)
    length = ids.shape[0]
    x = sd["model.word_embeddings.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        qkv = h @ sd[p + "attention.query_key_value.weight"].T
        if c.use_qkv_bias:
            qkv = qkv + sd[p + "attention.query_key_value.bias"]
        q = qkv[:, : nh * hd].reshape(length, nh, hd)
        k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(length, nkv, hd)
        v = qkv[:, (nh + nkv) * hd:].reshape(length, nkv, hd)
        q = _rms(q, sd[p + "attention.query_layernorm.weight"], eps)
        k = _rms(k, sd[p + "attention.key_layernorm.weight"], eps)
        q, k = q.clone(), k.clone()
        for t in range(length):
            for j in range(rd // 2):
                ang = t * c.rope_theta ** (-2 * j / rd)
                cs, sn = math.cos(ang), math.sin(ang)
                for z in (q, k):
                    a, b = z[t, :, j].clone(), z[t, :, j + rd // 2].clone()
                    z[t, :, j], z[t, :, j + rd // 2] = a * cs - b * sn, b * cs + a * sn
        heads = []
        for head in range(nh):
            kvh = head // (nh // nkv)
            sc = (q[:, head] @ k[:, kvh].T) / math.sqrt(hd)
            if mask is not None:
                sc = sc.masked_fill(~mask, float("-inf"))
            heads.append(torch.softmax(sc, -1) @ v[:, kvh])
        o = torch.cat(heads, -1) @ sd[p + "attention.dense.weight"].T
        if c.use_bias:
            o = o + sd[p + "attention.dense.bias"]
        x = x + o
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        if i < c.first_k_dense_replace:
            x = x + _swiglu(sd, p + "mlp.", h)
            continue
        y = torch.zeros_like(h)
        for t in range(length):
            s = torch.sigmoid(sd[p + "mlp.gate.weight"] @ h[t]).tolist()
            biased = [a + b for a, b in zip(s, sd[p + "mlp.gate.expert_bias"].tolist())]
            chosen = _route(s, biased, c.n_group, c.topk_group, c.num_experts_per_tok)
            w = [s[e] for e in chosen]
            if len(w) > 1:
                w = [a / sum(w) for a in w]
            for e, a in zip(chosen, w):
                y[t] += a * c.routed_scaling_factor * _swiglu(sd, p + f"mlp.experts.{e}.", h[t])
            if c.num_shared_experts is not None:
                y[t] += _swiglu(sd, p + "mlp.shared_experts.", h[t])
        x = x + y
    return _rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("shape", ["mini", "variant"])
def test_body_equals_an_independent_reference(shape):
    config = llada2_config(fixture_cfg(**(VARIANT if shape == "variant" else {})))
    torch.manual_seed(0)
    model = Llada2MoeModelLM(config).eval()
    randomize(model, 3)
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(4))
    for mask in (None, block_causal(10, 4)):
        with torch.no_grad():
            mine = model(ids[None], attention_mask=None if mask is None else mask[None, None]).logits[0]
        ref = reference_logits(model, ids, mask)
        assert (mine - ref).abs().max().item() <= 1e-4
    assert (reference_logits(model, ids, None) - reference_logits(model, ids, block_causal(10, 4))).abs().max() > 0.1


def test_streams_attention_gets_its_kwargs_and_equals_the_dense_mask():
    """Extra forward kwargs reach the attention function: the (K+1)L streams layout equals the dense mask."""
    from dllm_align.models.load import build_tiny_tokenizer

    model = build_llada2_model(build_tiny_tokenizer("llada"), 32, 2, 4, 48, 64, seed=0, num_experts=4)
    randomize(model, 5)
    k, n, b = 3, 8, 4
    ids = torch.randint(0, 250, (1, (k + 1) * n), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(n).repeat(k + 1)[None]
    with torch.no_grad():
        dense = hf_forward(model)(ids, pos, streams_mask(n, b, k))
        streams = hf_streams_forward(model, k, n, b)(ids, pos, None)
    assert (dense - streams).abs().max().item() <= 1e-5


def test_cache_prefill_equals_the_block_causal_forward():
    from transformers import DynamicCache

    from dllm_align.models.load import build_tiny_tokenizer

    model = build_llada2_model(build_tiny_tokenizer("llada"), 32, 2, 4, 48, 64, seed=1)
    randomize(model, 7)
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(ids, attention_mask=block_causal(12, 4)[None, None]).logits
        cache = DynamicCache()
        model(ids[:, :8], attention_mask=block_causal(8, 4)[None, None], past_key_values=cache)
        last = model(ids[:, 8:], past_key_values=cache).logits
    assert cache.get_seq_length() == 12
    assert (full[:, 8:] - last).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- (c) the router
def test_group_limited_topk_matches_brute_force():
    g = torch.Generator().manual_seed(9)
    for n_group, per, topk_group, top_k in [(4, 2, 2, 3), (4, 4, 1, 2), (3, 3, 2, 4), (8, 4, 4, 8)]:
        scores = torch.rand(50, n_group * per, generator=g)
        got = group_limited_topk(scores, n_group, topk_group, top_k)
        for row, chosen in zip(scores.tolist(), got.tolist()):
            assert sorted(chosen) == sorted(_route(row, row, n_group, topk_group, top_k))
    # A group with the single best expert but a weak runner-up loses to two groups of solid pairs.
    scores = torch.tensor([[0.90, 0.01, 0.60, 0.55, 0.50, 0.45]])  # group scores 0.91, 1.15, 0.95
    assert sorted(group_limited_topk(scores, 3, 2, 2)[0].tolist()) == [2, 3]
    assert sorted(scores.topk(2).indices[0].tolist()) == [0, 2]  # plain top-k would pick otherwise


def test_expert_bias_changes_selection_not_weights():
    config = llada2_config(fixture_cfg())
    router = Llada2Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(10)))
    x = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(11))
    scores = torch.sigmoid(x @ router.weight.T)
    chosen0, w0, _ = router(x)
    with torch.no_grad():
        router.expert_bias[5] = 10.0  # expert 5 now always selected
    chosen1, w1, _ = router(x)
    assert (chosen1 == 5).any(-1).all() and not (chosen0 == 5).any(-1).all()
    for c, w in ((chosen0, w0), (chosen1, w1)):
        s = scores.gather(1, c)
        torch.testing.assert_close(w, 2.5 * s / s.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- (d) save and load
def test_saved_folder_loads_through_the_family_with_identical_logits(tmp_path):
    from dllm_align.models.load import build_tiny_tokenizer

    model = build_llada2_model(build_tiny_tokenizer("llada"), 32, 3, 4, 48, 64, seed=2, block_size=8)
    randomize(model, 12)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert native_family(cfg) is LLADA2 and cfg["dllm_align_family"] == "llada2"
    loaded = load_llada2_native(tmp_path, cfg, torch.float32)
    assert loaded.config.block_size == 8 and loaded.config.mask_token_id == model.config.mask_token_id
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(13))
    mask = block_causal(16, 8)[None, None]
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        # The tensors safetensors hands back are not 64-byte aligned, so CPU matmuls may take another
        # vectorised path (7e-7 here); once copied into fresh storage they give the very same logits.
        assert (want - loaded(ids, attention_mask=mask).logits).abs().max().item() <= 1e-5
        loaded.load_state_dict({k: v.clone() for k, v in loaded.state_dict().items()}, assign=True)
        assert torch.equal(want, loaded(ids, attention_mask=mask).logits)


def test_published_fixture_reads_as_llada2():
    cfg = fixture_cfg()
    assert native_family(cfg) is LLADA2
    config = llada2_config(cfg)
    assert (config.rope_dim, config.head_dim, config.mask_token_id, config.block_size) == (4, 8, 156895, 32)
    assert config.use_qk_norm and config.attention_dropout == 0.0 and not config.use_bias


# --------------------------------------------------------------------------- (e) refusals
@pytest.mark.parametrize("over,named", [
    ({"score_function": "softmax"}, "score_function"),
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rotary_dim": 8}, "rotary_dim"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"num_experts": 6}, "num_experts=6"),
])
def test_unsupported_options_are_refused_by_name(over, named):
    with pytest.raises(UserError, match=named):
        llada2_config(fixture_cfg(**over))


def test_missing_attention_dropout_takes_the_published_default_and_is_refused():
    cfg = fixture_cfg()
    del cfg["attention_dropout"]
    with pytest.raises(UserError, match="attention_dropout=0.1"):
        llada2_config(cfg)


@pytest.mark.parametrize("change,named", [("add", "weights the LLaDA2.0 mapping does not know: .*e_score_correction"),
                                           ("drop", "missing weights: .*expert_bias")])
def test_unknown_or_missing_weight_is_named(tmp_path, change, named):
    from safetensors.torch import load_file, save_file

    from dllm_align.models.load import build_tiny_tokenizer

    build_llada2_model(build_tiny_tokenizer("llada"), 32, 2, 4, 48, 64, seed=3).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    if change == "add":
        state["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(4)
    else:
        del state["model.layers.1.mlp.gate.expert_bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=named):
        load_llada2_native(tmp_path, json.loads((tmp_path / "config.json").read_text()), torch.float32)


# --------------------------------------------------------------------------- (f) gradients
def test_gradients_flow():
    from dllm_align.models.load import build_tiny_tokenizer

    model = build_llada2_model(build_tiny_tokenizer("llada"), 32, 2, 4, 48, 64, seed=4).train()
    randomize(model, 14)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(15))
    logits = model(ids, attention_mask=block_causal(16, 4)[None, None]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    must = [n for n in grads if ".experts." not in n and "word_embeddings" not in n]
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in must), [n for n in must if grads[n] is None]
    assert grads["model.layers.1.mlp.gate.weight"].abs().sum() > 0  # the router learns through its weights
    assert sum(grads[n] is not None for n in grads if ".experts." in n) >= 3  # the chosen experts' matrices
    assert model.model.layers[1].mlp.gate.expert_bias.grad is None


def test_block_sampler_with_a_cache_equals_recomputing_the_prefix():
    """The block sampler's cached path (prefill, crop) runs on the body token for token like the uncached one."""
    from dllm_align.generate.block import block_generate
    from dllm_align.models.load import build_tiny_tokenizer

    tok = build_tiny_tokenizer("llada")
    model = build_llada2_model(tok, 32, 2, 4, 48, 64, seed=5, block_size=4)
    randomize(model, 16)
    for prompt in ([1, 2, 3], [5, 6, 7, 8, 9]):
        outs = [block_generate(model, torch.tensor(prompt), mask_id=tok.mask_token_id, gen_length=10, block_length=4,
                               steps=4, temperature=0.0, threshold=0.9, use_cache=cached)[0] for cached in (True, False)]
        assert torch.equal(outs[0], outs[1])
        assert not (outs[0] == tok.mask_token_id).any()


def test_2d_mask_is_key_padding_and_padding_changes_nothing():
    from dllm_align.models.load import build_tiny_tokenizer

    model = build_llada2_model(build_tiny_tokenizer("llada"), 32, 2, 4, 48, 64, seed=6)
    randomize(model, 17)
    ids = torch.randint(0, 250, (1, 10), generator=torch.Generator().manual_seed(18))
    padded = torch.cat([ids, torch.full((1, 4), 257)], dim=1)
    keep = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], dim=1).long()
    with torch.no_grad():
        alone = model(ids).logits
        got = model(padded, attention_mask=keep).logits[:, :10]
        assert (alone - got).abs().max().item() <= 1e-5
        assert (alone - model(padded).logits[:, :10]).abs().max().item() > 1e-3  # unmasked padding does matter
