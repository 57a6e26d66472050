"""DiffusionGemma: the family (native loading of the published layout, the shrunk published config, tokenizer,
stop tokens, LoRA on tied stacks) and the uniform-noise likelihood component run on the model (the clean
stream against transformers' one-call forward, draw subsets, padding, gradients)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from fixtures.runs import read_metrics, reset_accelerate
import torch

from dllm_align.core.errors import UserError
from dllm_align.data.tokenize import tokenize_pairs, tokenize_rows
from dllm_align.models.families import detect_family, family_for_config
from dllm_align.objective.components import UniformSettings
from dllm_align.models.families import diffusion_gemma as dg
from dllm_align.models.load import load_model
from dllm_align.objective.elbo import DrawConfig, elbo_draws, get_likelihood
from dllm_align.objective.uniform import UniformDrawConfig, draw_nelbo, draw_uniform_noise

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


# --------------------------------------------------------------------------- the likelihood on the model
def _batch(tok):
    p, c = tok.encode("<bos>abc"), tok.encode("defghijklmnop")  # 13 completion tokens: canvases of 8 and 5
    short_p, short_c = tok.encode("<bos>xy"), tok.encode("zzzz")
    T = len(p) + len(c)
    ids = torch.tensor([p + c, short_p + short_c + [tok.pad_token_id] * (T - 7)])
    am = torch.tensor([[1] * T, [1] * 7 + [0] * (T - 7)])
    cm = torch.zeros_like(ids)
    cm[0, len(p):] = 1
    cm[1, 3:7] = 1
    return p, c, ids, am, cm


def test_clean_stream_matches_one_call_forward_per_draw(tiny):
    """The component (context encoded once, canvases appended to the cache) against transformers' one-call
    forward (encoder over the whole clean context of each canvas, one draw at a time)."""
    p, c, ids, am, cm = _batch(tiny.tokenizer)
    cfg = DrawConfig(n_mc=4, seed=3)
    with torch.no_grad():
        got = elbo_draws(tiny, ids, am, cm, ["a", "b"], cfg)
        d = draw_uniform_noise("a", len(c), UniformDrawConfig(n_mc=4, seed=3), tiny.vocab_size, 8)
        x0 = torch.tensor(c)
        xt = d.noisy(x0)
        for k in range(4):
            total = 0.0
            for s in (0, 8):
                ctx = torch.tensor([p + c[:s]])
                lp = tiny.model(input_ids=ctx, decoder_input_ids=xt[k:k + 1, s:s + 8]).logits[0].float().log_softmax(-1)
                n = draw_nelbo(lp, x0[s:s + 8], xt[k, s:s + 8], torch.from_numpy(d.t[k, s:s + 8]))
                total -= float((n * torch.from_numpy(d.weight[k, s:s + 8])).sum())
            assert abs(float(got[0, k]) - total) < 1e-4 * max(1.0, abs(total))
    assert (got <= 0).all() and torch.isfinite(got).all()


def test_draw_subsets_padding_and_determinism(tiny):
    _, _, ids, am, cm = _batch(tiny.tokenizer)
    cfg = DrawConfig(n_mc=4, seed=3)
    with torch.no_grad():
        full = elbo_draws(tiny, ids, am, cm, ["a", "b"], cfg)
        assert torch.equal(full, elbo_draws(tiny, ids, am, cm, ["a", "b"], cfg))
        assert torch.allclose(full[:, 2:], elbo_draws(tiny, ids, am, cm, ["a", "b"], cfg, draws=[2, 3]), atol=1e-5)
        alone = elbo_draws(tiny, ids[1:, :7], None, cm[1:, :7], ["b"], cfg)
        assert torch.allclose(full[1:], alone, atol=1e-5)
        chunked = elbo_draws(tiny, ids, am, cm, ["a", "b"], cfg, max_rows_per_forward=4)
        assert torch.allclose(full, chunked, atol=1e-5)
        assert not torch.equal(full, elbo_draws(tiny, ids, am, cm, ["a", "b"], DrawConfig(n_mc=4, seed=4)))


def test_recipe_choices_change_the_value_and_packing_is_refused(tiny):
    _, _, ids, am, cm = _batch(tiny.tokenizer)
    base = DrawConfig(n_mc=2, seed=0)
    with torch.no_grad():
        v = elbo_draws(tiny, ids, am, cm, ["a", "b"], base)
        for change in ({"self_conditioning": "detached"}, {"surrogate": "flat_ce"}, {"parameterization": "loo"},
                       {"time_power": 1}):
            own = (("uniform", UniformSettings(**change)),)  # the uniform likelihood's own settings
            w = elbo_draws(tiny, ids, am, cm, ["a", "b"], DrawConfig(n_mc=2, seed=0, likelihood_settings=own))
            assert torch.isfinite(w).all() and not torch.allclose(v, w), change
        with pytest.raises(UserError, match="packed"):
            elbo_draws(tiny, ids, am, cm, ["a", "b"], base, pack_length=64)


def test_gradient_reaches_the_tied_weights(tiny):
    model = tiny.model
    _, _, ids, am, cm = _batch(tiny.tokenizer)
    model.zero_grad()
    elbo_draws(tiny, ids, am, cm, ["a", "b"], DrawConfig(n_mc=2, seed=0)).sum().backward()
    w = model.model.decoder.layers[0].self_attn.q_proj.weight
    assert w.grad is not None and w.grad.abs().sum() > 0
    model.zero_grad()


def test_footprint_counts_the_clean_context_row():
    fp = get_likelihood("uniform").footprint(None, 8, 128, 2)
    assert (fp.rows, fp.scored_rows) == (9, 8)


# --------------------------------------------------------------------------- the scored layout: full canvases
def trl_canvases(tok, user: str, reply: str, C: int) -> list[int]:
    """TRL's DiffusionGemma example, rebuilt independently: the supervised span is the rendering of the assistant
    turn after the generation prompt (the reply and its closing ``<turn|>\\n``); each canvas of ``C`` response tokens
    in turn is the target, the last EOS-filled to ``C``; every canvas position is corrupted and scored."""
    msgs = [{"role": "user", "content": user}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": reply}], tokenize=False)
    ids = tok(full, add_special_tokens=False)["input_ids"]
    response = ids[len(tok(prompt, add_special_tokens=False)["input_ids"]):]
    blocks = (len(response) - 1) // C + 1
    return [response[b * C + o] if b * C + o < len(response) else tok.eos_token_id
            for b in range(blocks) for o in range(C)]


@pytest.mark.parametrize("reply", ["04668", "0123456789", "1234567891234", "9"])
def test_published_layout_is_trls_full_canvases(tiny, reply):
    """``data.block_scoring: published`` (the default) on DiffusionGemma: the completion is exactly TRL's canvases
    (reply, ``<turn|>\\n``, EOS to the end of the last canvas) and every position of it is scored; ``completion_only``
    is the reply and ``<turn|>`` alone, the last canvas partial."""
    from dllm_align.config.schema import DataSection
    from dllm_align.data.batching import collate
    from dllm_align.data.examples import block_layout_for
    from dllm_align.data.rows import Row

    tok, C = tiny.tokenizer, tiny.canvas_length
    data = DataSection(max_length=200)
    layout = block_layout_for(data, tok, tiny.block_size, C)
    assert layout.canvas and layout.filler == tok.convert_tokens_to_ids("<eos>")
    (ex,) = tokenize_rows([Row("r", [{"role": "user", "content": "sort 3 1 2"}], reply, True)], tok, data, block=layout)
    assert ex.completion_ids == trl_canvases(tok, "sort 3 1 2", reply, C)
    assert len(ex.completion_ids) % C == 0
    b = collate([ex], padding="none", max_length=200, pad_id=tok.pad_token_id)
    assert b["completion_mask"][0].sum() == len(ex.completion_ids)
    only = DataSection(max_length=200, block_scoring="completion_only")
    assert block_layout_for(only, tok, tiny.block_size, C) is None
    (plain,) = tokenize_rows([Row("r", [{"role": "user", "content": "sort 3 1 2"}], reply, True)], tok, only)
    assert plain.completion_ids == ex.completion_ids[:len(plain.completion_ids)]
    assert plain.completion_ids[-1] == tok.convert_tokens_to_ids("<turn|>")


def test_published_layout_never_passes_max_length_and_leaves_a_cut_reply_unfilled(tiny):
    from dllm_align.config.schema import DataSection
    from dllm_align.data.examples import block_layout_for
    from dllm_align.data.rows import PairRow, Row

    tok, C = tiny.tokenizer, tiny.canvas_length
    user = [{"role": "user", "content": "sort"}]
    layout = block_layout_for(DataSection(max_length=200), tok, None, C)
    (full,) = tokenize_rows([Row("r", user, "12345678901", True)], tok, DataSection(max_length=200), block=layout)
    P = len(full.prompt_ids)
    assert len(full.completion_ids) == 2 * C
    # room for the reply and its tail (13 tokens) but not the whole second canvas: filled up to max_length only
    (ex,) = tokenize_rows([Row("r", user, "12345678901", True)], tok, DataSection(max_length=P + 14), block=layout)
    assert ex.length == P + 14 and ex.completion_ids[:13] == full.completion_ids[:13]
    # a cut reply: no tail, no filler (it has no end), its last canvas left partial
    (cut,) = tokenize_rows([Row("r", user, "12345678901", True)], tok, DataSection(max_length=P + 10), block=layout)
    assert cut.completion_ids == full.completion_ids[:10]
    assert tok.eos_token_id not in cut.completion_ids
    (pc, pr), = tokenize_pairs([PairRow("p", user, "123", "3210987654321")], tok, DataSection(max_length=200),
                               block=layout)
    assert len(pc.completion_ids) == C and len(pr.completion_ids) == 2 * C and pc.prompt_ids == pr.prompt_ids


# --------------------------------------------------------------------------- training: the step-0 invariant
@pytest.fixture(scope="module")
def dg_toy(tmp_path_factory):
    from fixtures.sort_toy import write_pairs

    root = tmp_path_factory.mktemp("dg-inv")
    return {"root": root, "data": write_pairs(root / "pairs.jsonl", n=8), "cache": {}}


def _dg_recipe(toy, scoring, *sets):
    from dllm_align.config.recipe import load_recipe

    return load_recipe(None, [
        "model.name_or_path=builtin:tiny-diffusiongemma", f"data.train={toy['data']}", "data.format=paired",
        "data.max_length=160", "data.padding=none", f"data.block_scoring={scoring}", "reference.n_mc=2",
        "reference.shard_size=4", "reference.batch_size=8", f"reference.cache={toy['root'] / ('cache-' + scoring)}",
        "train.mixed_precision=no", "train.batch_size=4", "train.lr=1e-3", "train.warmup_ratio=0", *sets],
        output_dir=str(toy["root"] / "run"))


@pytest.mark.parametrize("mode,lora,scoring", [("cached", False, "published"), ("online", False, "published"),
                                               ("cached", True, "published"), ("cached", False, "completion_only")])
def test_step0_margins_are_exactly_zero(dg_toy, tiny, fresh_accelerate, mode, lora, scoring):
    """Policy = reference before the first update: every margin exactly 0 (the cache made in batches of 8,
    training in micro-batches of 4), with full fine-tuning and with LoRA shared by the tied stacks, under the
    published full canvases (policy and reference score the same filled canvases under the same noise) and under
    ``completion_only``."""
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.training import reference as ref
    from dllm_align.training.distributed import make_accelerator
    from dllm_align.training.loop import invariant_margins
    from dllm_align.training.train import setup_run

    tok = dg.build_tokenizer()
    if scoring not in dg_toy["cache"]:
        rec = _dg_recipe(dg_toy, scoring)
        exs = load_training_examples(rec, tok, quiet=True, canvas_length=tiny.canvas_length)
        ref.precompute(rec, exs, make_collate(rec, tok), None, None)
        dg_toy["cache"][scoring] = exs
    exs = dg_toy["cache"][scoring]
    # "0 4 6 6<turn|>" fills one canvas of 8: the published layout adds the newline and a second canvas of EOS
    assert {len(e.completion_ids) for e in exs} == ({2 * tiny.canvas_length} if scoring == "published"
                                                     else {tiny.canvas_length})
    sets = [f"reference.mode={mode}"] + (["train.lora.enabled=true", "train.lora.r=4"] if lora else [])
    rec = _dg_recipe(dg_toy, scoring, *sets)
    run = setup_run(rec, make_accelerator(rec), None, exs)
    assert run.mp.likelihood == "uniform"
    margins = invariant_margins(run, steps=2)
    assert margins and max(abs(v) for v in margins.values()) == 0.0


def test_a_cache_of_the_other_canvas_layout_is_refused_by_name(dg_toy, tiny):
    """The layout is in the reference-cache fingerprint: a cache made under ``completion_only``, or before canvases
    were filled (no layout recorded), does not serve a run under ``published``."""
    from dllm_align.training.cache import compare, fingerprint

    def fields(scoring, canvas_length):
        return fingerprint(_dg_recipe(dg_toy, scoring), tokenizer=tiny.tokenizer, mask_token_id=tiny.mask_token_id,
                           device=torch.device("cpu"), examples=[], canvas_length=canvas_length).fields

    wanted = fields("published", tiny.canvas_length)
    assert wanted["block_scoring"] == "published"
    for cached in (fields("completion_only", tiny.canvas_length), fields("published", None)):
        with pytest.raises(UserError, match="'block_scoring'.*data.block_scoring"):
            compare(cached, wanted, Path("cache"))


# --------------------------------------------------------------------------- the commands, from the CLI
def _cli_recipe(root: Path, model: str, name: str, **train) -> Path:
    import yaml

    from fixtures.sort_toy import write_pairs

    data = write_pairs(root / f"{name}.pairs.jsonl", n=8)
    rec = {"name": name, "model": {"name_or_path": model},
           "data": {"train": str(data), "test": str(data), "format": "paired", "max_length": 96},
           "reference": {"n_mc": 2, "batch_size": 8, "shard_size": 8},
           "train": {"lr": 1e-3, "batch_size": 4, "global_batch_size": 4, "max_steps": 2, "warmup_ratio": 0, **train},
           "generate": {"gen_length": 16, "block_length": 16, "steps": 8, "batch_size": 4, "limit": 3}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


@pytest.mark.parametrize("objective", ["elbo_kto", "sft", "vrpo"])
def test_cli_shrunk_published_config_precompute_train_generate(shrunk_folder, tmp_path, fresh_accelerate, objective):
    """The shrunk published config from the CLI: precompute-ref, two training steps (ELBO-KTO: the first with
    every margin exactly 0), an export transformers loads with the published key layout, and generate."""
    from typer.testing import CliRunner
    from transformers import DiffusionGemmaForBlockDiffusion

    from dllm_align.cli.app import app

    runner = CliRunner()
    rec = _cli_recipe(tmp_path, str(shrunk_folder), objective, objective=objective)
    run = tmp_path / "run"
    if objective != "sft":
        res = runner.invoke(app, ["precompute-ref", str(rec), "-o", str(run)])
        assert res.exit_code == 0, res.output
        # the recipe left data.padding at its default: the family's likelihood does not pack, the plan says so
        assert "data.padding: none (diffusion_gemma's uniform likelihood does not pack" in res.stderr
        reset_accelerate()
    res = runner.invoke(app, ["train", str(rec), "-o", str(run)])
    assert res.exit_code == 0, res.output
    rows = read_metrics(run)
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)
    if objective == "elbo_kto":
        assert rows[0]["reward_desirable"] == 0.0 and rows[0]["reward_undesirable"] == 0.0 and rows[0]["baseline"] == 0.0
        assert rows[1]["reward_desirable"] != 0.0  # the policy moved
    # the export holds what transformers' own save_pretrained writes (the decoder; the encoder's tied weights
    # are left out) and loads with the published class, the stacks tied again
    from safetensors import safe_open

    with safe_open(str(run / "final" / "model.safetensors"), "pt") as f, \
            safe_open(str(shrunk_folder / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
    m = DiffusionGemmaForBlockDiffusion.from_pretrained(run / "final")
    assert m.model.encoder.language_model.layers[0].self_attn.q_proj.weight is m.model.decoder.layers[0].self_attn.q_proj.weight
    assert vllm_layout_problems(run / "final") == []
    if objective != "elbo_kto":
        return
    out = tmp_path / "gen.jsonl"
    res = runner.invoke(app, ["generate", str(rec), "-m", str(run / "final"), "--output", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    gen = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(gen) == 3 and all("completion" in r and r["num_tokens"] <= 16 for r in gen)


# --------------------------------------------------------------------------- vLLM's loader (read, not run)
# Facts read from vLLM's DiffusionGemma model file (vllm/model_executor/models/diffusion_gemma.py, the
# vllm-project/vllm snapshot of the code search, commit 00c25c81): the registry maps the architecture
# DiffusionGemmaForBlockDiffusion to its DiffusionGemmaForConditionalGeneration; its weight mapper renames these
# checkpoint prefixes (any other name would be an unexpected weight); the full-attention layers are built without
# v_proj (values are the keys); the self-conditioning MLP is pre_norm (weighted), gate/up/down projections of width
# config.self_conditioning_size or text_config.intermediate_size, and a weightless post_norm; the text config
# fields it reads itself; and its sampler reads these generation_config.json fields (refusing a sampler_config
# whose class name is not EntropyBound...). vLLM itself was not run.
VLLM_PREFIXES = ("model.decoder.self_conditioning.", "model.decoder.", "model.encoder.language_model.",
                 "model.encoder.vision_tower.", "model.encoder.embed_vision.")
VLLM_TEXT_FIELDS = ("hidden_size", "vocab_size", "tie_word_embeddings", "final_logit_softcapping", "intermediate_size",
                    "rms_norm_eps")
VLLM_GENERATION_FIELDS = ("sampler_config", "t_min", "t_max", "confidence_threshold", "stability_threshold",
                          "max_denoising_steps")


def vllm_layout_problems(folder: Path) -> list[str]:
    """What in an exported folder vLLM's DiffusionGemma loader would not find or not expect (facts above)."""
    from safetensors import safe_open

    problems = []
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config") or {}
    if "DiffusionGemmaForBlockDiffusion" not in (cfg.get("architectures") or []):
        problems.append(f"architectures {cfg.get('architectures')}")
    problems += [f"text_config.{k} missing" for k in VLLM_TEXT_FIELDS if k not in text]
    problems += [f"vision_config.{k} missing" for k in ("hidden_size", "intermediate_size")
                 if k not in (cfg.get("vision_config") or {})]
    if text.get("tie_word_embeddings") is not True:
        problems.append("lm_head untied: vLLM ties it to the embedding only when tie_word_embeddings is true")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    problems += [f"unexpected weight {k}" for k in shapes if not k.startswith(VLLM_PREFIXES)]
    # the encoder's text keys land on the decoder's names: each must have a decoder twin
    problems += [f"encoder key without a decoder twin: {k}" for k in shapes if k.startswith(VLLM_PREFIXES[2])
                 and k.replace(VLLM_PREFIXES[2], VLLM_PREFIXES[1]) not in shapes]
    for i, kind in enumerate(text.get("layer_types") or []):
        has_v = f"model.decoder.layers.{i}.self_attn.v_proj.weight" in shapes
        if has_v != (kind == "sliding_attention"):
            problems.append(f"layer {i} ({kind}): v_proj {'present' if has_v else 'missing'}")
    sc = {k[len(VLLM_PREFIXES[0]):]: v for k, v in shapes.items() if k.startswith(VLLM_PREFIXES[0])}
    width = cfg.get("self_conditioning_size") or text.get("intermediate_size")
    want = {"pre_norm.weight": (text.get("hidden_size"),), "gate_proj.weight": (width, text.get("hidden_size")),
            "up_proj.weight": (width, text.get("hidden_size")), "down_proj.weight": (text.get("hidden_size"), width)}
    if sc != want:
        problems.append(f"self-conditioning weights {sc} (vLLM builds {want})")
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    problems += [f"generation_config.json: {k} missing" for k in VLLM_GENERATION_FIELDS if gen.get(k) is None]
    sampler = gen.get("sampler_config") or {}
    if "EntropyBound" not in str(sampler.get("_cls_name", "")) or not (sampler.get("entropy_bound") or 0) > 0:
        problems.append(f"generation_config.json: sampler_config {sampler} (vLLM needs an EntropyBound one, bound > 0)")
    return problems


