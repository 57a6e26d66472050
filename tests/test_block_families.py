"""Block-diffusion families: SDAR loads natively and matches an independent forward under the
block-diffusion mask, and loads through the commands with the streams attention; LLaDA2.1 is told from LLaDA2.0
(LLaDA2.0's body: tests/test_llada2_body.py; LLaDA2.1: tests/test_llada21.py).

The SDAR fixture is the published SDAR-1.7B-Chat config.json field for field, sizes and token ids shrunk."""

import json
from pathlib import Path

import pytest
import torch

from dllm_align.core.errors import UserError
from dllm_align.models.families import family_for_config
from dllm_align.objective.block import streams_mask

from fixtures.family_checkpoints import sdar_state

FIXTURE = Path(__file__).parent / "fixtures" / "sdar_1.7b_chat_config.json"


def reference_sdar(sd: dict, cfg: dict, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """SDAR's forward in float64 from the facts: pre-norm RMSNorm blocks, per-head RMSNorm on q and k before
    rotary (rotate-half, base rope_theta, head_dim from the config), GQA, SwiGLU; ``allowed`` [T, T] bool."""
    w = {k: v.double() for k, v in sd.items()}
    eps, theta, hd = cfg["rms_norm_eps"], float(cfg["rope_theta"]), cfg["head_dim"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    T = ids.shape[0]

    def rms(x, wt):
        return wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rope(x):  # [h, T, hd]
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rms((a @ w[p + "self_attn.q_proj.weight"].T).view(T, H, hd), w[p + "self_attn.q_norm.weight"]).transpose(0, 1)
        k = rms((a @ w[p + "self_attn.k_proj.weight"].T).view(T, KV, hd), w[p + "self_attn.k_norm.weight"]).transpose(0, 1)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        s = (q @ k.transpose(-1, -2)) / hd ** 0.5
        o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
        x = x + o.transpose(0, 1).reshape(T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture
def sdar_folder(tmp_path):
    from safetensors.torch import save_file

    cfg = json.loads(FIXTURE.read_text())
    sd = sdar_state(cfg)
    folder = tmp_path / "sdar"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    return folder, cfg, sd


def test_sdar_loads_natively_and_matches_the_independent_forward_under_the_block_mask(sdar_folder):
    from dllm_align.objective.block import additive

    folder, cfg, sd = sdar_folder
    fam = family_for_config(cfg)
    assert fam.name == "sdar" and fam.block_size == cfg["block_size"] == 4
    model = fam.load_native(folder, cfg, torch.float32)
    assert model.config.mask_token_id == cfg["mask_token_id"]
    g = torch.Generator().manual_seed(0)
    length = 12
    x0 = torch.randint(0, 40, (length,), generator=g)
    xt = x0.clone()
    xt[[5, 6, 9]] = cfg["mask_token_id"]
    ids = torch.cat([xt, x0])
    pos = torch.arange(length).repeat(2)
    allowed = streams_mask(length, cfg["block_size"])
    with torch.no_grad():
        ours = model(input_ids=ids[None], position_ids=pos[None], attention_mask=additive(allowed, torch.float32),
                     use_cache=False).logits[0].double()
    ref = reference_sdar(sd, cfg, ids, pos, allowed)
    delta = float((ours - ref).abs().max())
    assert delta < 1e-4, delta
    # the mask matters: the same ids under a full bidirectional mask give other logits
    full = reference_sdar(sd, cfg, ids, pos, torch.ones_like(allowed))
    assert float((full - ref)[:length].abs().max()) > 1e-2


def test_sdar_moe_is_refused_by_the_native_loader(sdar_folder):
    folder, cfg, _ = sdar_folder
    cfg = dict(cfg, architectures=["SDARMoeForCausalLM"], num_experts=4)
    with pytest.raises(UserError, match="MoE variant"):
        family_for_config(cfg).load_native(folder, cfg, torch.float32)


@pytest.mark.filterwarnings("error::FutureWarning")  # the published `rope_scaling: null` stays quiet on load
def test_sdar_checkpoint_loads_through_the_commands_with_the_streams_attention(sdar_folder):
    from dllm_align.models.block_attention import STREAMS_ATTENTION
    from dllm_align.models.families.dream import build_dream_tokenizer
    from dllm_align.models.load import load_model

    folder, cfg, _ = sdar_folder
    build_dream_tokenizer().save_pretrained(folder)
    mp = load_model(str(folder), device="cpu")
    assert mp.family.name == "sdar" and mp.block_size == cfg["block_size"]
    assert mp.model.config._attn_implementation == STREAMS_ATTENTION
    with pytest.raises(UserError, match="not available for block-diffusion"):
        load_model(str(folder), device="cpu", attn_implementation="flash_attention_2")


def test_llada21_is_told_from_llada2_by_type_or_family_field():
    """The same class name; dllm's copy says llada21_moe, the hub's says llada2_moe like LLaDA2.0 (the folder's code
    or dllm_align_family then decides: tests/test_llada21.py)."""
    cfg = {"model_type": "llada21_moe", "architectures": ["LLaDA2MoeModelLM"], "vocab_size": 48, "hidden_size": 32}
    assert family_for_config(cfg).name == "llada21"
    assert family_for_config(dict(cfg, model_type="llada2_moe")).name == "llada2"
    assert family_for_config(dict(cfg, model_type="llada2_moe", dllm_align_family="llada21")).name == "llada21"


# --------------------------------------------------------------------------- hostile settings, refused where read
LLADA2_FIXTURE = Path(__file__).parent / "fixtures" / "llada2_mini_config.json"


@pytest.mark.parametrize("value", [0, -4, 2.5, True, "four", 10 ** 12])
def test_a_block_size_that_cannot_be_is_refused_naming_the_key(value):
    from dllm_align.training.memory import shape_from_config

    cfg = dict(json.loads(FIXTURE.read_text()), block_size=value)
    fam = family_for_config(cfg)
    assert "block_size" in fam.block_size_problem(cfg)
    with pytest.raises(UserError) as e:
        shape_from_config(cfg, "m/config.json")  # doctor's reading
    assert e.value.message.startswith("m/config.json: block_size")
    assert fam.block_size_problem(dict(cfg, block_size=8)) is None


@pytest.mark.parametrize("edit, key", [({"num_experts": 0}, "num_experts"), ({"num_experts": -8}, "num_experts"),
                                       ({"n_group": 0}, "n_group")])
def test_doctor_refuses_zero_experts_or_expert_groups(edit, key):
    from dllm_align.training.memory import shape_from_config

    with pytest.raises(UserError, match=f"m/config.json: {key}"):
        shape_from_config(dict(json.loads(LLADA2_FIXTURE.read_text()), **edit), "m/config.json")


def test_doctor_sizes_llada21_as_llada2():
    from dllm_align.training.memory import shape_from_config

    cfg = json.loads(LLADA2_FIXTURE.read_text())
    two, one = shape_from_config(cfg, "m"), shape_from_config(dict(cfg, model_type="llada21_moe"), "m")
    assert (one.params, one.likelihood, one.block_size) == (two.params, two.likelihood, two.block_size)


@pytest.mark.parametrize("edit, words", [({"sampler": "llada"}, "generate.sampler: llada: sdar is a block-diffusion model"),
                                         ({"sampler": "dream", "cache": "none", "threshold": None}, "generate.sampler: dream"),
                                         ({"cache": "dual"}, "generate.cache: dual")])
def test_a_decoding_rule_that_is_not_the_block_familys_is_refused_by_the_rule_registry(edit, words):
    from types import SimpleNamespace

    import dllm_align.generate.sampler  # noqa: F401 - registers the rules
    from dllm_align.generate.rules import settings_for
    from dllm_align.generate.settings import SamplerSettings
    from dllm_align.models.families import get_family

    mp = SimpleNamespace(block_size=4, family=get_family("sdar"))
    base = SamplerSettings(gen_length=8, block_length=4, steps=8, cache="prefix")
    settings_for(mp, base)  # the family's own rule in its own block length decodes
    with pytest.raises(UserError, match=words):
        settings_for(mp, base.replace(**edit))
