"""The reference read weight by weight straight into its resident dtypes (``training.reference_model``): for every
family whose loader reads each weight by name, and under fp32 and bf16 autocast, the same weights, dtypes and
logits as the whole load at the weights' dtype followed by ``prepare_reference`` (what every process did before);
a family that transforms its weights as they load (LLaDA-MoE) is read whole as before. The FSDP2-sharded route
and precompute's lockstep run in tests/test_invariants_distributed.py."""

from __future__ import annotations

import pytest
import torch

from dllm_align.config.recipe import load_recipe
from dllm_align.models.load import build_tiny_model, build_tiny_tokenizer, load_from_section
from dllm_align.models.precision import prepare_reference
from dllm_align.training.reference import load_reference
from fixtures.family_checkpoints import (dream_config, dream_state, llada2_config, llada2_state, lladamoe_config,
                                         lladamoe_state, sdar_config, sdar_state, write_checkpoint)

FAMILIES = {"dream": ("dream", dream_config, dream_state), "sdar": ("dream", sdar_config, sdar_state),
            "llada2": ("", llada2_config, llada2_state), "llada_moe": ("", lladamoe_config, lladamoe_state)}


def _folder(tmp_path, name):
    if name.startswith("llada-"):  # the built-in LLaDA written by transformers, stored in bf16 or fp32
        tok = build_tiny_tokenizer()
        folder = tmp_path / name
        build_tiny_model(tok).to(getattr(torch, name.split("-")[1])).save_pretrained(folder, max_shard_size="40KB")
        tok.save_pretrained(folder)
        return folder
    kind, config, state = FAMILIES[name]
    tok = build_tiny_tokenizer(kind) if kind else build_tiny_tokenizer()
    cfg = config(tok)
    return write_checkpoint(tmp_path / name, cfg, state(cfg), tok, shards=2)


@pytest.mark.parametrize("mp", ["bf16", "no"])
@pytest.mark.parametrize("name", ["llada-bfloat16", "llada-float32", "dream", "sdar", "llada2", "llada_moe"])
def test_reference_read_by_name_holds_what_the_whole_load_and_cast_held(tmp_path, name, mp):
    folder = _folder(tmp_path, name)
    rec = load_recipe(None, [f"model.name_or_path={folder}", f"train.mixed_precision={mp}", "data.max_length=64"],
                      output_dir=str(tmp_path / "run"))
    got = load_reference(rec, "cpu")
    assert (got.weight_sources is not None) == (name != "llada_moe")  # stacked experts: read whole, as before
    want = load_from_section(rec.model.model_copy(update={"dtype": got.precision.weights_label}), "cpu",
                             name_or_path=str(folder))
    prepare_reference(want.model, got.precision)
    a, b = got.model.state_dict(), want.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if mp == "bf16":  # the Linears are stored in the compute dtype, the rest in fp32
        assert {str(v.dtype) for v in a.values()} == {"torch.bfloat16", "torch.float32"}
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mp == "bf16"):
        assert torch.equal(got.model(input_ids=ids).logits, want.model(input_ids=ids).logits)
