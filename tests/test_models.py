"""Model layer: the built-in tiny model, native LLaDA loading, hub errors, the MaskPredictor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dllm_align.core.errors import UserError
from dllm_align.models.load import build_tiny_tokenizer, load_model

# --------------------------------------------------------------------------- tiny model
def test_tiny_roundtrip_and_training_step(tiny, tiny_dir):
    tok = tiny.tokenizer
    text = "Sort 3 1 2 — héllo ✓"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text  # byte-level: any text round-trips
    assert tiny.mask_token_id == tok.mask_token_id
    assert tok.convert_ids_to_tokens(tiny.stop_token_ids[0]) == "<|eot_id|>"
    again = load_model(str(tiny_dir))
    x = torch.tensor([ids])
    torch.testing.assert_close(again.logits(x), tiny.logits(x))
    # plain transformers loads the saved folder too
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    torch.testing.assert_close(plain(x).logits, tiny.logits(x))
    # it trains: a step moves the weights (its speed is a benchmark's business: benchmarks/run.py)
    model = again.model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = [q.detach().clone() for q in model.parameters()]
    loss = model(torch.randint(0, 256, (2, 64))).logits.logsumexp(-1).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and any(not torch.equal(b, q) for b, q in zip(before, model.parameters()))


def test_tiny_is_bidirectional(tiny):
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 256
    assert (tiny.logits(x)[0, 0] - tiny.logits(y)[0, 0]).abs().max() > 1e-4  # the last token changes position 0


def test_left_padded_row_equals_row_alone(tiny):
    tok = tiny.tokenizer
    a = tok("short", add_special_tokens=False).input_ids
    b = tok("a much longer row", add_special_tokens=False).input_ids
    pad = len(b) - len(a)
    ids = torch.tensor([[tok.pad_token_id] * pad + a, b])
    am = torch.tensor([[0] * pad + [1] * len(a), [1] * len(b)])
    batched = tiny.logits(ids, am)
    alone = tiny.logits(torch.tensor([a]))
    torch.testing.assert_close(batched[0, pad:], alone[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- LLaDA checkpoints
def _llada_config(vocab, d=32, heads=4, layers=2, mlp=48, theta=500000.0):
    return {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "activation_type": "silu",
        "block_type": "llama",
        "d_model": d,
        "n_heads": heads,
        "n_kv_heads": heads,
        "n_layers": layers,
        "mlp_hidden_size": mlp,
        "mlp_ratio": 4,
        "embedding_size": vocab,
        "vocab_size": vocab,
        "rope": True,
        "rope_theta": theta,
        "rms_norm_eps": 1e-5,
        "layer_norm_type": "rms",
        "include_bias": False,
        "include_qkv_bias": False,
        "input_emb_norm": False,
        "scale_logits": False,
        "weight_tying": False,
        "max_sequence_length": 256,
        "mask_token_id": vocab - 1,
        "eos_token_id": 257,
        "pad_token_id": 257,
        "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"},
    }


def _llada_state(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, mlp, V = cfg["d_model"], cfg["mlp_hidden_size"], cfg["embedding_size"]

    def w(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.transformer.wte.weight": w(V, d, scale=0.5), "model.transformer.ln_f.weight": 1 + w(d, scale=0.1),
          "model.transformer.ff_out.weight": w(V, d, scale=0.2)}
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        sd[p + "attn_norm.weight"] = 1 + w(d, scale=0.1)
        sd[p + "ff_norm.weight"] = 1 + w(d, scale=0.1)
        for n in ("q_proj", "k_proj", "v_proj", "attn_out"):
            sd[p + n + ".weight"] = w(d, d, scale=0.2)
        sd[p + "ff_proj.weight"] = w(mlp, d, scale=0.2)
        sd[p + "up_proj.weight"] = w(mlp, d, scale=0.2)
        sd[p + "ff_out.weight"] = w(d, mlp, scale=0.2)
    return sd


def _reference_llada_logits(sd, cfg, ids):
    """LLaDA's forward written from the published architecture, independently of transformers.

    Block: x += attn_out(attn(rope(q), rope(k), v)) on attn_norm(x) (no causal mask);
    x += ff_out(silu(ff_proj(h)) * up_proj(h)) on h = ff_norm(x); logits = ff_out(ln_f(x)).
    RMSNorm: x / sqrt(mean(x^2) + eps) * w. RoPE: rotate-half with inv_freq = theta^(-2i/hd).
    """
    d, H, eps = cfg["d_model"], cfg["n_heads"], cfg["rms_norm_eps"]
    hd = d // H
    T = ids.shape[1]

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()

    def rope(t):  # t: [B, H, T, hd]
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    x = sd["model.transformer.wte.weight"][ids]
    B = ids.shape[0]
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        h = rms(x, sd[p + "attn_norm.weight"])
        q, k, v = (h @ sd[p + n + ".weight"].T for n in ("q_proj", "k_proj", "v_proj"))
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, v))
        q, k = rope(q), rope(k)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, d) @ sd[p + "attn_out.weight"].T
        h = rms(x, sd[p + "ff_norm.weight"])
        gate = torch.nn.functional.silu(h @ sd[p + "ff_proj.weight"].T)
        x = x + (gate * (h @ sd[p + "up_proj.weight"].T)) @ sd[p + "ff_out.weight"].T
    return rms(x, sd["model.transformer.ln_f.weight"]) @ sd["model.transformer.ff_out.weight"].T


def _write_llada(folder, sharded=False, **kw):
    tok = build_tiny_tokenizer()
    cfg = _llada_config(len(tok), **kw)
    sd = _llada_state(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(folder)
    if sharded:
        keys = sorted(sd)
        half = len(keys) // 2
        parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        for name, ks in parts.items():
            save_file({k: sd[k] for k in ks}, str(folder / name))
        index = {"metadata": {}, "weight_map": {k: n for n, ks in parts.items() for k in ks}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(sd, str(folder / "model.safetensors"))
    return cfg, sd


@pytest.mark.parametrize("sharded", [False, True])
def test_llada_native_matches_reference_implementation(tmp_path, sharded):
    cfg, sd = _write_llada(tmp_path / "llada", sharded=sharded)
    mp = load_model(str(tmp_path / "llada"))  # no trust_remote_code
    assert mp.mask_token_id == cfg["mask_token_id"]
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    ref = _reference_llada_logits(sd, cfg, ids)
    torch.testing.assert_close(mp.logits(ids), ref, atol=2e-5, rtol=1e-4)
    assert mp.model.config.is_causal is False
    # saved in the Llama layout, it reloads through plain transformers with the same logits
    mp.model.save_pretrained(tmp_path / "export")
    mp.tokenizer.save_pretrained(tmp_path / "export")
    again = load_model(str(tmp_path / "export"))
    torch.testing.assert_close(again.logits(ids), ref, atol=2e-5, rtol=1e-4)


def test_llada_unsupported_option_is_named(tmp_path):
    _write_llada(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["scale_logits"] = True
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="scale_logits=true"):
        load_model(str(tmp_path / "m"))


def test_no_pickle_checkpoints(tmp_path):
    _write_llada(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(UserError, match="no safetensors weights"):
        load_model(str(tmp_path / "m"))


# --------------------------------------------------------------------------- resolving
def test_offline_hub_is_one_line_without_a_connection(connections):
    with pytest.raises(UserError) as ei:
        load_model("GSAI-ML/LLaDA-8B-Instruct")
    assert connections == []
    assert "GSAI-ML/LLaDA-8B-Instruct" in ei.value.message and "\n" not in ei.value.message
    assert "local" in ei.value.hint


def test_missing_folder_and_not_a_model(tmp_path):
    with pytest.raises(UserError, match="model folder not found"):
        load_model("./does/not/exist")
    with pytest.raises(UserError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(UserError, match="unknown built-in model"):
        load_model("builtin:huge")


def test_gradient_checkpointing_gives_same_grads(tiny_dir):
    a = load_model(str(tiny_dir))
    b = load_model(str(tiny_dir))
    b.enable_gradient_checkpointing()
    a.model.train()
    b.model.train()
    x = torch.randint(0, 256, (2, 16))
    ga = torch.autograd.grad(a.logits(x).logsumexp(-1).sum(), list(a.model.parameters()))
    gb = torch.autograd.grad(b.logits(x).logsumexp(-1).sum(), list(b.model.parameters()))
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on GPU needs CUDA; this machine has none")
def test_bf16_on_gpu_fp32_accumulation(tiny_dir):
    mp = load_model(str(tiny_dir), dtype="auto", device="cuda")
    assert next(mp.model.parameters()).dtype == torch.bfloat16
    ids = torch.randint(0, 256, (1, 8), device="cuda")
    lp = mp.target_logprobs(ids, None, torch.tensor([0], device="cuda"), torch.tensor([3], device="cuda"), ids[0, 3:4])
    assert lp.dtype == torch.float32


# --------------------------------------------------------------------------- the chunked output head
def _plain_head(h, w, t):
    return torch.log_softmax((h.double() @ w.double().t()), -1).gather(-1, t[:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 128])
def test_chunked_head_fp32_fast_path_matches_full_logits(chunk):
    """The in-place fp32 path (one reused block, grads without scattering) equals full log-softmax.

    37 rows: every chunk size leaves a short last chunk. Some upstream gradients are 0 and
    some targets repeat (the index_add into grad_W must accumulate them).
    """
    from dllm_align.models.predictor import chunked_target_logprobs

    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = (torch.randn(500, 16, generator=g) * 0.5).requires_grad_(True)
    t = torch.randint(0, 20, (37,), generator=g)  # few distinct targets: repeats
    gout = torch.randn(37, generator=g)
    gout[::5] = 0.0
    ref = _plain_head(h, w, t)
    rh, rw = torch.autograd.grad((ref * gout.double()).sum(), [h, w])
    fast = chunked_target_logprobs(h, w, t, chunk)
    assert fast.dtype == torch.float32
    fh, fw = torch.autograd.grad((fast * gout).sum(), [h, w])
    torch.testing.assert_close(fast.double(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(fh.double(), rh.double(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fw.double(), rw.double(), atol=2e-5, rtol=1e-4)


def test_chunked_head_one_sided_grads_and_bf16():
    """Only h or only W needing a gradient, and bf16 inputs (the GPU path), give the plain values."""
    from dllm_align.models.predictor import chunked_target_logprobs

    g = torch.Generator().manual_seed(2)
    h0 = torch.randn(20, 8, generator=g)
    w0 = torch.randn(90, 8, generator=g)
    t = torch.randint(0, 90, (20,), generator=g)
    h = h0.clone().requires_grad_(True)
    (gh,) = torch.autograd.grad(chunked_target_logprobs(h, w0, t, 6).sum(), [h])
    w = w0.clone().requires_grad_(True)
    (gw,) = torch.autograd.grad(chunked_target_logprobs(h0, w, t, 6).sum(), [w])
    hr, wr = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    rh, rw = torch.autograd.grad(_plain_head(hr, wr, t).sum(), [hr, wr])
    torch.testing.assert_close(gh.double(), rh.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw.double(), rw.double(), atol=1e-5, rtol=1e-5)
    hb, wb = h0.bfloat16().requires_grad_(True), w0.bfloat16().requires_grad_(True)
    out = chunked_target_logprobs(hb, wb, t, 6)
    assert out.dtype == torch.float32
    bf16_logits = (hb.detach() @ wb.detach().t()).float()  # what full logits in bf16 give
    want = torch.log_softmax(bf16_logits, -1).gather(-1, t[:, None]).squeeze(-1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    bh, bw = torch.autograd.grad(out.sum(), [hb, wb])
    assert bh.dtype == torch.bfloat16 and bw.dtype == torch.bfloat16
    torch.testing.assert_close(bw.double(), rw.double(), atol=0.05, rtol=0.05)


def test_chunked_head_fp32_gradients_close_to_float64():
    """fp32 gradients of the chunked head stay within 1.5e-7 (relative norm) of a float64 computation.

    Keeping the one-hot term out of the [chunk, V] matmuls makes them ~4e-8 here; scaling
    the softmax block and scattering into it (the earlier form) gave ~3e-7.
    """
    from dllm_align.models.predictor import chunked_target_logprobs

    g = torch.Generator().manual_seed(3)
    w = torch.randn(5000, 64, generator=g) * 0.02
    h = torch.randn(300, 64, generator=g)
    t = torch.randint(0, 300, (300,), generator=g)
    up = torch.randn(300, generator=g)
    hd, wd = h.double().requires_grad_(True), w.double().requires_grad_(True)
    rh, rw = torch.autograd.grad((_plain_head(hd, wd, t) * up.double()).sum(), [hd, wd])
    a, b = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    gh, gw = torch.autograd.grad((chunked_target_logprobs(a, b, t, 128) * up).sum(), [a, b])
    assert float((gh.double() - rh).norm() / rh.norm()) < 1.5e-7
    assert float((gw.double() - rw).norm() / rw.norm()) < 1.5e-7


# --------------------------------------------------------------------------- attention kernel, qkv biases
def test_llada_attn_implementation_is_honoured_or_refused_by_name(tmp_path):
    import importlib.util

    _write_llada(tmp_path / "llada")
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    sdpa = load_model(str(tmp_path / "llada"))
    assert sdpa.model.config._attn_implementation == "sdpa"
    eager = load_model(str(tmp_path / "llada"), attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(eager.logits(ids), sdpa.logits(ids), atol=1e-5, rtol=1e-5)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(UserError, match="model.attn_implementation: flash_attention_2 is not available"):
            load_model(str(tmp_path / "llada"), attn_implementation="flash_attention_2")


def test_llada_include_qkv_bias_loads_with_biases_on_q_k_v_only(tmp_path):
    """A past failure: include_qkv_bias was refused with a misleading 'missing o_proj.bias'."""
    tok = build_tiny_tokenizer()
    cfg = _llada_config(len(tok))
    sd = _llada_state(cfg)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(plain)
    save_file(sd, str(plain / "model.safetensors"))
    biased = tmp_path / "biased"
    biased.mkdir()
    (biased / "config.json").write_text(json.dumps(dict(cfg, include_qkv_bias=True)))
    tok.save_pretrained(biased)
    g = torch.Generator().manual_seed(3)
    bsd = dict(sd)
    for i in range(cfg["n_layers"]):
        for n in ("q_proj", "k_proj", "v_proj"):
            bsd[f"model.transformer.blocks.{i}.{n}.bias"] = torch.zeros(cfg["d_model"])
    bsd["model.transformer.blocks.0.v_proj.bias"] = torch.randn(cfg["d_model"], generator=g) * 0.1
    save_file(bsd, str(biased / "model.safetensors"))
    a, b = load_model(str(plain)), load_model(str(biased))
    attn = b.model.model.layers[0].self_attn
    assert attn.o_proj.bias is None and attn.q_proj.bias is not None
    torch.testing.assert_close(attn.v_proj.bias, bsd["model.transformer.blocks.0.v_proj.bias"])
    ids = torch.randint(0, 200, (1, 7), generator=g)
    with torch.no_grad():
        la, lb = a.logits(ids), b.logits(ids)
    assert (la - lb).abs().max() > 1e-4  # the v bias is used ...
    attn.v_proj.bias.data.zero_()
    with torch.no_grad():
        torch.testing.assert_close(b.logits(ids), la, atol=1e-5, rtol=1e-5)  # ... and nothing else differs


def test_a_transformers_that_ignores_is_causal_is_refused():
    """transformers 5.0 and 5.1 build a causal mask whatever config.is_causal says (the suite's
    bidirectionality test fails there): loading refuses them by name, and the install floor is the same."""
    import tomllib

    from dllm_align.core.errors import UserError
    from dllm_align.models.load import MIN_TRANSFORMERS, require_transformers

    with pytest.raises(UserError, match=r"transformers 5\.1\.0 is too old: before 5\.2 it ignores is_causal=False"):
        require_transformers("5.1.0")
    require_transformers("5.2.0")
    require_transformers("5.24.0")
    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers>={MIN_TRANSFORMERS},<6" in deps
