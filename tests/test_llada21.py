"""LLaDA2.1 (``dllm_align.models.families.llada21``, ``dllm_align.generate.llada21``; docs/llada21.md).

``fixtures/llada21_mini_config.json`` is LLaDA2.1-mini's published config.json as the hub page renders it (every key
it shows; ``vocab_size`` 157,184 from the model card, the rendering cut the key off). :func:`shrunk` keeps its fields and
shrinks the sizes as ``test_llada2_body.py`` shrinks LLaDA2.0-mini's: 3 layers (the first dense), hidden 32, 4 heads of
8 with 2 key/value heads, 8 experts in 4 groups (2 kept), 3 per token, one shared, vocabulary 64, ``rotary_dim`` 4.

The parity checks run LLaDA2.1's published modeling code (the dllm library's
``dllm/pipelines/llada21/models/modeling_llada21_moe.py``, its vendored copy of the hub's remote code) in an interpreter
with the transformers it was written for (tests/fixtures/published_llada21.py), from ``$DLLM_ALIGN_PUBLISHED_DIR`` and
``$DLLM_ALIGN_PUBLISHED_PYTHON_DLLM`` (tests/fixtures/published.py); they skip, saying how, without them. The
independent checks (the body against a loop-by-loop forward, the decoder against scripted logits) always run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dllm_align.core.errors import UserError
from dllm_align.generate.llada21 import MODES, llada21_generate, round_cap
from dllm_align.models.families import family_for_config, native_family, with_folder_evidence
from dllm_align.models.families.block import llada2_config
from dllm_align.models.families.llada21 import LLADA21, llada21_config, load_llada21_native, ships_editing_code
from dllm_align.models.families.llada2_body import Llada2MoeModelLM
from fixtures.published import require, require_python

FIXTURE = Path(__file__).parent / "fixtures" / "llada21_mini_config.json"
PUBLISHED_REPO, PUBLISHED_FILE = "ZHZisZZ/dllm", "dllm/pipelines/llada21/models/modeling_llada21_moe.py"
RUNNER = Path(__file__).parent / "fixtures" / "published_llada21.py"
MASK, EOS = 63, 62  # the shrunk vocabulary's mask and end tokens (the published ones are 156895 and 156892)
SHRINK = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "rotary_dim": 4, "moe_intermediate_size": 16, "num_experts": 8,
          "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "vocab_size": 64, "pad_token_id": 60,
          "max_position_embeddings": 128}


def shrunk(**over) -> dict:
    cfg = json.loads(FIXTURE.read_text())
    cfg.update(SHRINK, **over)
    return cfg


def randomize(model, seed: int) -> None:
    """``test_llada2_body``'s weights (large enough that routing, masks and norms all move the logits), with the mask
    token's output row zeroed: its logit is 0 while the others spread wide, so the model practically never predicts
    the mask token (as real checkpoints do not; the published loop does not stop where it does)."""
    from test_llada2_body import randomize as body_randomize

    body_randomize(model, seed)
    with torch.no_grad():
        model.lm_head.weight[MASK].zero_()


def checkpoint(folder: Path, cfg: dict, seed: int = 0) -> Llada2MoeModelLM:
    """A random model of ``cfg`` saved as the hub stores it (config.json + model.safetensors, the published names)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = Llada2MoeModelLM(llada21_config(cfg)).eval()
    randomize(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return model


def block_causal(length: int, block: int) -> torch.Tensor:
    blk = torch.arange(length) // block
    return blk[:, None] >= blk[None, :]


# --------------------------------------------------------------------------- recognition
def test_the_three_kinds_of_evidence_and_a_plain_llada2_config_stays_llada2(tmp_path):
    hub = json.loads(FIXTURE.read_text())
    assert hub["model_type"] == "llada2_moe"  # the hub's LLaDA2.1 says LLaDA2.0's type
    assert family_for_config(hub).name == native_family(hub).name == "llada2"
    for cfg in (dict(hub, model_type="llada21_moe"), dict(hub, dllm_align_family="llada21")):
        assert family_for_config(cfg) is LLADA21 and native_family(cfg) is LLADA21
    # the shipped modeling file, read as text: LLaDA2.1's defines the editing threshold, LLaDA2.0's does not
    (tmp_path / "config.json").write_text(json.dumps(hub))
    code = tmp_path / "modeling_llada2_moe.py"
    code.write_text("def generate(self, inputs, threshold=0.95):\n    pass\n")
    assert not ships_editing_code(tmp_path, hub) and with_folder_evidence(hub, tmp_path) == hub
    code.write_text("def generate(self, inputs, threshold=0.95, editing_threshold=0.9):\n    pass\n")
    assert ships_editing_code(tmp_path, hub)
    assert family_for_config(with_folder_evidence(hub, tmp_path)) is LLADA21
    # an explicit family wins over the folder's code
    assert with_folder_evidence(dict(hub, dllm_align_family="llada2"), tmp_path)["dllm_align_family"] == "llada2"
    # no auto_map, no code read
    assert not ships_editing_code(tmp_path, {k: v for k, v in hub.items() if k != "auto_map"})


def test_a_hub_folder_loads_as_llada21_by_its_code_and_as_llada2_without_it(tmp_path):
    from dllm_align.models.load import build_tiny_tokenizer, load_model, model_source

    cfg = shrunk(mask_token_id=MASK)
    folder = tmp_path / "hub"
    checkpoint(folder, cfg)
    build_tiny_tokenizer("llada2").save_pretrained(folder)
    assert load_model(str(folder)).family.name == "llada2"
    (folder / "modeling_llada2_moe.py").write_text("# LLaDA2.1\ndef generate(editing_threshold=0.9, max_post_steps=16): ...\n")
    mp = load_model(str(folder))
    assert mp.family is LLADA21 and mp.model.config.dllm_align_family == "llada21" and mp.block_size == 32
    assert model_source(str(folder)).family is LLADA21
    # what dllm-align saves reads back as LLaDA2.1 with no code beside it
    mp.model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "llada2_moe" and saved["dllm_align_family"] == "llada21"
    assert native_family(saved) is LLADA21


def test_num_key_value_heads_zero_means_one_per_query_head_as_the_21_class_says():
    config = llada21_config(shrunk(num_key_value_heads=0))
    assert config.num_key_value_heads == 4 and config.dllm_align_family == "llada21"
    with pytest.raises(UserError, match="LLaDA2.0 config options.*num_key_value_heads=0"):
        llada2_config(shrunk(num_key_value_heads=0))  # the 2.0 class keeps 0, which its code cannot run
    with pytest.raises(UserError, match="LLaDA2.1 config options.*score_function"):
        llada21_config(shrunk(score_function="softmax"))


def test_the_published_fields_read_as_published():
    config = llada21_config(json.loads(FIXTURE.read_text()))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.rope_dim, config.num_experts, config.vocab_size) == (2048, 20, 16, 4, 64, 256, 157184)
    assert (config.mask_token_id, config.block_size, config.pad_token_id) == (156895, 32, 156892)


