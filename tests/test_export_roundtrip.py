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
* the round trip: the exported folder, with the published remote code beside it (from the source folder, or for
  the built-in LLaDA from ``model.published_code``), loaded the way the published code loads it
  (``AutoModelForCausalLM`` / ``AutoModel`` ``.from_pretrained(..., trust_remote_code=True)``; dllm's LLaDA-MoE class
  named explicitly, as dllm loads it) in another interpreter with the transformers that code pins
  (tests/fixtures/published_forward.py; logits back as safetensors), gives the trained model's logits, and its
  tokenizer, loaded there by ``AutoTokenizer``, the trained tokenizer's ids and chat turn; so do the packaged toy
  bases' exports and SDAR-4B-Chat's own tokenizer files; and SDAR's ``generate.py`` decodes from a trained ``final/``
  (tests/fixtures/published_sdar_generate.py) as dllm-align's block rule does. The published
  files come from ``$DLLM_ALIGN_PUBLISHED_DIR``, the interpreters from ``$DLLM_ALIGN_PUBLISHED_PYTHON_SDAR`` and
  ``$DLLM_ALIGN_PUBLISHED_PYTHON_DLLM`` (tests/fixtures/published.py); without them the test skips saying how to
  set them up;
* a built-in model's export, which has no published code to carry, names no ``auto_map`` unless
  ``model.published_code`` supplies the files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dllm_align.models.export import (copy_remote_code, missing_remote_code, published_config,
                                      remote_code_files)
from dllm_align.models.families import FAMILIES
from fixtures.family_checkpoints import (dream_config, dream_state, llada2_config, llada2_state, lladamoe_config,
                                         lladamoe_state, sdar_config, sdar_state, write_checkpoint)
from fixtures.published import require, require_python

# the families with a published layout to export into
PUBLISHED = sorted(name for name, fam in FAMILIES.items() if fam.published is not None)

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
    # LLaDA2.1's hub config.json has LLaDA2.0's identity (its remote code tells it apart: tests/test_llada21.py)
    return {"sdar": sdar_config(tok), "llada2": llada2_config(tok), "llada21": llada2_config(tok), "dream": dream_config(dtok),
            "llada_moe": lladamoe_config(tok), "llada": dict(LLADA_SOURCE)}


@pytest.mark.parametrize("family", PUBLISHED)
def test_published_config_keeps_the_sources_identity(family):
    source = source_configs()[family]
    trained = {"model_type": "qwen3", "dtype": "bfloat16", "dllm_align_family": family, "hidden_size": 1}
    out = published_config(family, trained, source)
    for key in PUBLISHED_FIELDS:
        assert out[key] == source[key], key
    assert out["torch_dtype"] == "bfloat16" and "dllm_align_family" not in out and "dtype" not in out
    assert out["mask_token_id"] == source.get("mask_token_id", FAMILIES[family].mask_token_id)
    if FAMILIES[family].block_size:
        assert out["block_size"] == source.get("block_size", FAMILIES[family].block_size)


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
    cfg = {"auto_map": dict(FAMILIES["sdar"].published.auto_map)}
    assert [p.name for p in remote_code_files(tmp_path, cfg)] == ["configuration_sdar.py", "fused_ce.py",
                                                                  "modeling_sdar.py"]
    dest = tmp_path / "out"
    dest.mkdir()
    assert copy_remote_code(tmp_path, dest, cfg) == ["configuration_sdar.py", "fused_ce.py", "modeling_sdar.py"]
    assert (dest / "modeling_sdar.py").read_text().startswith("from .configuration_sdar")


