"""The model-family layer: native loading of each family's published layout, Dream's shifted
logits in the ELBO, and the family registry.

Dream's sampler: tests/test_dream_sampler.py. One ELBO-KTO step per family: tests/test_families_cli.py.
"""

from __future__ import annotations

import json
import itertools
import math

import pytest
import torch

from dllm_align.objective.elbo import DrawConfig, elbo_draws, exact_elbo
from dllm_align.core.errors import UserError
from dllm_align.models.families import FAMILIES, family_for_config
from dllm_align.models.load import build_tiny_tokenizer, load_model

from fixtures.family_checkpoints import (
    dream_config,
    dream_state,
    lladamoe_config,
    lladamoe_state,
    reference_logits,
    write_checkpoint,
)


def _dream(tmp_path, shards=1):
    tok = build_tiny_tokenizer("dream")
    cfg = dream_config(tok)
    sd = dream_state(cfg)
    return write_checkpoint(tmp_path / "dream", cfg, sd, tok, shards), cfg, sd


def _moe(tmp_path, shards=1, **kw):
    tok = build_tiny_tokenizer()
    cfg = lladamoe_config(tok, **kw)
    sd = lladamoe_state(cfg)
    return write_checkpoint(tmp_path / "moe", cfg, sd, tok, shards), cfg, sd


def _shift(raw):
    return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)


# --------------------------------------------------------------------------- registry
def test_every_family_declares_what_the_code_asks():
    for fam in FAMILIES.values():
        if fam.refuse_reason:  # recognised only to be refused with the reason (LLaDA2.1's token editing)
            assert fam.model_types and fam.block_size
            continue
        assert fam.model_types and fam.stop_tokens and fam.sampler in ("llada", "dream", "block", "diffusion_gemma", "llada21")
        assert fam.load_native is not None and fam.logit_shift in (0, 1)
        # a block family decodes block by block (the block rule, or LLaDA2.1's editing one)
        assert (fam.sampler in ("block", "llada21")) == bool(fam.block_size)
    assert family_for_config({"model_type": "Dream"}).logit_shift == 1
    assert family_for_config({"model_type": "llada"}).name == "llada"
    assert family_for_config({"model_type": "lladamoe"}).name == "llada_moe"
    assert family_for_config({"model_type": "qwen2", "dllm_align_family": "dream"}).name == "dream"  # a saved checkpoint
    assert family_for_config({"dllm_align_family": "tiny"}).name == "llada"  # older folders
    assert family_for_config({"model_type": "llama"}).name == "llada"  # unknown: LLaDA's manners