# --------------------------------------------------------------------------- the body
def test_the_body_equals_an_independent_reference():
    from test_llada2_body import reference_logits

    config = llada21_config(shrunk())
    torch.manual_seed(0)
    model = Llada2MoeModelLM(config).eval()
    randomize(model, 3)
    ids = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(4))
    for mask in (None, block_causal(10, 4)):
        with torch.no_grad():
            mine = model(ids[None], attention_mask=None if mask is None else mask[None, None]).logits[0]
        assert (mine - reference_logits(model, ids, mask)).abs().max().item() <= 1e-4


def _published(tmp_path: Path, folder: Path, jobs: dict, timeout: int = 600) -> dict:
    code = require(PUBLISHED_REPO, PUBLISHED_FILE)
    python = require_python(PUBLISHED_REPO)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([python, str(RUNNER), str(code), str(folder), str(tmp_path / "jobs.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


def test_logits_equal_the_published_forward(tmp_path):
    cfg = shrunk(model_type="llada21_moe")  # dllm's copy: its class says llada21_moe
    checkpoint(tmp_path / "ckpt", cfg)
    mine = load_llada21_native(tmp_path / "ckpt", cfg, torch.float32)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = block_causal(24, 4)[None, None].expand(2, 1, -1, -1)
    out = _published(tmp_path, tmp_path / "ckpt", {"attn": "sdpa", "logits": [
        {"input_ids": ids.tolist(), "attention_mask": mask.tolist()},
        {"input_ids": ids.tolist(), "attention_mask": torch.ones(2, 1, 24, 24, dtype=torch.bool).tolist()}]})
    with torch.no_grad():
        for got, m in zip(out["logits"], (mask, None)):
            want = mine(ids, attention_mask=m).logits
            delta = (torch.tensor(got) - want).abs().max().item()
            scale = want.abs().max().item()
            print(f"\nmax |published - dllm-align logit| = {delta:.3g} (logits up to {scale:.3g})")
            assert delta <= 1e-6 * scale  # float32 rounding: a few ulps of the largest logit
        assert (mine(ids).logits - mine(ids, attention_mask=mask).logits).abs().max() > 0.1  # the mask matters


# --------------------------------------------------------------------------- the decoder against the published generate
N_PROMPTS = 50


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 10, (N_PROMPTS,), generator=g).tolist()
    return [torch.randint(0, 60, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_decoding_is_token_identical_to_the_published_generate(tmp_path, mode):
    """50 prompts of 1-9 tokens, gen_length 12 in blocks of 4 (so a prompt's tail block is decoded beside its prompt),
    each greedy and sampled at temperature 1 (the published sampler draws from torch's global generator after
    ``torch.manual_seed(seed)``; this rule from a generator seeded alike)."""
    cfg = shrunk(model_type="llada21_moe", block_size=4, mask_token_id=MASK)
    model = checkpoint(tmp_path / "ckpt", cfg, seed=1)
    tau, edit = MODES[mode]
    prompts = _prompts()
    common = dict(block_length=4, gen_length=12, threshold=tau, editing_threshold=edit, max_post_steps=16,
                  eos_id=EOS, mask_id=MASK)
    jobs = [dict(common, prompt=p, seed=i, temperature=t, eos_early_stop=bool(i % 2))
            for t in (0.0, 1.0) for i, p in enumerate(prompts)]
    out = _published(tmp_path, tmp_path / "ckpt", {"generate": jobs, "timeout": 60})
    assert out["attn"] == "eager"
    same = late = capped_total = 0
    counts: dict = {}
    for job, theirs in zip(jobs, out["generate"]):
        capped: list = []
        gen = torch.Generator().manual_seed(job["seed"])
        x = llada21_generate(model, torch.tensor(job["prompt"]), MASK, 12, 4, job["temperature"], threshold=tau,
                             edit_threshold=edit, max_post_steps=16, stop_ids=[EOS], generator=gen, capped=capped,
                             counts=counts)
        capped_total += sum(capped)
        if theirs is None:  # the published loop did not return: this rule must have stopped by its cap
            late += 1
            assert sum(capped), job
            continue
        mine = x[0, len(job["prompt"]): len(job["prompt"]) + 12].tolist()
        if EOS in mine:
            mine = mine[: mine.index(EOS) + 1]
        same += mine == theirs
        assert mine == theirs, (job, mine, theirs)
    print(f"\n{mode}: {same}/{len(jobs)} decodes token-identical, {late} published runs did not return, "
          f"{capped_total} blocks capped; {counts}")
    assert late == 0 and same == len(jobs)
    assert counts["edits"] > 0 and counts["fallbacks"] > 0  # both halves of the rule were exercised


# --------------------------------------------------------------------------- the decoder against scripted logits
class Scripted(torch.nn.Module):
    """A model whose logits at each position are ``table(position, token there)`` [V]: the rule's steps by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, input_ids, position_ids, attention_mask=None, use_cache=False, **_):
        self.calls += 1
        rows = [[self.table(int(p), int(t)) for p, t in zip(pos, ids)] for pos, ids in zip(position_ids, input_ids)]
        return SimpleNamespace(logits=torch.tensor(rows, dtype=torch.float32))


V, M = 6, 5  # a vocabulary of 6, the mask token 5


def onehot(tok: int, height: float) -> list[float]:
    out = [0.0] * V
    out[tok] = height
    return out


def test_mask_to_token_takes_all_above_threshold_else_the_single_most_confident():
    # position p predicts token p % 5 with a margin that grows with p: only positions 6 and 7 clear 0.7 at first
    model = Scripted(lambda p, t: onehot(p % 5, p - 3.0))
    x = llada21_generate(model, torch.tensor([0, 1, 2, 3]), M, 4, 4, 0.0, threshold=0.7, edit_threshold=1.0,
                         max_post_steps=0, counts=(counts := {}))
    assert x[0, 4:].tolist() == [4, 0, 1, 2]
    # confidence e^h / (e^h + 5): round 1 takes 6 and 7 (0.80, 0.92 > 0.7); 4 and 5 stay below (0.35, 0.60), so
    # rounds 2 and 3 take the single most confident, 5 then 4; the next round starts mask-free, past max_post_steps 0
    assert counts == {"edits": 0, "fallbacks": 2} and model.calls == 3


def test_editing_replaces_a_changed_confident_token_but_never_the_prompt_and_stops_after_max_post_steps():
    # every position predicts (its token + 1) % 5 confidently: each mask-free round edits every non-prompt position
    model = Scripted(lambda p, t: onehot(((t if t != M else 0) + 1) % 5, 10.0))
    for post in (0, 1, 3):
        model.calls = 0
        x = llada21_generate(model, torch.tensor([3, 3]), M, 2, 4, 0.0, threshold=0.5, edit_threshold=0.5,
                             max_post_steps=post)
        assert x[0, :2].tolist() == [3, 3]  # the prompt, in the decoded block, is never edited
        # round 1 unmasks both to 1; each of the post rounds edits them (+1), the next round start stops the block
        assert x[0, 2:].tolist() == [1 + post] * 2 and model.calls == 1 + post


def test_edits_happen_while_masks_remain_and_earlier_blocks_are_frozen():
    # blocks of 3 after a prompt block: the middle position is confident at once and, once it holds 1, confidently
    # wants 3 (an edit while the other two are still masked); those never clear the threshold (taken one per round,
    # the last, more confident, first)
    def table(p, t):
        if p % 3 == 1:
            return onehot({M: 1, 1: 3}.get(t, 3), 10.0)
        return onehot(2, 0.2) if p % 3 == 2 else onehot(4, 0.1)

    model = Scripted(table)
    counts: dict = {}
    x = llada21_generate(model, torch.tensor([0, 0, 0]), M, 6, 3, 0.0, threshold=0.9, edit_threshold=0.9,
                         max_post_steps=2, counts=counts)
    assert x[0].tolist() == [0, 0, 0, 4, 3, 2, 4, 3, 2]
    # per block: unmask the middle; edit it 1 -> 3 and take the last; take the first; one mask-free round that
    # changes nothing ends the block
    assert counts == {"edits": 2, "fallbacks": 4} and model.calls == 8


def test_the_round_cap_stops_a_block_that_draws_the_mask_token_and_fills_it_without_the_mask():
    # the mask token is the argmax everywhere: the published loop would run for ever
    model = Scripted(lambda p, t: [0.0, 0.0, 1.0, 0.0, 0.0, 9.0])
    capped: list = []
    x = llada21_generate(model, torch.tensor([0]), M, 3, 4, 0.0, max_post_steps=2, capped=capped)
    assert capped == [1] and x[0, 1:].tolist() == [2, 2, 2]
    assert model.calls == round_cap(4, 2) + 1


def test_a_cache_of_finished_blocks_gives_the_recomputed_tokens():
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-llada21")
    randomize(mp.model, 5)
    for prompt in ([1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13]):
        outs = [llada21_generate(mp.model, torch.tensor(prompt), mp.mask_token_id, 16, 8, 0.0, use_cache=c)[0]
                for c in (False, True)]
        assert torch.equal(outs[0], outs[1]) and not (outs[0] == mp.mask_token_id).any()


# --------------------------------------------------------------------------- doctor
def test_doctor_sizes_mini_and_flash():
    """LLaDA2.1-mini from its published config (16.26B, as LLaDA2.0-mini); LLaDA2.1-flash's config.json is not
    published: LLaDA2.0-flash's (the report keeps the size; 102.9B), named LLaDA2.1 by dllm_align_family."""
    from dllm_align.training.memory import shape_from_config

    mini = shape_from_config(with_folder_evidence(json.loads(FIXTURE.read_text()), FIXTURE.parent), "mini")
    flash_cfg = json.loads((FIXTURE.parent / "llada2_flash_config.json").read_text())
    flash = shape_from_config(dict(flash_cfg, dllm_align_family="llada21"), "flash")
    assert 16.2e9 < mini.params < 16.3e9 and round(flash.params / 1e9, 1) == 102.9
    assert mini.likelihood == flash.likelihood == "block" and mini.block_size == flash.block_size == 32
    assert mini.qk_norm and (mini.experts, mini.active_experts, mini.moe_layers) == (256, 8, 19)



# --------------------------------------------------------------------------- the export, through the published code
def test_an_export_reloads_through_the_published_code_to_the_trained_logits(tmp_path):
    """A hub-layout LLaDA2.1 folder (LLaDA2.0's config.json identity; the published 2.1 modeling files under the hub's
    names ``modeling_llada2_moe.py`` / ``configuration_llada2_moe.py``, dllm's copies with the one import renamed) is
    told to be LLaDA2.1 by its code, loaded, exported as training exports (``final/``), and loaded back by the published
    code (``AutoModelForCausalLM``, ``trust_remote_code``) in its own interpreter: the same logits, and its tokenizer
    (``AutoTokenizer``) the trained one's ids and chat turn."""
    from test_export_roundtrip import _export, assert_same_tokenizer, published_logits

    from dllm_align.models.load import build_tiny_tokenizer, load_model

    code = require(PUBLISHED_REPO, PUBLISHED_FILE)
    python = require_python(PUBLISHED_REPO)
    tok = build_tiny_tokenizer("llada2")
    cfg = shrunk(vocab_size=len(tok), pad_token_id=tok.pad_token_id, mask_token_id=tok.mask_token_id)
    source = tmp_path / "source"
    checkpoint(source, cfg)
    tok.save_pretrained(source)
    modeling = code.read_text().replace("from .configuration_llada21_moe import", "from .configuration_llada2_moe import")
    (source / "modeling_llada2_moe.py").write_text(modeling)
    shutil.copyfile(code.parent / "configuration_llada21_moe.py", source / "configuration_llada2_moe.py")
    mp = load_model(str(source))
    assert mp.family is LLADA21
    out = tmp_path / "final"
    written = _export(mp, out, source)
    assert (written["model_type"], written["architectures"]) == ("llada2_moe", ["LLaDA2MoeModelLM"])
    assert (out / "modeling_llada2_moe.py").read_text() == modeling
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    allowed = block_causal(12, 4).expand(2, 1, -1, -1).contiguous()
    pos = torch.arange(12).expand_as(ids).contiguous()
    got, name, tokenizer = published_logits(python, out, {"input_ids": ids, "attention_mask": allowed,
                                                          "position_ids": pos}, tmp_path)
    assert name == "LLaDA2MoeModelLM"
    assert_same_tokenizer(tokenizer, mp.tokenizer)  # final/'s tokenizer as the published stack reads it
    with torch.no_grad():
        want = mp.model(input_ids=ids, attention_mask=allowed, position_ids=pos).logits.float()
    delta = float((got[..., :want.shape[-1]] - want).abs().max())
    print(f"\nexport round trip: max |published - trained logit| = {delta:.3g}")
    assert delta <= 1e-6 * float(want.abs().max())


def test_the_recipe_fits_8_h100_by_doctor(tmp_path):
    """llada21_mini_kto_mix_14k on LLaDA2.1-mini's published config.json (the hub's, with the modeling file that
    names it LLaDA2.1): LoRA adapters only, the bf16 base sharded over 8 GPUs; doctor says it fits an 80 GB H100."""
    from typer.testing import CliRunner

    from dllm_align.cli.app import app

    folder = tmp_path / "LLaDA2.1-mini"
    folder.mkdir()
    (folder / "config.json").write_text(FIXTURE.read_text())
    (folder / "modeling_llada2_moe.py").write_text("def generate(self, editing_threshold=0.9): ...\n")
    repo = Path(__file__).resolve().parents[1]
    res = CliRunner().invoke(app, ["doctor", "llada21_mini_kto_mix_14k", "--config",
                                   str(repo / "recipes" / "accelerate" / "fsdp_8gpu.yaml"), "--set",
                                   f"model.name_or_path={folder}", "-o", str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    mem = json.loads(res.stdout)["memory"]
    assert mem["fits"] and 16.2e9 < mem["model"]["params"] < 16.3e9 and 0 < mem["model"]["trainable"] < 1e8
    print(f"\ndoctor: {mem['estimate']['total_gib']} GiB per GPU")


def test_a_batch_that_reaches_the_round_cap_says_so(capsys):
    """Through the rule's batch function: the cap is reported on stderr, and the completion holds no mask."""
    import time

    from dllm_align.generate.llada21 import RULE
    from dllm_align.generate.settings import SamplerSettings

    class AlwaysMask(torch.nn.Module):
        def __init__(self, vocab: int, mask: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.vocab, self.mask = vocab, mask

        def forward(self, input_ids, **_):
            logits = torch.zeros(*input_ids.shape, self.vocab)
            logits[..., self.mask] = 5.0
            logits[..., 7] = 1.0
            return SimpleNamespace(logits=logits)

    from dllm_align.models.load import build_tiny_tokenizer

    tok = build_tiny_tokenizer("llada2")
    mp = SimpleNamespace(model=AlwaysMask(len(tok), tok.mask_token_id), mask_token_id=tok.mask_token_id, block_size=4,
                         device=torch.device("cpu"), stop_token_ids=[tok.eos_token_id], tokenizer=tok,
                         family=LLADA21, _autocast=lambda kind: torch.autocast(kind, enabled=False))
    settings = SamplerSettings(sampler="llada21", gen_length=4, block_length=4, llada21={"max_post_steps": 0})
    (c,) = RULE.decode_batch(mp, [[1, 2]], settings, [0], None, time.perf_counter(), True)
    # two blocks (the prompt's tail block and the next), each capped, then filled by one more forward
    assert c.raw == [7, 7, 7, 7] and c.forwards == 2 * (round_cap(4, 0) + 1)
    assert "2 block(s) of this batch reached the round cap" in capsys.readouterr().err