def test_remote_code_files_follow_every_local_import_read_with_ast(tmp_path):
    """What a copied module imports from its folder is copied too, however it is written (``from . import x``, an
    import inside a ``try`` or a function, ``import x`` of a sibling file); the code is parsed, never run."""
    (tmp_path / "configuration_sdar.py").write_text("raise SystemExit('never run')\n")
    (tmp_path / "modeling_sdar.py").write_text(
        "import torch\nfrom . import helper\ntry:\n    from .fused import F\nexcept ImportError:\n    pass\n"
        "def f():\n    import sibling\n    return sibling\n")
    for name in ("helper", "fused", "sibling", "unused"):
        (tmp_path / f"{name}.py").write_text("X = 1\n")
    (tmp_path / "fused.py").write_text("from .deeper import D\n")
    (tmp_path / "deeper.py").write_text("D = 1\n")
    cfg = {"auto_map": dict(FAMILIES["sdar"].published.auto_map)}
    assert [p.name for p in remote_code_files(tmp_path, cfg)] == [
        "configuration_sdar.py", "deeper.py", "fused.py", "helper.py", "modeling_sdar.py", "sibling.py"]


@pytest.mark.parametrize("source,message", [
    ("from .fused_linear_diffusion_cross_entropy import L\n",
     r"modeling_sdar.py: imports .fused_linear_diffusion_cross_entropy \(line 1\), but .* has no "
     r"fused_linear_diffusion_cross_entropy.py"),
    ("try:\n    from . import gone\nexcept ImportError:\n    pass\n", r"imports .gone \(line 2\)"),
    ("from ..outside import X\n", r"imports ..outside \(line 1\), outside its folder"),
    ("from .pkg.sub import X\n", r"imports .pkg.sub \(line 1\), outside its folder"),
    ("def broken(:\n", r"modeling_sdar.py: not Python the published code can import \(line 1"),
])
def test_a_missing_or_unreadable_local_import_is_refused_by_name_before_training(tmp_path, source, message):
    """The published loader copies a module's relative imports beside it: one the folder lacks (SDAR's modeling file
    imports fused_linear_diffusion_cross_entropy.py), one outside the folder, or a file that does not parse is refused
    naming it, by the check that runs before the first step (``check_remote_code``, on ``model.published_code`` too)."""
    from dllm_align.core.errors import UserError
    from dllm_align.models.export import check_remote_code

    (tmp_path / "configuration_sdar.py").write_text("X = 1\n")
    (tmp_path / "modeling_sdar.py").write_text(source)
    with pytest.raises(UserError, match=message):
        check_remote_code(tmp_path, {"architectures": ["SDARForCausalLM"]}, "sdar")


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


def _export(mp, out: Path, source, code=None):
    """``final/`` as training writes it (``training.checkpoint.export`` with ``final=True``)."""
    from types import SimpleNamespace

    from dllm_align.config.schema import LoraSection
    from dllm_align.training.checkpoint import Saver, export

    saver = Saver(SimpleNamespace(unwrap_model=lambda m: m), SimpleNamespace(model=mp.model), mp.tokenizer,
                  False, 0, True)
    sd = {"model." + k: v for k, v in mp.model.state_dict().items()}  # the PolicyScorer's names
    export(saver, out, sd, LoraSection(), "source", final=True, source=source, code=code, tokenizer_source=source)
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
    layout = FAMILIES[family].published
    if source is not None:  # the source's own identity and its remote code and generation config
        assert {k: written.get(k) for k in PUBLISHED_FIELDS} == {k: source[k] for k in PUBLISHED_FIELDS}
        for ref in source["auto_map"].values():
            assert (out / f"{ref.rsplit('.', 1)[0]}.py").is_file()
        assert (out / "generation_config.json").is_file()
    else:
        assert written["model_type"] == layout.model_type and written["architectures"] == list(layout.architectures)
        assert "auto_map" not in written  # no published code to name (test_a_builtin_export_...)
    assert "dllm_align_family" not in written and "is_causal" not in written
    assert written["mask_token_id"] == mp.mask_token_id
    if FAMILIES[family].block_size:
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
# dllm's LLaDA-MoE code is not the hub's remote code (its config class is ``LLaDAMoEConfig``, the hub's auto_map names
# ``LLaDAConfig``); dllm loads LLaDA-MoE checkpoints with its class, so the round trip does the same.
BY_CLASS = {"llada_moe": "LLaDAMoEModelLM"}
# dllm's LLaDAModelLM builds its body with ``init_device = "cuda"`` hard-coded (the hub's file, which dllm copied,
# says "cpu"); where CUDA is absent the test's copy of that file has the hub's line, nothing else changed.
LLADA_INIT = ('model_config.init_device = "cuda"', 'model_config.init_device = "cpu"')
FORWARD = Path(__file__).parent / "fixtures" / "published_forward.py"