def test_vllm_layout_check_catches_what_vllm_would_refuse(tmp_path):
    """The check above can fail: an lm_head key, a v_proj on a full-attention layer, no generation config."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "bad"
    tok = dg.build_tokenizer()
    cfg = shrunk_published(tok)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({"lm_head.weight": torch.zeros(2, 2), "model.decoder.layers.5.self_attn.v_proj.weight": torch.zeros(2, 2)},
              str(folder / "model.safetensors"))
    problems = vllm_layout_problems(folder)
    assert "unexpected weight lm_head.weight" in problems
    assert "layer 5 (full_attention): v_proj present" in problems
    assert "layer 0 (sliding_attention): v_proj missing" in problems
    assert "generation_config.json: sampler_config missing" in problems
    shutil.rmtree(folder)


def test_cli_packed_padding_refused_by_name_before_anything_is_written(tmp_path):
    from typer.testing import CliRunner

    from dllm_align.cli.app import app

    rec = _cli_recipe(tmp_path, "builtin:tiny-diffusiongemma", "packed")
    for cmd in ("precompute-ref", "train"):
        run = tmp_path / f"run-{cmd}"
        res = CliRunner().invoke(app, [cmd, str(rec), "-o", str(run), "--set", "data.padding=packed"])
        assert res.exit_code == 2, res.output
        errors = [x for x in res.stderr.splitlines() if x.startswith("Error:")]
        assert errors == ["Error: data.padding: packed is not available for diffusion_gemma (the uniform likelihood "
                          "does not pack)"]
        assert not run.exists()
    # another family keeps the packed default
    from dllm_align.config.recipe import load_recipe
    from dllm_align.training.plan import resolve_recipe

    r = load_recipe(str(rec), ["model.name_or_path=builtin:tiny"])
    assert resolve_recipe(r)[0] is r and r.data.padding == "packed"


# --------------------------------------------------------------------------- generation: the published sampler
def test_generate_runs_transformers_own_sampler_with_per_row_seeds(tiny):
    from dllm_align.generate.gemma import generation_config
    from dllm_align.generate.sampler import generate
    from dllm_align.generate.settings import SamplerSettings, encode_prompt

    s = SamplerSettings(gen_length=16, block_length=16, steps=8)
    prompts = [encode_prompt(tiny.tokenizer, [{"role": "user", "content": c}]) for c in ("Sort: 3 1 2", "Sort: 9 8")]
    gc = generation_config(tiny, s.for_model(tiny))
    assert gc.max_new_tokens == 16 and gc.max_denoising_steps == 8 and (gc.t_min, gc.t_max) == (0.4, 0.8)
    assert sorted(gc.eos_token_id) == sorted(tiny.stop_token_ids) and gc.pad_token_id == tiny.tokenizer.pad_token_id
    state = torch.random.get_rng_state()
    a = generate(tiny, prompts, s, seeds=[11, 12])
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's generator is untouched
    b = generate(tiny, prompts, s, seeds=[11, 12], batch_size=1)  # batching does not change a row
    c = generate(tiny, prompts, s, seeds=[13, 14])
    assert [x.raw for x in a] == [x.raw for x in b]
    assert all(x.raw != y.raw for x, y in zip(a, c))
    assert all(x.forwards >= 1 and len(x.raw) <= 16 for x in a)
    # the same row through transformers directly, under the same seed
    with torch.random.fork_rng():
        torch.manual_seed(11)
        seq = tiny.model.generate(torch.tensor([prompts[0]]), generation_config=gc).sequences
    assert seq[0, len(prompts[0]):len(prompts[0]) + 16].tolist() == a[0].raw
    with pytest.raises(Exception, match="cache: not a setting of the rule 'diffusion_gemma'"):
        SamplerSettings(gen_length=16, block_length=16, steps=8, sampler="diffusion_gemma", cache="prefix")


def test_cli_generate_on_the_builtin(tmp_path):
    from typer.testing import CliRunner

    from dllm_align.cli.app import app

    rec = _cli_recipe(tmp_path, "builtin:tiny-diffusiongemma", "gen")
    outs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / f"{name}.jsonl"
        res = CliRunner().invoke(app, ["generate", str(rec), "--output", str(out), "--device", "cpu",
                                       "--set", f"generate.seed={seed}"])
        assert res.exit_code == 0, res.output
        outs.append([json.loads(x)["completion"] for x in out.read_text().splitlines()])
    assert len(outs[0]) == 3 and outs[0] == outs[1] and outs[0] != outs[2]
