"""The tokenizer of an exported ``final/`` (``models.export.write_published_tokenizer``, ``training.checkpoint.
tokenizer_unchanged``): the files the source had, byte for byte where the tokenizer is unchanged, and a
tokenizer_config.json that the published stacks' transformers 4 reads (never transformers 5's ``TokenizersBackend``
class or its ``extra_special_tokens`` list). Runs in this interpreter; the published stacks' own reading of the same
folders is tests/test_export_roundtrip.py's (gated on their interpreters).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dllm_align.models.export import TOKENIZER_FILES, published_tokenizer_config
from dllm_align.models.families import family_for_config
from fixtures.family_checkpoints import sdar_config, sdar_state, write_checkpoint
from fixtures.published_forward import SAMPLE_CHAT, SAMPLE_TEXT

TOY_BASES = {"llada": "builtin:toy-sort-base", "dream": "builtin:toy-sort-base-dream",
             "sdar": "builtin:toy-sort-base-sdar", "llada21": "builtin:toy-sort-base-llada21",
             "diffusion_gemma": "builtin:toy-sort-base-gemma"}


def _export(mp, out: Path, source, code=None):
    """``final/`` as training writes it (``training.checkpoint.export`` with ``final=True``), the tokenizer read from
    ``source``."""
    from types import SimpleNamespace

    from dllm_align.config.schema import LoraSection
    from dllm_align.training.checkpoint import Saver, export

    saver = Saver(SimpleNamespace(unwrap_model=lambda m: m), SimpleNamespace(model=mp.model), mp.tokenizer,
                  False, 0, True)
    sd = {"model." + k: v for k, v in mp.model.state_dict().items()}
    export(saver, out, sd, LoraSection(), "source", final=True, source=source, code=code, tokenizer_source=source)
    return json.loads((out / "config.json").read_text())


def _files(folder: Path) -> dict:
    return {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}


def _reads_alike(a: Path, b: Path) -> None:
    """``AutoTokenizer`` reads folders ``a`` and ``b`` to the same ids, specials and chat turn."""
    from transformers import AutoTokenizer

    ta, tb = AutoTokenizer.from_pretrained(str(a)), AutoTokenizer.from_pretrained(str(b))
    assert ta(SAMPLE_TEXT)["input_ids"] == tb(SAMPLE_TEXT)["input_ids"]
    assert ta.get_vocab() == tb.get_vocab()
    assert sorted(map(str, ta.all_special_tokens)) == sorted(map(str, tb.all_special_tokens))
    assert ta.mask_token == tb.mask_token and ta.pad_token == tb.pad_token and ta.eos_token == tb.eos_token
    chat = dict(add_generation_prompt=True, tokenize=False)
    assert ta.apply_chat_template(SAMPLE_CHAT, **chat) == tb.apply_chat_template(SAMPLE_CHAT, **chat)


@pytest.mark.parametrize("family", sorted(TOY_BASES))
def test_a_toy_base_export_keeps_its_tokenizer_files_and_reads_alike(family, tmp_path):
    """The packaged toy bases' tokenizers were saved by transformers 5: the export keeps every file but
    tokenizer_config.json byte for byte, rewrites that one in transformers 4's form (no ``TokenizersBackend``, the
    specials as ``additional_special_tokens``), adds no other, and the folder reads as the source does. DiffusionGemma,
    whose published layout is transformers' own, also loses dllm-align's config keys and is still told by its
    ``model_type``."""
    from dllm_align.models.load import load_model, resolve_model_path

    source = Path(resolve_model_path(TOY_BASES[family]))
    mp = load_model(TOY_BASES[family])
    out = tmp_path / "final"
    cfg = _export(mp, out, source)
    want, got = _files(source), _files(out)
    assert set(got) == set(want)
    assert {n: got[n] == want[n] for n in want if n != "tokenizer_config.json"} == {n: True for n in want
                                                                                   if n != "tokenizer_config.json"}
    text = got["tokenizer_config.json"].decode()
    assert "TokenizersBackend" not in text and '"backend"' not in text
    tok_cfg = json.loads(text)
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "extra_special_tokens" not in tok_cfg
    assert tok_cfg["additional_special_tokens"] == json.loads(want["tokenizer_config.json"])["extra_special_tokens"]
    _reads_alike(out, source)
    assert "dllm_align_family" not in cfg or family == "llada21"  # LLaDA2.1 without its code: only the key tells it
    assert family_for_config(cfg).name == family and "is_causal" not in cfg


def _transformers4_source(tmp_path: Path, tok) -> Path:
    """A shrunk SDAR checkpoint whose tokenizer is in the published form (transformers 4): tokenizer.json with the
    slow tokenizer's vocab.json and merges.txt, special_tokens_map.json, a tokenizer_config.json naming its class."""
    folder = write_checkpoint(tmp_path / "source", sdar_config(tok), sdar_state(sdar_config(tok)), tok)
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" if isinstance(m, str) else f"{' '.join(m)}\n"
                                                                  for m in model["merges"]))
    specials = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                "mask_token": tok.mask_token, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        **specials, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False}, indent=2))
    return folder