def test_family_is_detected_from_everything_the_config_says():
    # The hub's LLaDA-MoE config says model_type "llada", like LLaDA-8B's: the class names decide.
    moe = {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "num_experts": 64,
           "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig", "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"}}
    assert family_for_config(moe).name == "llada_moe"
    assert family_for_config({"model_type": "llada", "auto_map": moe["auto_map"]}).name == "llada_moe"  # auto_map alone
    assert family_for_config({"model_type": "llada", "num_experts": 64}).name == "llada_moe"  # the MoE fields alone
    assert family_for_config({"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 4096}).name == "llada"
    assert family_for_config({"model_type": "Dream", "architectures": ["DreamModel"]}).name == "dream"
    # claimed by two: one error naming what was read
    with pytest.raises(UserError, match=r"more than one model family \(llada, llada_moe\).*model_type 'llada'.*LLaDAMoEModelLM"):
        family_for_config({"model_type": "llada", "architectures": ["LLaDAModelLM", "LLaDAMoEModelLM"]})
    with pytest.raises(UserError, match=r"fields \['d_model', 'num_experts'\]"):
        family_for_config({"model_type": "llada", "d_model": 8, "num_experts": 4})


def test_a_folder_no_family_claims_is_one_error_naming_what_was_read(tmp_path):
    from dllm_align.models.load import load_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-dllm", "architectures": ["NoSuchModelLM"]}))
    with pytest.raises(UserError, match=r"no model family claims this config.json \(model_type 'no-such-dllm', architectures \['NoSuchModelLM'\]"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------- Dream
@pytest.mark.parametrize("shards", [1, 2])
def test_dream_native_matches_independent_forward(tmp_path, shards):
    folder, cfg, sd = _dream(tmp_path, shards)
    mp = load_model(str(folder))  # no trust_remote_code
    assert mp.family.name == "dream" and type(mp.model).__name__ == "Qwen2ForCausalLM"
    assert mp.mask_token_id == cfg["mask_token_id"] and mp.vocab_size == cfg["vocab_size"]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg["vocab_size"] - 4, (2, 11), generator=g)
    raw = reference_logits("dream", sd, cfg, ids)
    torch.testing.assert_close(mp.logits(ids).double(), _shift(raw), atol=2e-5, rtol=1e-4)
    # bidirectional: a change at the end reaches the first position's output
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 100
    assert not torch.allclose(mp.logits(ids2)[:, 1], mp.logits(ids)[:, 1])


def test_dream_left_padded_batch_equals_each_row_alone(tmp_path):
    folder, cfg, sd = _dream(tmp_path)
    mp = load_model(str(folder))
    a, b = [5, 9, 200, 7, 33, 12, 8], [71, 3, 99]
    pad = len(a) - len(b)
    ids = torch.tensor([a, [cfg["pad_token_id"]] * pad + b])
    am = torch.tensor([[1] * len(a), [0] * pad + [1] * len(b)])
    batched = mp.logits(ids, am)
    # A row's first position reads its own output alone but the padding's in a batch (the
    # published code does the same); it is always a prompt token, never scored nor decoded.
    torch.testing.assert_close(batched[1, pad + 1:], mp.logits(torch.tensor([b]))[0, 1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[0], mp.logits(torch.tensor([a]))[0], atol=1e-5, rtol=1e-5)
    raw = reference_logits("dream", sd, cfg, ids, am)
    torch.testing.assert_close(batched[1, pad + 1:].double(), raw[1, pad:-1], atol=2e-5, rtol=1e-4)


def test_dream_unsupported_option_is_named(tmp_path):
    folder, cfg, _ = _dream(tmp_path)
    cfg["use_sliding_window"] = True
    (folder / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises(UserError, match="use_sliding_window"):
        load_model(str(folder))


def test_dream_estimator_reads_the_previous_position(tmp_path):
    """target_logprobs at position j reads output j - 1 (position 0: its own), never output j."""
    folder, cfg, sd = _dream(tmp_path)
    mp = load_model(str(folder))
    ids = torch.tensor([[12, 40, 7, 88, 3, 150, 21]])
    rows = torch.zeros(4, dtype=torch.long)
    cols = torch.tensor([0, 1, 4, 6])
    tgt = torch.tensor([5, 6, 7, 8])
    got = mp.target_logprobs(ids, None, rows, cols, tgt)
    lp = torch.log_softmax(reference_logits("dream", sd, cfg, ids), -1)[0]
    want = torch.stack([lp[max(int(c) - 1, 0), int(t)] for c, t in zip(cols, tgt)])
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    unshifted = torch.stack([lp[int(c), int(t)] for c, t in zip(cols, tgt)])
    assert (got.double() - unshifted).abs().max() > 1e-2  # the test can tell the two apart


def test_dream_exact_elbo_enumeration_with_shifted_logits(tmp_path):
    """The exact ELBO from the raw (unshifted) model read at j - 1 by hand, the library's
    exact_elbo, and the Monte Carlo estimator all agree (and an unshifted reading does not)."""
    folder, _, _ = _dream(tmp_path)
    mp = load_model(str(folder))
    tok = mp.tokenizer
    p = tok("Q: 12", add_special_tokens=False)["input_ids"]
    c = tok("3a9!x", add_special_tokens=False)["input_ids"]
    L, P = len(c), len(p)
    full = torch.tensor(p + c)
    by_hand = unshifted = 0.0
    with torch.no_grad():
        for l in range(1, L + 1):
            subsets = list(itertools.combinations(range(L), l))
            for M in subsets:
                x = full.clone()
                x[[P + i for i in M]] = mp.mask_token_id
                lp = torch.log_softmax(mp.model(input_ids=x[None]).logits.double(), -1)[0]
                by_hand += sum(float(lp[P + i - 1, c[i]]) for i in M) / (l * len(subsets))
                unshifted += sum(float(lp[P + i, c[i]]) for i in M) / (l * len(subsets))
    exact = exact_elbo(mp, p, c)
    assert exact == pytest.approx(by_hand, rel=1e-5)
    assert abs(exact - unshifted) > 0.5
    K = 4000
    ids = full[None]
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, P:] = True
    with torch.no_grad():
        vals = elbo_draws(mp, ids, None, cm, ["row"], DrawConfig(n_mc=K, seed=5), max_rows_per_forward=1000)[0].double()
    se = float(vals.std()) / math.sqrt(K)
    assert abs(float(vals.mean()) - exact) < 4 * se, (float(vals.mean()), exact, se)
    assert abs(exact - unshifted) > 10 * se


# --------------------------------------------------------------------------- LLaDA-MoE
@pytest.mark.parametrize("shards", [1, 3])
def test_lladamoe_native_matches_independent_forward(tmp_path, shards):
    folder, cfg, sd = _moe(tmp_path, shards)
    mp = load_model(str(folder))
    assert mp.family.name == "llada_moe" and type(mp.model).__name__ == "Qwen3MoeForCausalLM"
    assert mp.family.logit_shift == 0
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg["vocab_size"], (2, 13), generator=g)
    raw = reference_logits("llada_moe", sd, cfg, ids)
    torch.testing.assert_close(mp.logits(ids).double(), raw, atol=2e-5, rtol=1e-4)


def test_lladamoe_left_padded_batch_equals_each_row_alone(tmp_path):
    folder, cfg, sd = _moe(tmp_path)
    mp = load_model(str(folder))
    a, b = [5, 9, 200, 7, 33, 12, 8, 40], [71, 3, 99, 4]
    pad = len(a) - len(b)
    ids = torch.tensor([a, [cfg["pad_token_id"]] * pad + b])
    am = torch.tensor([[1] * len(a), [0] * pad + [1] * len(b)])
    batched = mp.logits(ids, am)
    torch.testing.assert_close(batched[1, pad:], mp.logits(torch.tensor([b]))[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1, pad:].double(), reference_logits("llada_moe", sd, cfg, torch.tensor([b]))[0],
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("key,value", [("shared_expert_intermediate_size", 16), ("moe_router_enable_expert_bias", True),
                                       ("partial_rotary_factor", 0.5), ("qk_layernorm", False)])
def test_lladamoe_unsupported_option_is_named(tmp_path, key, value):
    folder, cfg, _ = _moe(tmp_path)
    cfg[key] = value
    (folder / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises(UserError, match=key):
        load_model(str(folder))


@pytest.mark.parametrize("key", ["partial_rotary_factor", "rope_theta"])
def test_lladamoe_config_omitting_a_field_with_a_surprising_published_default_is_refused(tmp_path, key):
    # The published configuration class has no rotary without partial_rotary_factor and rope_theta -1:
    # a config that omits either is refused by name rather than given another model's default.
    folder, cfg, _ = _moe(tmp_path)
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=f"{key} missing \\(the published default is"):
        load_model(str(folder))


def test_dream_config_without_rope_theta_takes_the_published_class_default(tmp_path):
    from dllm_align.models.families.dream import dream_config_to_qwen2

    tok = build_tiny_tokenizer("dream")
    cfg = dream_config(tok)
    del cfg["rope_theta"]
    assert dream_config_to_qwen2(cfg).rope_parameters["rope_theta"] == 10000.0  # DreamConfig's default, not 1e6


def test_lladamoe_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, cfg, _ = _moe(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="missing weights: model.layers.1.mlp.experts"):
        load_model(str(folder))


def test_saved_checkpoint_keeps_its_family(tmp_path):
    """A folder dllm-align writes (Qwen2 config with the family recorded) reloads as Dream."""
    mp = load_model("builtin:tiny-dream")
    mp.model.save_pretrained(tmp_path / "m")
    mp.tokenizer.save_pretrained(tmp_path / "m")
    again = load_model(str(tmp_path / "m"))
    assert again.family.name == "dream" and again.mask_token_id == mp.mask_token_id
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(again.logits(ids), mp.logits(ids))


def test_fsdp_wraps_the_family_decoder_layer(tmp_path):
    from types import SimpleNamespace

    from dllm_align.training.distributed import fsdp_wrap_family_layer

    for name, layer in (("builtin:tiny-dream", "Qwen2DecoderLayer"), ("builtin:tiny", "LlamaDecoderLayer")):
        plugin = SimpleNamespace(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
        fsdp_wrap_family_layer(plugin, load_model(name).model)
        assert plugin.transformer_cls_names_to_wrap == [layer]
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(load_model("builtin:tiny-dream").model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    plugin = SimpleNamespace(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    fsdp_wrap_family_layer(plugin, lora)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen2DecoderLayer"]
    folder, _, _ = _moe(tmp_path)
    plugin = SimpleNamespace(transformer_cls_names_to_wrap=None)
    fsdp_wrap_family_layer(plugin, load_model(str(folder)).model)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen3MoeDecoderLayer"]


def test_dream_remote_code_tokenizer_loads_through_its_native_twin(tmp_path):
    """Dream's tokenizer_config names a shipped class; the family loads Qwen2's tokenizer instead
    (without asking about remote code)."""
    import json

    folder, _, _ = _dream(tmp_path)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc |= {"tokenizer_class": "DreamTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    mp = load_model(str(folder))
    assert type(mp.tokenizer).__name__ == "Qwen2Tokenizer"
    ref = build_tiny_tokenizer("dream")
    text = "sort: 12<|im_end|>"
    assert mp.tokenizer(text)["input_ids"] == ref(text)["input_ids"]
    assert mp.stop_token_ids[0] == ref.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("which", ["dream", "llada_moe"])
def test_cached_window_forward_equals_the_full_forward(tmp_path, which):
    """The sampler's key/value forward on Qwen2 (Dream) and Qwen3-MoE (q/k norm) bodies: a window
    run against fresh kept keys/values gives exactly the full forward's hidden states there."""
    from dllm_align.generate.sampler import _KVForward

    folder = (_dream if which == "dream" else _moe)(tmp_path)[0]
    mp = load_model(str(folder))
    assert _KVForward.unsupported(mp.model) is None
    kvf = _KVForward(mp.model)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    pos = mp.position_ids(am, ids.shape, ids.device)
    h_full, kvs = kvf(ids, pos, am, want_kv=True)
    torch.testing.assert_close(h_full[0], mp.hidden(ids, am)[0], atol=1e-5, rtol=1e-5)
    lo, hi = 5, 9  # a dual-cache window: keys/values kept on both sides
    past = [(torch.cat([k[:, :, :lo], k[:, :, hi:]], 2), torch.cat([v[:, :, :lo], v[:, :, hi:]], 2)) for k, v in kvs]
    km = torch.cat([am[:, :lo], am[:, hi:]], dim=1)
    h_win, _ = kvf(ids[:, lo:hi], pos[:, lo:hi], torch.cat([km, am[:, lo:hi]], dim=1), past=past)
    torch.testing.assert_close(h_win, h_full[:, lo:hi], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["dream", "llada_moe"])
def test_rotary_frequencies_stay_fp32_after_a_bf16_load(tmp_path, which):
    folder = (_dream if which == "dream" else _moe)(tmp_path)[0]
    fp32 = load_model(str(folder)).model.model.rotary_emb.inv_freq
    mp = load_model(str(folder), dtype="bfloat16")
    rot = mp.model.model.rotary_emb
    assert mp.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, fp32)


def test_packaged_dream_format_base_loads_as_dream():
    mp = load_model("builtin:toy-sort-base-dream")
    assert mp.family.name == "dream" and type(mp.model).__name__ == "Qwen2ForCausalLM"
    assert mp.tokenizer.convert_ids_to_tokens(mp.stop_token_ids[0]) == "<|im_end|>"


# --------------------------------------------------------------------------- built-in models
def test_every_builtin_model_is_made_by_its_family():
    """load.py holds only the table: each built-in model and tokenizer comes from its family's record, and the
    model it makes is one its family claims, with a mask id and a stop token its tokenizer has."""
    from dllm_align.models.families import family_of, get_family
    from dllm_align.models.load import BUILTIN_SPECS, build_tiny_model
    from dllm_align.training.cache import state_dict_digest

    for name, spec in BUILTIN_SPECS.items():
        fam = get_family(spec.family)
        assert fam.build_tiny is not None and fam.tiny_tokenizer is not None, name
        tok = build_tiny_tokenizer(spec.family)
        assert tok.get_vocab() == fam.tiny_tokenizer().get_vocab() and tok.chat_template == fam.tiny_tokenizer().chat_template
        model = build_tiny_model(spec=spec)
        assert family_of(model) is fam, name
        assert model.config.mask_token_id == tok.mask_token_id, name
        assert any(t in tok.get_vocab() for t in fam.stop_tokens), name
        direct = fam.build_tiny(tok, spec.hidden_size, spec.layers, spec.heads, spec.intermediate_size,
                                spec.max_position_embeddings, spec.seed)
        assert state_dict_digest(model) == state_dict_digest(direct), name


def test_a_family_without_a_builtin_model_is_refused_by_name():
    from dllm_align.models.load import TinySpec, build_tiny_model

    with pytest.raises(UserError, match="'llada_moe' has no built-in model") as e:
        build_tiny_model(spec=TinySpec(family="llada_moe"))
    assert "llada, dream" in e.value.hint


def _build_toy(tok, *shape):
    from dllm_align.models.families.llada import build_llada_model

    model = build_llada_model(tok, *shape)
    model.config.dllm_align_family = "toy"
    return model


def _toy_family():
    import dataclasses

    from dllm_align.models.families.llada import LLADA

    return dataclasses.replace(LLADA, name="toy", model_types=(), architectures=(), signature=(), build_tiny=_build_toy,
                               published=None)


TOY = _toy_family()


@pytest.fixture
def toy_family():
    from pydantic import Field

    from dllm_align.config import components as registry

    class ToySettings(registry.ComponentSettings):
        width_note: int = Field(32, ge=1, description="A setting of the toy family's own.")

    comp = registry.register(registry.Component("family", "toy", f"{__name__}:TOY", settings=ToySettings,
                                                traits={"builtin_models": {"builtin:tiny-toy": {"hidden_size": 32, "layers": 1}}}))
    yield comp
    registry.unregister("family", "toy")  # declared for this test only


def test_a_new_family_brings_its_builtin_model_in_its_own_declaration(toy_family, tmp_path):
    """A family declared with a builder gets a ``builtin:`` model from its declaration, no other edit; its own
    setting shows in ``recipes show``, a bad value is refused by name, and it trains through ``train``."""
    import yaml
    from typer.testing import CliRunner

    from dllm_align.cli.app import app
    from dllm_align.models.families import family_of

    from fixtures.sort_toy import write_pairs

    mp = load_model("builtin:tiny-toy")
    assert family_of(mp.model) is TOY and mp.model.config.hidden_size == 32
    ids = mp.tokenizer("abc", add_special_tokens=False, return_tensors="pt").input_ids
    assert mp.logits(ids).shape == (1, 3, len(mp.tokenizer))

    runner = CliRunner()
    recipe = {"model": {"name_or_path": "builtin:tiny-toy", "toy": {"width_note": 7}},
              "data": {"train": str(write_pairs(tmp_path / "pairs.jsonl", n=2)), "format": "paired", "max_length": 64},
              "reference": {"n_mc": 2},
              "train": {"objective": "sft", "batch_size": 4, "max_steps": 1, "warmup_ratio": 0}}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    shown = runner.invoke(app, ["recipes", "show", str(path)])
    assert shown.exit_code == 0 and yaml.safe_load(shown.stdout)["model"]["toy"] == {"width_note": 7}
    bad = runner.invoke(app, ["recipes", "check", str(path), "--set", "model.toy.width_note=0"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.output
    assert "model.toy.width_note" in bad.stderr
    res = runner.invoke(app, ["train", str(path), "-o", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["dllm_align_family"] == "toy"
