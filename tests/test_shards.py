"""Loading with empty weights and reading them back by name (``models.shards``): for every family whose loader
reads each weight by name, a model made with empty storage and then filled from the files holds exactly the
weights of an ordinary load (here unsharded: each weight's rows are all of them; the FSDP2 launch, two processes
each reading its rows, is in tests/test_invariants_distributed.py); a family that transforms its weights as they
load (LLaDA-MoE's stacked experts) loads them as usual and says so (no sources)."""

from __future__ import annotations

import pytest
import torch

from dllm_align.models.load import build_tiny_tokenizer, load_model
from dllm_align.models.shards import read_weight_shards
from fixtures.family_checkpoints import (dream_config, dream_state, llada2_config, llada2_state, lladamoe_config,
                                         lladamoe_state, sdar_config, sdar_state, write_checkpoint)


def _folder(tmp_path, name):
    if name == "dream":
        tok = build_tiny_tokenizer("dream")
        cfg = dream_config(tok)
        return write_checkpoint(tmp_path / name, cfg, dream_state(cfg), tok, shards=2)
    if name == "sdar":
        tok = build_tiny_tokenizer("dream")
        cfg = sdar_config(tok)
        return write_checkpoint(tmp_path / name, cfg, sdar_state(cfg), tok, shards=2)
    tok = build_tiny_tokenizer()
    if name == "llada2":
        cfg = llada2_config(tok)
        return write_checkpoint(tmp_path / name, cfg, llada2_state(cfg), tok, shards=2)
    cfg = lladamoe_config(tok)
    return write_checkpoint(tmp_path / name, cfg, lladamoe_state(cfg), tok, shards=2)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["dream", "sdar", "llada2"])
def test_a_family_read_by_name_fills_an_empty_model_with_the_ordinary_weights(tmp_path, name):
    folder = _folder(tmp_path, name)
    want = load_model(str(folder), dtype="float32")
    got = load_model(str(folder), dtype="float32", empty=True)
    assert got.weight_sources and want.weight_sources is None
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert 0.9 * stored < read_weight_shards(got.model, got.weight_sources) <= stored  # every weight read once
    _same(got.model, want.model)


def test_a_transformers_layout_folder_is_read_by_name_too(tiny_dir):
    got = load_model(str(tiny_dir), empty=True)
    assert got.weight_sources
    read_weight_shards(got.model, got.weight_sources)
    _same(got.model, load_model(str(tiny_dir)).model)


def test_a_family_that_stacks_its_experts_loads_them_as_usual(tmp_path):
    folder = _folder(tmp_path, "moe")
    got = load_model(str(folder), dtype="float32", empty=True)
    assert got.weight_sources is None
    _same(got.model, load_model(str(folder), dtype="float32").model)


def test_a_weight_the_files_lack_is_named(tiny_dir):
    from dllm_align.core.errors import UserError

    got = load_model(str(tiny_dir), empty=True)
    sources = dict(got.weight_sources)
    sources.pop("model.norm.weight")
    with pytest.raises(UserError, match="model.norm.weight"):
        read_weight_shards(got.model, sources)