def published_logits(python: str, folder: Path, inputs: dict, tmp_path: Path, cls: str = ""):
    """The logits of ``folder`` loaded by its published code in interpreter ``python`` (tests/fixtures/
    published_forward.py), and the name of the class it built. Inputs and logits travel as safetensors."""
    import os
    import subprocess

    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # that interpreter's own transformers
    args = [python, str(FORWARD), str(folder), str(tmp_path / "inputs.safetensors"), str(tmp_path / "logits.safetensors")]
    proc = subprocess.run(args + ([cls] if cls else []), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with safe_open(str(tmp_path / "logits.safetensors"), framework="pt") as f:
        return f.get_tensor("logits"), f.metadata()["class"], json.loads(f.metadata()["tokenizer"])


def published_tokenizer(python: str, folder: Path, tmp_path: Path) -> dict:
    """``folder``'s tokenizer as the published code loads it in interpreter ``python``
    (tests/fixtures/published_forward.py ``--tokenizer``): its class, the sample's ids, the chat turn."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "tokenizer.json"
    proc = subprocess.run([python, str(FORWARD), "--tokenizer", str(folder), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def assert_same_tokenizer(report: dict, tok) -> None:
    """The published stack's reading of an exported tokenizer (``report``) encodes the sample and renders the chat
    turn as ``tok``, the tokenizer the model was trained with, does."""
    from fixtures.published_forward import SAMPLE_CHAT, SAMPLE_TEXT

    assert report["class"] != "TokenizersBackend"
    assert report["ids"] == tok(SAMPLE_TEXT)["input_ids"]
    want = tok.apply_chat_template(SAMPLE_CHAT, add_generation_prompt=True, tokenize=False) if tok.chat_template else None
    assert report["chat"] == want
    assert report["mask_token"] == tok.mask_token


def round_trip(family: str, tmp_path: Path, python: str, code_file: Path) -> float:
    """Max |logit difference| between a model loaded by dllm-align and its ``final/`` export loaded by the published
    code (asserting the published class is the one ``architectures`` names). A family with a shrunk published
    config: a checkpoint folder in that config carrying the published remote code, loaded by dllm-align and
    exported with the folder as its source (the code travels with the export). LLaDA: the built-in model, exported
    with ``code`` naming a folder of the published files (``model.published_code``)."""
    from dllm_align.models.load import load_model

    code_dir = code_file.parent
    if family == "llada":
        code = tmp_path / "code"
        shutil.copytree(code_dir, code)
        if not torch.cuda.is_available():
            text = (code / code_file.name).read_text()
            assert text.count(LLADA_INIT[0]) == 1
            (code / code_file.name).write_text(text.replace(*LLADA_INIT))
        mp, source = load_model(BUILTIN["llada"]), None
    else:
        source, cfg = _source_folder(family, tmp_path)
        for path in remote_code_files(code_dir, cfg):  # the published files in place of the stand-ins
            shutil.copyfile(path, source / path.name)
        mp, code = load_model(str(source)), None
    out = tmp_path / "final"
    cfg = _export(mp, out, source, code)
    cls = f"{code_file}:{BY_CLASS[family]}" if family in BY_CLASS else ""
    if not cls:
        assert "auto_map" in cfg and not missing_remote_code(out, cfg)
    V = min(cfg["vocab_size"], len(mp.tokenizer))
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs, kw = {"input_ids": ids}, {}
    if FAMILIES[family].block_size:  # the block families' published forward under a block-causal mask
        blk = torch.arange(ids.shape[1]) // mp.block_size
        allowed = (blk[:, None] >= blk[None, :]).expand(ids.shape[0], 1, -1, -1).contiguous()
        inputs |= {"attention_mask": allowed, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous()}
        kw = {"attention_mask": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min),
              "position_ids": inputs["position_ids"]}
    got, name, tokenizer = published_logits(python, out, inputs, tmp_path, cls)
    assert name == cfg["architectures"][0]
    assert_same_tokenizer(tokenizer, mp.tokenizer)
    with torch.no_grad():
        want = mp.model(input_ids=ids, **kw).logits.float()
    assert got.shape[:2] == want.shape[:2]
    return float((got[..., :want.shape[-1]] - want).abs().max())


@pytest.mark.parametrize("family", sorted(PUBLISHED_CODE))
def test_export_loaded_by_the_published_class_gives_the_trained_logits(family, tmp_path):
    """The exported folder, loaded as the published code loads it (``AutoModelForCausalLM``, ``AutoModel`` where
    the published ``auto_map`` names no causal-LM class, with ``trust_remote_code``) by an interpreter with the
    transformers that code was written for (``$DLLM_ALIGN_PUBLISHED_PYTHON``), gives the trained model's logits; its
    tokenizer, loaded there with ``AutoTokenizer``, encodes and renders the chat turn as the trained one."""
    repo, path = PUBLISHED_CODE[family]
    code_file = require(repo, path)
    python = require_python(repo)
    delta = round_trip(family, tmp_path, python, code_file)
    print(f"\n{family}: max |published - trained logit| = {delta:.3g}")  # the figure docs/serving.md records (-s)
    assert delta < 1e-4, delta


# The packaged toy bases and the published stack that reads each family's checkpoints (DiffusionGemma's is
# transformers 5 itself: tests/test_export_tokenizer.py reads its export in this interpreter).
TOY_BASES = {"sdar": ("builtin:toy-sort-base-sdar", "JetAstra/SDAR"), "llada": ("builtin:toy-sort-base", "ZHZisZZ/dllm"),
             "dream": ("builtin:toy-sort-base-dream", "ZHZisZZ/dllm"),
             "llada21": ("builtin:toy-sort-base-llada21", "ZHZisZZ/dllm")}


@pytest.mark.parametrize("family", sorted(TOY_BASES))
def test_a_toy_base_export_has_a_tokenizer_the_published_stack_reads(family, tmp_path):
    """A packaged toy base (its tokenizer saved by transformers 5) exported by training's export: its ``final/``
    tokenizer loads with ``AutoTokenizer.from_pretrained(final, trust_remote_code=True)`` in the interpreter of the
    family's published stack (transformers 4.52.4 for SDAR, 4.57.0 for dllm's families) and encodes and renders the
    chat turn as the tokenizer the model was trained with."""
    from dllm_align.models.load import load_model, resolve_model_path

    name, repo = TOY_BASES[family]
    python = require_python(repo)
    mp = load_model(name)
    out = tmp_path / "final"
    _export(mp, out, Path(resolve_model_path(name)))
    assert_same_tokenizer(published_tokenizer(python, out, tmp_path), mp.tokenizer)


# SDAR-4B-Chat's tokenizer as published: a slow Qwen2 tokenizer by auto_map (its own tokenization_qwen2.py), with
# vocab.json and merges.txt, the files transformers 5 alone would drop (its tokenizer.json is a Git LFS pointer there).
SDAR_TOKENIZER = ("tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json",
                  "chat_template.jinja", "tokenization_qwen2.py")


def test_sdars_published_tokenizer_is_exported_byte_for_byte_and_loads_in_its_stack(tmp_path):
    """A shrunk SDAR checkpoint carrying SDAR-4B-Chat's published tokenizer files: ``final/`` holds them byte for byte,
    and SDAR's interpreter loads it (``AutoTokenizer``, ``trust_remote_code``: the shipped slow ``Qwen2Tokenizer``) to
    the ids and chat turn of the tokenizer dllm-align trained with."""
    from dllm_align.models.load import load_model

    code_file = require("JetAstra/SDAR", PUBLISHED_CODE["sdar"][1])
    python = require_python("JetAstra/SDAR")
    source, _ = _source_folder("sdar", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (source / name).unlink(missing_ok=True)
    for name in SDAR_TOKENIZER:
        shutil.copyfile(code_file.parent / name, source / name)
    mp = load_model(str(source))
    out = tmp_path / "final"
    _export(mp, out, source)
    for name in SDAR_TOKENIZER:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not (out / "tokenizer.json").exists()  # none in the source: none written beside its files
    report = published_tokenizer(python, out, tmp_path)
    assert report["class"] == "Qwen2Tokenizer"
    assert_same_tokenizer(report, mp.tokenizer)


GENERATE = Path(__file__).parent / "fixtures" / "published_sdar_generate.py"


def test_sdars_generate_py_decodes_from_a_trained_final(tmp_path, fresh_accelerate):
    """SDAR's own ``generate.py`` (its ``block_diffusion_generate`` and the loading steps of its ``__main__``:
    tests/fixtures/published_sdar_generate.py) decodes from the ``final/`` of the packaged SDAR base trained two
    steps with ``model.published_code`` naming SDAR's published modeling folder, in SDAR's interpreter: the published
    class and the exported tokenizer load, the prompt is encoded as dllm-align encodes the turn, and its greedy
    decoding (top-k 1) fills the first block and is, token for token, dllm-align's own block rule at temperature 0
    with the same threshold (0.85), block (4) and steps (4) on the same folder."""
    import os
    import subprocess

    import yaml
    from typer.testing import CliRunner

    from dllm_align.cli.app import app
    from dllm_align.generate.block import block_generate
    from dllm_align.models.load import load_model
    from fixtures.sort_toy import write_pairs

    generate_py = require("JetAstra/SDAR", "generate.py")
    code_file = require("JetAstra/SDAR", PUBLISHED_CODE["sdar"][1])
    python = require_python("JetAstra/SDAR")
    recipe = {"name": "sdar", "model": {"name_or_path": "builtin:toy-sort-base-sdar",
                                        "published_code": str(code_file.parent)},
              "data": {"train": str(write_pairs(tmp_path / "pairs.jsonl", n=4)), "format": "paired", "max_length": 256},
              "reference": {"n_mc": 1}, "train": {"objective": "sft", "batch_size": 2, "max_steps": 2}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["train", str(path), "-o", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    final = tmp_path / "run" / "final"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "generated.json"
    proc = subprocess.run([python, str(GENERATE), str(generate_py), str(final), str(out), "16"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["model"] == "SDARForCausalLM" and got["tokenizer"] != "TokenizersBackend"
    mp = load_model(str(final))
    from fixtures.published_sdar_generate import PROMPT

    turn = [{"role": "user", "content": PROMPT}]
    prompt = mp.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    assert got["prompt_ids"] == mp.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert got["mask_id"] == mp.mask_token_id and got["mask_id"] not in got["ids"][:4]
    assert got["text"] == mp.tokenizer.decode(got["ids"], skip_special_tokens=False)
    canvas = block_generate(mp.model, torch.tensor(got["prompt_ids"]), mp.mask_token_id, 16, 4, 4, temperature=0.0,
                            threshold=0.85, stop_ids=[mp.tokenizer.eos_token_id])
    assert canvas[0, len(got["prompt_ids"]):].tolist() == got["ids"]  # the same canvas, masks left after the stop too
    print(f"\nSDAR generate.py from final/: {got['ids']} {got['text']!r}")  # the figure docs/serving.md records (-s)


def test_a_builtin_export_without_published_code_names_no_auto_map(tmp_path):
    """A built-in model has no published folder: its ``final/`` keeps the published identity the engines key on
    but leaves out an ``auto_map`` that would name files it does not carry; given a folder of the published code
    (``model.published_code``) it carries the files ``auto_map`` names (and their sibling imports)."""
    from dllm_align.core.errors import UserError
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-sdar")
    bare = _export(mp, tmp_path / "bare", None)
    assert bare["architectures"] == ["SDARForCausalLM"] and bare["model_type"] == "sdar" and "auto_map" not in bare
    assert not list((tmp_path / "bare").glob("*.py"))
    code = tmp_path / "code"
    code.mkdir()
    (code / "configuration_sdar.py").write_text("X = 1\n")
    (code / "modeling_sdar.py").write_text("from .configuration_sdar import X\nfrom .fused import Y\n")
    (code / "fused.py").write_text("Y = 2\n")
    with_code = _export(mp, tmp_path / "with_code", None, code)
    assert with_code["auto_map"] == FAMILIES["sdar"].published.auto_map
    assert sorted(p.name for p in (tmp_path / "with_code").glob("*.py")) == ["configuration_sdar.py", "fused.py",
                                                                             "modeling_sdar.py"]
    (code / "configuration_sdar.py").unlink()  # a module another one imports, missing: refused by name
    with pytest.raises(UserError, match=r"modeling_sdar.py: imports .configuration_sdar \(line 1\)"):
        _export(mp, tmp_path / "broken", None, code)
    (code / "modeling_sdar.py").write_text("from .fused import Y\n")  # a module only auto_map names: no auto_map
    assert "auto_map" not in _export(mp, tmp_path / "partial", None, code)


def test_published_code_reaches_an_export_whose_source_names_architectures_but_no_auto_map(tmp_path):
    """The packaged SDAR base's config.json names ``architectures`` but no ``auto_map``: ``model.published_code``
    still supplies the files and the published ``auto_map``, with ``fuse_cross_entropy`` (read by SDAR's forward,
    defaulted by no configuration class) filled as the published checkpoints have it; without the code, or with a
    code folder missing a module ``auto_map`` names, no ``auto_map``."""
    from dllm_align.models.load import load_model, resolve_model_path

    source = Path(resolve_model_path("builtin:toy-sort-base-sdar"))
    src_cfg = json.loads((source / "config.json").read_text())
    assert src_cfg["architectures"] == ["SDARForCausalLM"] and "auto_map" not in src_cfg
    assert "fuse_cross_entropy" not in src_cfg
    mp = load_model("builtin:toy-sort-base-sdar")
    code = tmp_path / "code"
    code.mkdir()
    (code / "configuration_sdar.py").write_text("X = 1\n")
    (code / "modeling_sdar.py").write_text("from .fused import Y\n")
    (code / "fused.py").write_text("Y = 2\n")
    cfg = _export(mp, tmp_path / "with_code", source, code)
    assert cfg["auto_map"] == FAMILIES["sdar"].published.auto_map and cfg["fuse_cross_entropy"] is True
    assert sorted(p.name for p in (tmp_path / "with_code").glob("*.py")) == ["configuration_sdar.py", "fused.py",
                                                                             "modeling_sdar.py"]
    assert "auto_map" not in _export(mp, tmp_path / "bare", source)
    (code / "configuration_sdar.py").unlink()
    assert "auto_map" not in _export(mp, tmp_path / "partial", source, code)
    kept = published_config("sdar", {"dtype": "float32"}, {**src_cfg, "fuse_cross_entropy": False})
    assert kept["fuse_cross_entropy"] is False  # a source's own value stays


def test_train_ships_the_published_code_named_by_the_recipe_and_refuses_a_missing_folder(tmp_path, fresh_accelerate):
    """`train` from a built-in model: with ``model.published_code`` its ``final/`` carries the files ``auto_map`` names
    and ``training_summary.json`` lists them; without it no ``auto_map``, said on stderr; a folder that does not exist
    is refused before training (exit 2, naming the key)."""
    import yaml
    from typer.testing import CliRunner

    from dllm_align.cli.app import app
    from fixtures.sort_toy import write_pairs

    code = tmp_path / "code"
    code.mkdir()
    for ref in FAMILIES["llada"].published.auto_map.values():  # stand-ins for LLaDA's published files
        (code / f"{ref.rsplit('.', 1)[0]}.py").write_text("# published remote code\n")
    recipe = {"name": "code", "model": {"name_or_path": "builtin:tiny", "published_code": str(code)},
              "data": {"train": str(write_pairs(tmp_path / "pairs.jsonl", n=4)), "format": "paired", "max_length": 64},
              "reference": {"n_mc": 1}, "train": {"objective": "sft", "batch_size": 2, "max_steps": 1}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    runner = CliRunner()
    res = runner.invoke(app, ["train", str(path), "-o", str(tmp_path / "with")])
    assert res.exit_code == 0, res.output
    final = tmp_path / "with" / "final"
    assert json.loads((final / "config.json").read_text())["auto_map"] == FAMILIES["llada"].published.auto_map
    assert json.loads((final / "training_summary.json").read_text())["remote_code"] == ["configuration_llada.py",
                                                                                        "modeling_llada.py"]
    res = runner.invoke(app, ["train", str(path), "-o", str(tmp_path / "without"), "--set", "model.published_code=null"])
    assert res.exit_code == 0, res.output
    final = tmp_path / "without" / "final"
    assert "auto_map" not in json.loads((final / "config.json").read_text())
    assert json.loads((final / "training_summary.json").read_text())["remote_code"] == []
    assert "names no auto_map" in res.stderr
    res = runner.invoke(app, ["train", str(path), "-o", str(tmp_path / "bad"), "--set",
                              f"model.published_code={tmp_path / 'nowhere'}"])
    assert res.exit_code == 2 and "model.published_code" in res.output, res.output
    assert not (tmp_path / "bad" / "final").exists()


@pytest.mark.parametrize("merged_dtype", ["bfloat16", "trained"])
def test_a_merged_lora_export_is_written_in_its_chosen_dtype_and_reloads_through_transformers(tmp_path, merged_dtype):
    """``final/`` of a LoRA run with merge_on_export: ``train.lora.merged_dtype: bfloat16`` writes bf16 safetensors
    shards (the merge computed in fp32 and rounded once) with a config.json that says so, which plain transformers
    loads (DiffusionGemma: transformers' own class and layout) to exactly those weights; ``trained`` (the default)
    keeps the weights as trained, fp32 here."""
    from types import SimpleNamespace

    from safetensors import safe_open
    from transformers import DiffusionGemmaForBlockDiffusion

    from dllm_align.config.schema import LoraSection
    from dllm_align.models.load import load_model
    from dllm_align.training.checkpoint import Saver, export, merged_state_dict

    mp = load_model("builtin:tiny-diffusiongemma")  # fp32 weights, as a CPU run trains them
    sd = {"model." + k: v for k, v in mp.model.state_dict().items()}
    key = "model.model.decoder.layers.0.self_attn.q_proj.weight"
    stem = key.removesuffix(".weight")
    w = sd.pop(key)
    g = torch.Generator().manual_seed(0)
    sd[f"{stem}.base_layer.weight"] = w  # the PolicyScorer's names for an adapted projection (peft's)
    sd[f"{stem}.lora_A.default.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.1
    sd[f"{stem}.lora_B.default.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.1
    lora = LoraSection(enabled=True, r=4, alpha=8, merged_dtype=merged_dtype)
    saver = Saver(SimpleNamespace(unwrap_model=lambda m: m), SimpleNamespace(model=mp.model), mp.tokenizer, False, 0, True)
    final = tmp_path / "final"
    export(saver, final, sd, lora, "builtin:tiny-diffusiongemma", final=True)
    want_dtype = torch.bfloat16 if merged_dtype == "bfloat16" else torch.float32
    files = sorted(final.glob("model*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), "pt") as h:
            assert {h.get_tensor(k).dtype for k in h.keys()} == {want_dtype}, f.name
    assert json.loads((final / "config.json").read_text())["dtype"] == str(want_dtype).removeprefix("torch.")
    merged = merged_state_dict(sd, lora)[0][key.removeprefix("model.")]
    assert merged.dtype == torch.float32 and not torch.equal(merged, w)  # the adapter changed the projection
    plain = DiffusionGemmaForBlockDiffusion.from_pretrained(final)
    got = plain.model.decoder.layers[0].self_attn.q_proj.weight
    assert got.dtype == want_dtype and torch.equal(got, merged.to(want_dtype))
    assert {p.dtype for p in plain.parameters()} == {want_dtype}
    assert (final / "adapter" / "adapter_model.safetensors").exists()  # the adapters beside it, as trained (fp32)