def test_a_published_form_tokenizer_is_exported_byte_for_byte(tmp_path):
    """A source whose tokenizer is in the published form, unchanged by training: final/ holds exactly its files,
    byte for byte (transformers 5 alone would drop vocab.json and merges.txt and rewrite the rest)."""
    from dllm_align.models.load import build_tiny_tokenizer, load_model

    source = _transformers4_source(tmp_path, build_tiny_tokenizer("dream"))
    mp = load_model(str(source))
    out = tmp_path / "final"
    _export(mp, out, source)
    assert _files(out) == _files(source)
    assert {"vocab.json", "merges.txt"} <= set(_files(out))
    _reads_alike(out, source)


def test_a_tokenizer_changed_by_the_run_is_written_anew_beside_the_sources_vocabulary(tmp_path):
    """A tokenizer with a special token the source lacks: final/'s tokenizer is the trained one (the new token, its
    id), in transformers 4's form (the source's class, the token among ``additional_special_tokens``), with the
    source's vocab.json and merges.txt byte for byte beside it."""
    from transformers import AutoTokenizer

    from dllm_align.models.load import build_tiny_tokenizer, load_model

    source = _transformers4_source(tmp_path, build_tiny_tokenizer("dream"))
    mp = load_model(str(source))
    mp.tokenizer.add_special_tokens({"additional_special_tokens": ["<|new|>"]}, replace_extra_special_tokens=False)
    out = tmp_path / "final"
    _export(mp, out, source)
    files, want = _files(out), _files(source)
    assert files["vocab.json"] == want["vocab.json"] and files["merges.txt"] == want["merges.txt"]
    tok_cfg = json.loads(files["tokenizer_config.json"])
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "TokenizersBackend" not in files[
        "tokenizer_config.json"].decode()
    assert "<|new|>" in tok_cfg["additional_special_tokens"] and "<|im_end|>" in tok_cfg["additional_special_tokens"]
    assert not {"backend", "is_local", "local_files_only"} & set(tok_cfg)  # transformers 5's load arguments
    back = AutoTokenizer.from_pretrained(str(out))
    new_id = mp.tokenizer.convert_tokens_to_ids("<|new|>")
    assert back("a <|new|>")["input_ids"] == mp.tokenizer("a <|new|>")["input_ids"] and new_id in back("<|new|>")["input_ids"]


def test_published_tokenizer_config_maps_transformers_5_form_to_transformers_4_form():
    v5 = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "eos_token": "<e>", "is_local": True,
          "local_files_only": True, "extra_special_tokens": ["<a>", "<b>"], "additional_special_tokens": ["<b>"],
          "model_max_length": 8}
    assert published_tokenizer_config(v5) == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<e>",
                                              "additional_special_tokens": ["<b>", "<a>"], "model_max_length": 8}
    assert published_tokenizer_config(v5, "Qwen2Tokenizer")["tokenizer_class"] == "Qwen2Tokenizer"
    v4 = {"tokenizer_class": "Qwen2Tokenizer", "extra_special_tokens": {"image_token": "<img>"}}
    assert published_tokenizer_config(v4) == v4  # transformers 4's named extra tokens are its own form


def test_a_tokenizer_file_that_is_a_link_out_of_the_folder_is_refused_before_training(tmp_path):
    """The tokenizer's files are copied into final/: a link out of the folder is refused by name, before training."""
    from types import SimpleNamespace

    from dllm_align.core.errors import UserError
    from dllm_align.models.load import build_tiny_tokenizer, model_source
    from dllm_align.training.plan import check_export_sources

    source = _transformers4_source(tmp_path, build_tiny_tokenizer("dream"))
    recipe = SimpleNamespace(model=SimpleNamespace(published_code=None, tokenizer=None))
    check_export_sources(recipe, model_source(str(source)))  # as it is: nothing to refuse
    outside = tmp_path / "vocab.json"
    shutil.move(source / "vocab.json", outside)
    (source / "vocab.json").symlink_to(outside)
    with pytest.raises(UserError, match="vocab.json: a link out of its folder"):
        check_export_sources(recipe, model_source(str(source)))
    with pytest.raises(UserError, match="vocab.json: a link out of its folder"):  # model.tokenizer's folder too
        check_export_sources(SimpleNamespace(model=SimpleNamespace(published_code=None, tokenizer=str(source))),
                             model_source("builtin:tiny"))


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_is_accepted(tmp_path):
    """The Hugging Face cache stores each download once under ``blobs/`` and links it from ``snapshots/<rev>/``:
    those links are the cache's layout, so a model loaded from the hub is not refused. A link into another
    repository's blobs, or out of the cache, still is."""
    from types import SimpleNamespace

    from dllm_align.core.errors import UserError
    from dllm_align.models.load import build_tiny_tokenizer, model_source
    from dllm_align.training.plan import check_export_sources

    source = _transformers4_source(tmp_path / "src", build_tiny_tokenizer("dream"))
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(p for p in source.iterdir() if p.is_file())):
        shutil.copy(f, blobs / f"{i:040x}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"{i:040x}"))
    recipe = SimpleNamespace(model=SimpleNamespace(published_code=None, tokenizer=None))
    check_export_sources(recipe, model_source(str(snap)))  # the cache's own links: nothing to refuse

    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    shutil.move(snap.joinpath("vocab.json").resolve(), other / "stolen")
    (snap / "vocab.json").unlink()
    (snap / "vocab.json").symlink_to(other / "stolen")
    with pytest.raises(UserError, match="vocab.json: a link out of its folder"):
        check_export_sources(recipe, model_source(str(snap)))
