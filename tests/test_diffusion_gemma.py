"""DiffusionGemma: the family (native loading of the published layout, the shrunk published config, tokenizer,
stop tokens, LoRA on tied stacks)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dllm_align.core.errors import UserError
from dllm_align.models.families import detect_family, family_for_config
from dllm_align.models.families import diffusion_gemma as dg
from dllm_align.models.load import load_model

FIXTURE = Path(__file__).parent / "fixtures" / "diffusiongemma_26b_a4b_it_config.json"
SHRINK = {"hidden_size": 64, "head_dim": 16, "global_head_dim": 32, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_global_key_value_heads": 1, "num_experts": 4, "top_k_experts": 2, "num_hidden_layers": 6,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 16,
          "max_position_embeddings": 4096, "dtype": "float32"}


def shrunk_published(tok) -> dict:
    """The hub's config.json, field for field, with the sizes shrunk and the tiny tokenizer's ids."""
    cfg = json.loads(FIXTURE.read_text())
    cfg["text_config"].update(SHRINK, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg["eos_token_id"] = [tok.eos_token_id, tok.convert_tokens_to_ids(dg.TURN_CLOSE)]
    cfg["canvas_length"] = 8
    cfg["vision_config"] = dict(dg.TINY_VISION)  # the class always builds the tower: shrunk, by name
    return cfg


@pytest.fixture(scope="module")
def shrunk_folder(tmp_path_factory) -> Path:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    tok = dg.build_tokenizer()
    cfg = shrunk_published(tok)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(**copy.deepcopy(cfg)))
    folder = tmp_path_factory.mktemp("dg") / "shrunk"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny-diffusiongemma")


def test_published_config_fixture_is_claimed_by_the_family():
    cfg = json.loads(FIXTURE.read_text())
    assert cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"] and cfg["canvas_length"] == 256
    assert cfg["text_config"]["num_experts"] == 128 and cfg["text_config"]["vocab_size"] == 262144
    assert detect_family(cfg).name == "diffusion_gemma"
    assert family_for_config({"model_type": "diffusion_gemma"}).likelihood == "uniform"


def test_shrunk_published_folder_loads_natively(shrunk_folder):
    from transformers import DiffusionGemmaForBlockDiffusion

    mp = load_model(str(shrunk_folder))
    assert isinstance(mp.model, DiffusionGemmaForBlockDiffusion)
    assert mp.family.name == "diffusion_gemma" and mp.likelihood == "uniform" and mp.model.config.canvas_length == 8
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(shrunk_folder).eval()
    for (k, a), b in zip(mp.model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    # the vision tower is loaded but frozen and never run
    assert not any(p.requires_grad for p in mp.model.model.encoder.vision_tower.parameters())
    assert all(p.requires_grad for p in mp.model.model.decoder.parameters())
    # tied stacks: the encoder's weights are the decoder's
    enc, dec = mp.model.model.encoder.language_model.layers[0], mp.model.model.decoder.layers[0]
    assert enc.self_attn.q_proj.weight is dec.self_attn.q_proj.weight


def test_old_transformers_refused_by_name(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.10.0")
    with pytest.raises(UserError, match="transformers >= 5.11"):
        dg.require_classes()


def test_bidirectional_encoder_refused_by_name():
    cfg = json.loads(FIXTURE.read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(UserError, match="use_bidirectional_attention"):
        dg.check_config(cfg)


def test_tokenizer_chat_template_and_stop_tokens(tiny):
    tok = tiny.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n"
    names = [tok.convert_ids_to_tokens(i) for i in tiny.stop_token_ids]
    assert names == ["<turn|>", "<eos>", "<|tool_response>"]
    assert tok.pad_token == "<pad>"


def test_builtin_is_deterministic_and_has_the_published_pattern(tiny):
    from dllm_align.models.load import BUILTIN_SPECS, build_tiny_model

    again = build_tiny_model(spec=BUILTIN_SPECS["builtin:tiny-diffusiongemma"])
    assert all(torch.equal(a, b) for a, b in zip(tiny.model.state_dict().values(), again.state_dict().values()))
    tc = tiny.model.config.get_text_config()
    assert tc.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert tiny.model.model.decoder.layers[5].self_attn.v_proj is None  # full layers: values are the keys


def test_lora_adapters_shared_by_the_tied_stacks(tiny):
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(tiny.model)
    names = dg.lora_modules(model, ["q_proj", "v_proj"])
    assert names and all(".decoder.layers." in n for n in names)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=names))
    assert dg.share_adapters(model) == len(names)
    inner = model.model  # get_peft_model injects in place
    assert inner.encoder.language_model.layers[0].self_attn.q_proj is inner.decoder.layers[0].self_attn.q_proj
    with pytest.raises(UserError, match="target_modules"):
        dg.lora_modules(tiny.model, ["query_key_value"])
