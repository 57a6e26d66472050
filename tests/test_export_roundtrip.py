"""Exported checkpoints in each family's published layout (``dllm_align.models.export``; docs/serving.md).

Three checks per family:

* always on: the published config.json fields (``model_type``, ``architectures``, ``auto_map``, block size and mask
  id for the block families) of :func:`published_config`, from a shrunk published config and from a model with no
  published source;
* training's export (``training.checkpoint.export``, ``final=True``), from a shrunk published checkpoint folder and
  from a built-in model, for every family: the published identity, the source's remote code and generation config,
  the published weight names (LLaDA's ``model.transformer.*``, LLaDA-MoE's per-expert matrices), and dllm-align
  reading the folder back to the same logits; for Dream and LLaDA-MoE also an independent float64 forward of the
  published architecture on the exported names and config;
* the round trip: the exported folder, with the published remote code copied into it, loaded the way the
  published code loads it (``AutoModelForCausalLM`` / ``AutoModel`` ``.from_pretrained(..., trust_remote_code=True)``),
  gives the trained model's logits. The published files come from ``$DLLM_ALIGN_PUBLISHED_DIR`` (tests/fixtures/published.py);
  without them, or where they do not import (the published modeling files need transformers 4.5x: SDAR's imports
  ``flash_attn`` and ``transformers.modeling_attn_mask_utils``), the test skips saying so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dllm_align.models.export import LAYOUTS, copy_remote_code, published_config, remote_code_files
from fixtures.family_checkpoints import (dream_config, dream_state, llada2_config, llada2_state, lladamoe_config,
                                         lladamoe_state, sdar_config, sdar_state, write_checkpoint)
from fixtures.published import require

PUBLISHED_FIELDS = ("model_type", "architectures", "auto_map")

# A shrunk LLaDA-8B-Instruct config.json (the hub's fields; sizes shrunk).
LLADA_SOURCE = {
    "architectures": ["LLaDAModelLM"],
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "model_type": "llada", "d_model": 32, "n_heads": 4, "n_layers": 2, "mask_token_id": 126336, "vocab_size": 64,
}


def _tok(kind: str = ""):
    from dllm_align.models.load import build_tiny_tokenizer

    return build_tiny_tokenizer(kind) if kind else build_tiny_tokenizer()


def source_configs() -> dict:
    tok, dtok = _tok(), _tok("dream")
    return {"sdar": sdar_config(tok), "llada2": llada2_config(tok), "dream": dream_config(dtok),
            "llada_moe": lladamoe_config(tok), "llada": dict(LLADA_SOURCE)}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_published_config_keeps_the_sources_identity(family):
    source = source_configs()[family]
    trained = {"model_type": "qwen3", "dtype": "bfloat16", "dllm_align_family": family, "hidden_size": 1}
    out = published_config(family, trained, source)
    for key in PUBLISHED_FIELDS:
        assert out[key] == source[key], key
    assert out["torch_dtype"] == "bfloat16" and "dllm_align_family" not in out and "dtype" not in out
    assert out["mask_token_id"] == source.get("mask_token_id", LAYOUTS[family].mask_token_id)
    if LAYOUTS[family].block_size:
        assert out["block_size"] == source.get("block_size", LAYOUTS[family].block_size)


def test_published_config_of_a_model_with_no_source_is_the_familys_published_one():
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-sdar")
    trained = mp.model.config.to_dict()
    assert trained["model_type"] == "qwen3" and not trained.get("auto_map")  # what a plain save writes today
    out = published_config("sdar", trained)
    assert out["model_type"] == "sdar" and out["architectures"] == ["SDARForCausalLM"]
    assert out["auto_map"]["AutoModelForCausalLM"] == "modeling_sdar.SDARForCausalLM"
    assert out["block_size"] == mp.block_size and out["mask_token_id"] == mp.mask_token_id
    assert out["rope_theta"] == trained["rope_parameters"]["rope_theta"] and "is_causal" not in out


def test_remote_code_files_follow_auto_map_and_relative_imports(tmp_path):
    (tmp_path / "configuration_sdar.py").write_text("X = 1\n")
    (tmp_path / "modeling_sdar.py").write_text("from .configuration_sdar import X\nfrom .fused_ce import Y\n")
    (tmp_path / "fused_ce.py").write_text("Y = 2\n")
    (tmp_path / "unrelated.py").write_text("")
    cfg = {"auto_map": dict(LAYOUTS["sdar"].auto_map)}
    assert [p.name for p in remote_code_files(tmp_path, cfg)] == ["configuration_sdar.py", "fused_ce.py",
                                                                  "modeling_sdar.py"]
    dest = tmp_path / "out"
    dest.mkdir()
    assert copy_remote_code(tmp_path, dest, cfg) == ["configuration_sdar.py", "fused_ce.py", "modeling_sdar.py"]
    assert (dest / "modeling_sdar.py").read_text().startswith("from .configuration_sdar")


# --------------------------------------------------------------------------- training's export
def _source_folder(family: str, tmp_path: Path):
    tok = _tok("dream") if family == "dream" else _tok()
    cfg = source_configs()[family]
    sd = {"sdar": sdar_state, "llada2": llada2_state, "dream": dream_state, "llada_moe": lladamoe_state}[family](cfg)
    folder = write_checkpoint(tmp_path / "source", cfg, sd, tok)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id}))
    for ref in cfg.get("auto_map", {}).values():  # stand-ins for the published remote code the hub folder ships
        (folder / f"{ref.rsplit('.', 1)[0]}.py").write_text("# published remote code\n")
    return folder, cfg


def _export(mp, out: Path, source):
    """``final/`` as training writes it (``training.checkpoint.export`` with ``final=True``)."""
    from types import SimpleNamespace

    from dllm_align.config.schema import LoraSection
    from dllm_align.training.checkpoint import Saver, export

    saver = Saver(SimpleNamespace(unwrap_model=lambda m: m), SimpleNamespace(model=mp.model), mp.tokenizer,
                  False, 0, True)
    sd = {"model." + k: v for k, v in mp.model.state_dict().items()}  # the PolicyScorer's names
    export(saver, out, sd, LoraSection(), "source", final=True, source=source)
    return json.loads((out / "config.json").read_text())


BUILTIN = {"llada": "builtin:tiny", "dream": "builtin:tiny-dream", "sdar": "builtin:tiny-sdar",
           "llada2": "builtin:tiny-llada2"}
# (family, where the trained model came from): a published checkpoint folder, or a built-in model (no source)
CASES = [(f, "source") for f in ("sdar", "llada2", "dream", "llada_moe")] + [(f, "builtin") for f in sorted(BUILTIN)]


def _trained(family: str, origin: str, tmp_path: Path):
    from dllm_align.models.load import load_model

    if origin == "builtin":
        return load_model(BUILTIN[family]), None, None
    folder, source = _source_folder(family, tmp_path)
    return load_model(str(folder)), folder, source


@pytest.mark.parametrize("family,origin", CASES)
def test_training_export_is_in_the_published_layout_and_reloads_to_the_same_logits(family, origin, tmp_path):
    from dllm_align.models.families.base import safetensors_files
    from dllm_align.models.load import load_model
    from safetensors import safe_open

    mp, folder, source = _trained(family, origin, tmp_path)
    out = tmp_path / "final"
    written = _export(mp, out, folder)
    layout = LAYOUTS[family]
    if source is not None:  # the source's own identity and its remote code and generation config
        assert {k: written.get(k) for k in PUBLISHED_FIELDS} == {k: source[k] for k in PUBLISHED_FIELDS}
        for ref in source["auto_map"].values():
            assert (out / f"{ref.rsplit('.', 1)[0]}.py").is_file()
        assert (out / "generation_config.json").is_file()
    else:
        assert written["model_type"] == layout.model_type and written["architectures"] == list(layout.architectures)
        assert written["auto_map"] == layout.auto_map
    assert "dllm_align_family" not in written and "is_causal" not in written
    assert written["mask_token_id"] == mp.mask_token_id
    if layout.block_size:
        assert written["block_size"] == mp.block_size
    names = set()
    for f in safetensors_files(out):
        with safe_open(str(f), framework="pt") as sf:
            names |= set(sf.keys())
    if family == "llada":  # LLaDA's published names
        assert names and all(n.startswith("model.transformer.") for n in names), sorted(names)[:3]
    if family == "llada_moe":  # the published per-expert matrices, as the source had them
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in names) and not any("gate_up_proj" in n for n in names)
        assert names == set(lladamoe_state(source))
    back = load_model(str(out))
    ids = torch.randint(0, len(mp.tokenizer) - 1, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = mp.model(input_ids=ids).logits, back.model(input_ids=ids).logits
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize("family", ["dream", "llada_moe"])
def test_exported_weights_under_the_published_names_give_the_trained_logits_in_an_independent_forward(family, tmp_path):
    """The exported folder read as the published architecture reads it (an independent float64 forward written from
    the published modeling code, on the folder's own config.json and weight names)."""
    from dllm_align.models.families.base import safetensors_files
    from fixtures.family_checkpoints import reference_logits
    from safetensors.torch import load_file

    mp, folder, _ = _trained(family, "source", tmp_path)
    out = tmp_path / "final"
    cfg = _export(mp, out, folder)
    sd = {}
    for f in safetensors_files(out):
        sd |= load_file(str(f))
    ids = torch.randint(0, len(mp.tokenizer) - 1, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = mp.model(input_ids=ids).logits.double()
    got = reference_logits(family, sd, cfg, ids)
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


# --------------------------------------------------------------------------- the round trip through the published code
PUBLISHED_CODE = {
    "sdar": ("JetAstra/SDAR", "training/model/SDAR-4B-Chat/modeling_sdar.py"),
    "llada2": ("ZHZisZZ/dllm", "dllm/pipelines/llada2/models/modeling_llada2_moe.py"),
    "llada": ("ZHZisZZ/dllm", "dllm/pipelines/llada/models/modeling_llada.py"),
    "llada_moe": ("ZHZisZZ/dllm", "dllm/pipelines/llada/models/modeling_lladamoe.py"),
    "dream": ("ZHZisZZ/dllm", "dllm/pipelines/dream/models/modeling_dream.py"),
}


@pytest.mark.parametrize("family", sorted(PUBLISHED_CODE))
def test_export_loaded_by_the_published_class_gives_the_trained_logits(family, tmp_path):
    """The exported folder with the published remote code copied in (from ``$DLLM_ALIGN_PUBLISHED_DIR``), loaded as
    the published code loads it: ``AutoModelForCausalLM`` (``AutoModel`` where the published ``auto_map`` names no
    causal-LM class) with ``trust_remote_code``."""
    from transformers import AutoModel, AutoModelForCausalLM

    code_dir = require(*PUBLISHED_CODE[family]).parent
    mp, folder, _ = _trained(family, "builtin" if family == "llada" else "source", tmp_path)
    out = tmp_path / "final"
    cfg = _export(mp, out, None)  # the family's published identity, and the published code copied from the checkout
    for path in remote_code_files(code_dir, cfg):
        shutil.copyfile(path, out / path.name)
    auto = AutoModelForCausalLM if "AutoModelForCausalLM" in cfg["auto_map"] else AutoModel
    try:
        pub = auto.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    except ImportError as e:
        import transformers

        pytest.skip(f"the published {family} modeling code does not import under transformers "
                    f"{transformers.__version__} ({e}); run it where that code's transformers is installed")
    assert type(pub).__name__ == cfg["architectures"][0]
    ids = torch.randint(0, cfg["vocab_size"] - 1, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = {}
    if LAYOUTS[family].block_size:  # the block families' published forward under a block-causal mask
        blk = torch.arange(ids.shape[1]) // cfg["block_size"]
        allowed = blk[:, None] >= blk[None, :]
        kw["attention_mask"] = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        kw["position_ids"] = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = mp.model(input_ids=ids, **kw).logits
        got = pub(input_ids=ids, **kw).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
