"""Same numbers on every launch: the step-0 invariant and the precision policy, on CPU.

Before the first update the policy's weights equal the reference's, so every
row's margin B_policy - B_ref is zero. Tolerance: on the CPU it is exactly 0,
in fp32 and under bf16 autocast alike. Policy and reference run the same
forward (``MaskPredictor.target_logprobs``) under the same
:class:`dllm_align.models.precision.Precision`; the CPU kernels compute each row's
reductions in an order that does not depend on the other rows of the batch,
so the cache (made in batches of 16) and the training micro-batches (4) give
bit-identical values. Any nonzero margin is a defect (a head that escaped autocast gave
-0.063 / +0.109 mean margins under bf16). On CUDA, kernels choose reduction
orders by shape; ``doctor`` then allows ``dllm_align.training.doctor.row_tolerance``.

The multi-process launches (DDP, FSDP1, FSDP2 on gloo) are in
``test_invariants_distributed.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm_align.config.recipe import load_recipe

from fixtures.sort_toy import write_pairs


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("inv")
    return {"root": root, "data": write_pairs(root / "pairs.jsonl", n=16), "caches": {}}


def recipe(toy, mp: str, *sets: str, out: str = "run"):
    return load_recipe(
        None,
        [
            f"data.train={toy['data']}", "data.format=paired", "data.max_length=64",
            "reference.n_mc=4", "reference.shard_size=8", "reference.batch_size=16",
            f"reference.cache={toy['root'] / ('cache-' + mp)}",
            f"train.mixed_precision={mp}", "train.batch_size=4", "train.lr=1e-3", "train.warmup_ratio=0",
            *sets,
        ],
        output_dir=str(toy["root"] / out),
    )


def cache_for(toy, mp: str):
    """Precompute (the library path: the reference loaded in the training precision) once per precision, on the
    device training will use (the accelerator ``make_accelerator`` gives: CUDA when one is visible), so that
    every cached case compares two forwards on one device."""
    if mp not in toy["caches"]:
        from accelerate.state import AcceleratorState, GradientState

        from dllm_align.training import reference as ref
        from dllm_align.training import distributed
        from dllm_align.data.examples import load_training_examples, make_collate
        from dllm_align.models.load import build_tiny_tokenizer

        rec = recipe(toy, mp)
        tok = build_tiny_tokenizer()
        exs = load_training_examples(rec, tok, quiet=True)
        AcceleratorState._reset_state(True)  # the cache's precision, not a previous test's
        GradientState._reset_state()
        try:
            ref.precompute(rec, exs, make_collate(rec, tok), distributed.make_accelerator(rec), None)
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        toy["caches"][mp] = exs
    return toy["caches"][mp]


def test_cache_and_policy_are_built_on_the_same_device(toy, monkeypatch):
    """With a CUDA device visible (faked here: make_accelerator answers as it would there), the reference cache
    is made on the device the step-0 tests train on, not on the CPU."""
    from types import SimpleNamespace

    from dllm_align.training import reference as ref
    from dllm_align.training import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    trainer = SimpleNamespace(device=torch.device("cuda"), process_index=0, num_processes=1, is_main_process=True)
    monkeypatch.setattr(distributed, "make_accelerator", lambda rec: trainer)
    seen = {}

    def spy(recipe, examples, collate, accelerator=None, ref_mp=None, overwrite=False):
        # precompute's own rule for its device (training/reference.py)
        seen["cache"] = accelerator.device if accelerator else torch.device("cpu")

    monkeypatch.setattr(ref, "precompute", spy)
    monkeypatch.setitem(toy, "caches", {})  # build afresh, through the spy
    cache_for(toy, "no")
    assert seen["cache"] == distributed.make_accelerator(None).device == torch.device("cuda")


@pytest.mark.parametrize("mp", ["no", "bf16"])
@pytest.mark.parametrize("mode", ["cached", "online"])
@pytest.mark.parametrize("lora", [False, True])
def test_step0_margins_are_zero_one_process(toy, fresh_accelerate, mp, mode, lora):
    from dllm_align.training.loop import invariant_margins
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator

    exs = cache_for(toy, mp)
    sets = [f"reference.mode={mode}"] + (["train.lora.enabled=true", "train.lora.r=4"] if lora else [])
    rec = recipe(toy, mp, *sets)
    run = setup_run(rec, make_accelerator(rec), None, exs)
    assert run.accelerator.mixed_precision == mp
    margins = invariant_margins(run, steps=3)
    assert len(margins) == 12
    worst = max(abs(v) for v in margins.values())
    assert worst == 0.0, (mp, mode, lora, worst)


def test_step0_margins_are_zero_under_the_hybrid_likelihood_cached_and_online(toy, fresh_accelerate):
    """LLaDA2.1 with ``reference.likelihood: hybrid`` (the masked-plus-replaced bound): policy and reference share
    the times, the masked positions and the replacement tokens, so every step-0 margin is exactly 0, from the cache
    and online alike, and the cached reference values are the online ones. A cache made with another mask share is
    refused by its fingerprint's field."""
    from accelerate.state import AcceleratorState, GradientState

    from dllm_align.core.errors import UserError
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.models.load import build_tiny_tokenizer
    from dllm_align.training import reference as ref
    from dllm_align.training.distributed import make_accelerator
    from dllm_align.training.loop import invariant_values
    from dllm_align.training.train import setup_run

    cache = toy["root"] / "cache-hybrid"
    sets = ["model.name_or_path=builtin:tiny-llada21", "data.padding=none", "reference.likelihood=hybrid",
            "reference.hybrid.mask_share=0.3", f"reference.cache={cache}"]
    rec = recipe(toy, "no", *sets, out="run-hybrid")
    exs = load_training_examples(rec, build_tiny_tokenizer("llada2"), quiet=True, block_size=8)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ref.precompute(rec, exs, make_collate(rec, build_tiny_tokenizer("llada2")), make_accelerator(rec), None)
    values = {}
    for mode in ("cached", "online"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        r = recipe(toy, "no", *sets, f"reference.mode={mode}", out="run-hybrid")
        values[mode] = invariant_values(setup_run(r, make_accelerator(r), None, exs), steps=2)
    assert len(values["cached"]) == 8 and values["cached"].keys() == values["online"].keys()
    for mode, rows in values.items():
        assert all(pol - rf == 0.0 and rf < 0 for pol, rf, _ in rows.values()), mode
    assert all(values["cached"][i][1] == values["online"][i][1] for i in values["cached"])
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    other = recipe(toy, "no", *sets[:-2], "reference.hybrid.mask_share=0.5", f"reference.cache={cache}", out="run-hybrid")
    with pytest.raises(UserError, match="likelihood_settings"):
        setup_run(other, make_accelerator(other), None, exs)


def test_bf16_training_step1_rewards_are_zero(toy, fresh_accelerate):
    """`train --set train.mixed_precision=bf16`: the first step's reward means are 0 for both classes."""
    from dllm_align.training.train import train

    exs = cache_for(toy, "bf16")
    rec = recipe(toy, "bf16", "train.max_steps=2", out="bf16-train")
    train(rec, examples=exs)
    rows = [json.loads(x) for x in (Path(rec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward_desirable"] == 0.0 and rows[0]["reward_undesirable"] == 0.0
    assert rows[0]["loss"] == pytest.approx(0.5 * (1.0 + 0.0), abs=0.5)  # sanity: finite, in [0, 1]
    assert rows[1]["reward_desirable"] != 0.0  # the step moved the policy: the check above could fail


def test_fp32_cache_refused_for_bf16_run_by_field(toy, fresh_accelerate):
    """The cache fingerprint records the compute precision: an fp32 cache does not serve a bf16-autocast run."""
    from dllm_align.training import cache as refcache
    from dllm_align.core.errors import UserError
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator

    exs = cache_for(toy, "no")
    rec = recipe(toy, "bf16", f"reference.cache={toy['root'] / 'cache-no'}")
    with pytest.raises(UserError, match="'compute_dtype'.*train.mixed_precision"):
        setup_run(rec, make_accelerator(rec), None, exs)
    fp32 = refcache.fingerprint(recipe(toy, "no"), tokenizer=_tok(), mask_token_id=1, device="cpu", examples=exs).fields
    bf16 = refcache.fingerprint(recipe(toy, "bf16"), tokenizer=_tok(), mask_token_id=1, device="cpu", examples=exs).fields
    assert (fp32["compute_dtype"], bf16["compute_dtype"]) == ("float32", "float32+autocast:bfloat16")
    assert fp32["reference_dtype"] == bf16["reference_dtype"] == "float32"


def test_autocast_cache_from_before_the_tied_head_rule_refused_by_field(toy, fresh_accelerate, monkeypatch):
    """A bf16-autocast reference keeps a head tied to the embeddings in full precision; a cache made before that
    rule (made here by precomputing with the field left out of the fingerprint, as the code before it did) is
    refused by that field under autocast, and still accepted without autocast, where nothing changed."""
    from accelerate.state import AcceleratorState, GradientState

    from dllm_align.core.errors import UserError
    from dllm_align.data.examples import make_collate
    from dllm_align.models.load import build_tiny_tokenizer
    from dllm_align.training import distributed
    from dllm_align.training import reference as ref
    from dllm_align.training.distributed import make_accelerator
    from dllm_align.training.train import setup_run

    real = ref.fingerprint

    def before_the_rule(*a, **kw):
        fp = real(*a, **kw)
        fp.fields.pop("tied_head", None)
        return fp

    for mp in ("bf16", "no"):
        exs = cache_for(toy, mp)
        assert (toy["root"] / f"cache-{mp}" / "manifest.json").exists()
        manifest = json.loads((toy["root"] / f"cache-{mp}" / "manifest.json").read_text())
        assert manifest["fingerprint"].get("tied_head") == ("float32" if mp == "bf16" else None)
        rec = recipe(toy, mp, f"reference.cache={toy['root'] / ('old-cache-' + mp)}")
        with monkeypatch.context() as m:
            m.setattr(ref, "fingerprint", before_the_rule)
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            ref.precompute(rec, exs, make_collate(rec, build_tiny_tokenizer()), distributed.make_accelerator(rec), None)
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        if mp == "bf16":
            with pytest.raises(UserError, match="'tied_head'.*precompute-ref"):
                setup_run(rec, make_accelerator(rec), None, exs)
        else:
            setup_run(rec, make_accelerator(rec), None, exs)


@pytest.mark.parametrize("other, mp", [("flex_attention", "no"), ("flash_attention_2", "bf16")])
def test_cache_made_with_one_attention_backend_refused_by_another_by_field(toy, fresh_accelerate, other, mp):
    """The attention kernel is part of the cached function: an sdpa cache does not serve a flex or flash run."""
    from dllm_align.core.errors import UserError
    from dllm_align.training import cache as refcache
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator

    exs = cache_for(toy, mp)  # made with the default backend (sdpa); flash needs bf16 compute
    manifest = json.loads((toy["root"] / f"cache-{mp}" / "manifest.json").read_text())
    assert manifest["fingerprint"]["attn_implementation"] == "sdpa"
    rec = recipe(toy, mp, f"model.attn_implementation={other}")
    want = f"field 'attn_implementation' is \"sdpa\" in the cache but \"{other}\" here \\(model.attn_implementation\\)"
    if other == "flex_attention":  # a flex run cannot train on the CPU at all (no backward there): refused first
        with pytest.raises(UserError, match="flex_attention cannot train on a CPU"):
            setup_run(rec, make_accelerator(rec), None, exs)
    cache = refcache.ReferenceCache.open(toy["root"] / f"cache-{mp}")
    fp = refcache.fingerprint(rec, tokenizer=_tok(), mask_token_id=cache.manifest["fingerprint"]["mask_token_id"],
                              device="cpu", examples=exs)
    with pytest.raises(UserError, match=want):
        cache.check(fp, exs, 4)
    same = refcache.fingerprint(recipe(toy, mp, "model.attn_implementation=sdpa"), tokenizer=_tok(),
                                mask_token_id=cache.manifest["fingerprint"]["mask_token_id"], device="cpu", examples=exs)
    cache.check(same, exs, 4)  # naming the default explicitly is the same backend


def _tok():
    from dllm_align.models.load import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_mixed_precision_no_is_accepted_from_set_and_yaml(tmp_path):
    """YAML reads a bare `no` as false; for train.mixed_precision it means "no"."""
    assert load_recipe("demo", ["train.mixed_precision=no"]).train.mixed_precision == "no"
    p = tmp_path / "r.yaml"
    p.write_text("name: r\nmodel: {name_or_path: 'builtin:tiny'}\ndata: {train: builtin:toy-sort}\ntrain: {mixed_precision: no}\n")
    assert load_recipe(str(p), []).train.mixed_precision == "no"


# --------------------------------------------------------------------------- the pieces
def test_chunked_head_honours_autocast():
    """A past failure: the chunked head's out= matmul escaped autocast (fp32 head vs the reference's bf16 head)."""
    from dllm_align.models.predictor import chunked_target_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 64, generator=g)
    w = torch.randn(300, 64, generator=g) * 0.5
    t = torch.randint(0, 300, (37,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.log_softmax(torch.nn.functional.linear(h, w).float(), -1).gather(-1, t[:, None]).squeeze(-1)
    got = chunked_target_logprobs(h, w, t, chunk=8, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # same bf16 logits; log-softmax summed in another order
    fp32 = chunked_target_logprobs(h, w, t, chunk=8)
    assert (fp32 - want).abs().max() > 1e-3  # the bf16 rounding is visible: the check has teeth


def test_chunked_head_gradient_matches_autograd_under_bf16():
    from dllm_align.models.predictor import chunked_target_logprobs

    g = torch.Generator().manual_seed(1)
    h = torch.randn(20, 32, generator=g, requires_grad=True)
    w = (torch.randn(50, 32, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, 50, (20,), generator=g)
    chunked_target_logprobs(h, w, t, chunk=7, compute_dtype=torch.bfloat16).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    torch.log_softmax(h @ w.t(), -1).gather(-1, t[:, None]).sum().backward()
    torch.testing.assert_close(gh, h.grad, atol=0.05, rtol=0.05)  # softmax from bf16-rounded logits
    torch.testing.assert_close(gw, w.grad, atol=0.05, rtol=0.05)


def test_rotary_frequencies_stay_fp32_after_a_bf16_load():
    """A past failure's root: a cast to bf16 rounds inv_freq; the loader rebuilds it in fp32 (exactly)."""
    from dllm_align.models.load import load_model

    fp32 = load_model("builtin:tiny").model.model.rotary_emb.inv_freq
    mp = load_model("builtin:tiny", dtype="bfloat16")
    rot = mp.model.model.rotary_emb
    assert mp.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, fp32)
    assert not torch.equal(fp32.to(torch.bfloat16).float(), fp32)  # rounding would have changed them


def test_bf16_rotary_phase_error_at_llada_scale():
    """Why inv_freq must stay fp32: theta 5e5, head dim 128, position 4,095: bf16 inv_freq is off by radians."""
    inv = 1.0 / (5e5 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    err = (4095 * (inv - inv.float().bfloat16().double())).abs()
    assert 7.0 < float(err.max()) < 7.5  # radians, unwrapped
    err1000 = (1000 * (inv - inv.float().bfloat16().double())).abs()
    assert int((err1000 > 0.1).sum()) == 12  # of 64 frequency pairs


def test_reference_linears_stored_in_bf16_compute_identically():
    """prepare_reference stores each Linear in bf16: bit-identical to autocast's per-call cast of the fp32 weight."""
    from dllm_align.models.load import load_model
    from dllm_align.models.precision import Precision, prepare_reference

    prec = Precision(torch.float32, torch.bfloat16)
    a, b = load_model("builtin:tiny"), load_model("builtin:tiny")
    prepare_reference(b.model, prec)
    a.set_precision(prec)
    b.set_precision(prec)
    assert b.model.lm_head.weight.dtype == torch.bfloat16 and b.model.model.norm.weight.dtype == torch.float32
    ids = torch.randint(0, 200, (3, 17), generator=torch.Generator().manual_seed(2))
    rows, cols = torch.tensor([0, 1, 2, 2]), torch.tensor([3, 5, 0, 16])
    tgt = torch.tensor([10, 20, 30, 40])
    with torch.no_grad():
        assert torch.equal(a.target_logprobs(ids, None, rows, cols, tgt), b.target_logprobs(ids, None, rows, cols, tgt))


def test_reference_keeps_a_head_tied_to_the_embeddings_in_fp32():
    """A head tied to the input embeddings (DiffusionGemma's) keeps its fp32 weight in the reference: casting it
    would round the embedding lookups, which autocast leaves fp32 on the policy (0.188 nats of step-0 margin on
    builtin:tiny-diffusiongemma before); every other Linear is stored in bf16."""
    from dllm_align.models.load import load_model
    from dllm_align.models.precision import Precision, prepare_reference

    m = load_model("builtin:tiny-diffusiongemma").model
    emb = m.get_input_embeddings()
    assert m.get_output_embeddings().weight is emb.weight
    before = emb.weight.detach().clone()
    prepare_reference(m, Precision(torch.float32, torch.bfloat16))
    assert emb.weight.dtype == torch.float32 and torch.equal(emb.weight, before)
    others = [x for x in m.modules() if isinstance(x, torch.nn.Linear) and x.weight is not emb.weight]
    assert len(others) > 50 and all(x.weight.dtype == torch.bfloat16 for x in others)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_dropout_with_accumulation_baseline_is_the_gradient_pass_mean(toy, fresh_accelerate, dropout):
    """The no-grad baseline pass and the gradient pass must draw the same LoRA dropout masks.

    The step's no-grad pass (for the baseline) and its gradient pass run a micro-batch under
    the same seed: the margins are identical; an unseeded pass draws other masks.
    """
    from dllm_align.training.train import train

    exs = cache_for(toy, "no")
    rec = recipe(toy, "no", "train.batch_size=2", "train.grad_accum=2", "train.max_steps=2", "train.lora.enabled=true",
                 "train.lora.r=4", f"train.lora.dropout={dropout}", out=f"dropout-{dropout}")
    train(rec, examples=exs)  # the accumulation path runs with dropout
    # exact check through the library: the same step's two passes give the same margins
    from dllm_align.training.train import setup_run
    from dllm_align.training.distributed import make_accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    run = setup_run(rec.model_copy(update={"output_dir": str(toy["root"] / f"dropout-run-{dropout}")}), make_accelerator(rec), None, exs)
    for p in run.policy.params:  # adapters away from zero, so dropout matters
        p.data.normal_(0, 0.2)
    b = run.to_device(run.collate_units(run.data.micro_batches(0, run.plan)[1]))
    with torch.no_grad(), run.same_dropout(1):
        first = run.policy_elbo(b)
    with run.same_dropout(1):
        second = run.policy_elbo(b)
    with torch.no_grad():
        other = run.policy_elbo(b)  # unseeded: a fresh draw
    assert torch.equal(first, second.detach())
    if dropout:
        assert not torch.equal(first, other)


def test_process_group_timeout_reaches_accelerate():
    """torch's 10-minute NCCL default once applied; every launch now passes the recipe's timeout (default 60)."""
    from datetime import timedelta

    from accelerate.utils import AutocastKwargs, InitProcessGroupKwargs

    from dllm_align.models.precision import accelerator_kwargs

    for sets, minutes in (([], 60), (["train.process_group_timeout_minutes=180"], 180)):
        kw = accelerator_kwargs(load_recipe("kto_mix_14k", sets))
        pg = next(k for k in kw if isinstance(k, InitProcessGroupKwargs))
        assert pg.timeout == timedelta(minutes=minutes)
        assert next(k for k in kw if isinstance(k, AutocastKwargs)).cache_enabled is False


def test_mixed_precisions_would_break_the_invariant(toy):
    """The invariant tests have teeth: an fp32 reference against a bf16-autocast policy (what a head that escapes
    autocast does) is far from 0."""
    from dllm_align.objective.elbo import DrawConfig, elbo_draws
    from dllm_align.data.examples import make_collate
    from dllm_align.models.load import load_model
    from dllm_align.models.precision import Precision

    exs = cache_for(toy, "no")
    policy, reference = load_model("builtin:tiny"), load_model("builtin:tiny")
    policy.set_precision(Precision(torch.float32, torch.bfloat16))
    b = make_collate(recipe(toy, "no"), policy.tokenizer)(exs[:8])
    args = (b["input_ids"], b["attention_mask"], b["completion_mask"], b["ids"], DrawConfig(n_mc=4))
    with torch.no_grad():
        margins = elbo_draws(policy, *args).mean(1) - elbo_draws(reference, *args).mean(1)
    assert float(margins.abs().max()) > 1e-3, margins  # measured 5.8e-3 nats on these short rows (random tiny model)


def test_lora_dropout_gradient_under_fsdp2_activation_checkpointing_equals_unchecked():
    """accelerate's FSDP2 activation checkpointing (``fsdp2_apply_ac``: preserve_rng_state=False) recomputes
    LoRA dropout with new masks; after ``preserve_checkpoint_rng`` the gradient is the unchecked one."""
    import copy
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac
    from peft import LoraConfig, get_peft_model

    from dllm_align.models.load import load_model
    from dllm_align.training.distributed import preserve_checkpoint_rng

    mp = load_model("builtin:tiny")
    get_peft_model(mp.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj", "up_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at 0: give the adapters a value so dropout reaches the gradient
        for n, p in mp.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    mp.model.train()
    ids = torch.randint(0, 250, (2, 24), generator=g)

    def grads(model):
        torch.manual_seed(7)
        out = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum()
        params = [p for n, p in model.named_parameters() if "lora_" in n]
        return torch.cat([x.reshape(-1) for x in torch.autograd.grad(out, params)])

    plain = grads(mp.model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=True)
    acc = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin))
    checked = fsdp2_apply_ac(acc, copy.deepcopy(mp.model))
    before = grads(checked)
    assert float((before - plain).norm() / plain.norm()) > 0.05  # new masks in the recompute: another gradient
    assert preserve_checkpoint_rng(checked) == 2  # one wrapper per decoder layer
    after = grads(checked)
    torch.testing.assert_close(after, plain, atol=1e-6, rtol=1e-5)


def _tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return Qwen3MoeForCausalLM(cfg).eval()
    finally:
        torch.random.set_rng_state(state)


def test_moe_experts_compute_in_bf16_under_autocast_for_policy_and_reference(monkeypatch):
    """transformers' grouped-matmul experts bypass autocast: with fp32 master weights they ran in fp32.
    Routed through dllm-align's experts function they multiply in bf16, and a reference whose expert
    blocks are stored in bf16 computes bit-identically."""
    import copy

    from transformers.integrations import moe

    from dllm_align.models.precision import Precision, autocast, experts_in_compute_precision, prepare_reference

    policy = _tiny_moe()
    ref = copy.deepcopy(policy)
    seen = []
    orig = moe._grouped_mm

    def spy(input, weight, offs):
        seen.append((input.dtype, weight.dtype))
        return orig(input, weight, offs)

    monkeypatch.setattr(moe, "_grouped_mm", spy)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    prec = Precision(torch.float32, torch.bfloat16)
    with torch.no_grad(), autocast(prec, "cpu"):
        policy(input_ids=ids, use_cache=False)
    assert seen and all(dt == (torch.float32, torch.float32) for dt in seen)  # the defect: fp32 expert matmuls
    seen.clear()
    assert experts_in_compute_precision(policy)
    with autocast(prec, "cpu"):
        a = policy(input_ids=ids, use_cache=False).logits
    assert seen and all(w == torch.bfloat16 for _, w in seen)  # _grouped_mm casts its input to the weights' dtype
    a.float().sum().backward()  # gradients reach the fp32 master weights of every expert block
    experts = policy.model.layers[0].mlp.experts
    assert experts.down_proj.dtype == torch.float32 and experts.down_proj.grad.abs().sum() > 0
    prepare_reference(ref, prec)
    experts_in_compute_precision(ref)
    assert ref.model.layers[0].mlp.experts.down_proj.dtype == torch.bfloat16
    with torch.no_grad(), autocast(prec, "cpu"):
        b = ref(input_ids=ids, use_cache=False).logits
    assert torch.equal(a.detach(), b)


def test_lladamoe_policy_and_reference_route_experts_through_the_compute_precision(tmp_path):
    """The LLaDA-MoE family's native body: the policy (set_precision) and the reference
    (load path: prepare_reference + set_precision) both get the experts function; bf16 target
    log-probabilities of the two agree exactly."""
    from test_families import _moe

    from dllm_align.models.load import load_model
    from dllm_align.models.precision import EXPERTS_IMPL, Precision, prepare_reference

    folder, cfg, _ = _moe(tmp_path)
    prec = Precision(torch.float32, torch.bfloat16)
    pol, ref = load_model(str(folder), dtype="float32"), load_model(str(folder), dtype="float32")
    pol.set_precision(prec)
    prepare_reference(ref.model, prec)
    ref.set_precision(prec)
    assert pol.model.config._experts_implementation == ref.model.config._experts_implementation == EXPERTS_IMPL
    ids = torch.randint(0, cfg["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(2))
    rows, cols = torch.tensor([0, 0, 1]), torch.tensor([3, 7, 11])
    with torch.no_grad():
        a = pol.target_logprobs(ids, None, rows, cols, ids[rows, cols])
        b = ref.target_logprobs(ids, None, rows, cols, ids[rows, cols])
    assert torch.equal(a, b)


def test_flash_attention_with_fp32_compute_is_refused_by_name(tmp_path):
    """flash-attn takes bf16 / fp16 only: `mixed_precision: no` with fp32 weights is refused by the recipe
    check (train, precompute, doctor alike), naming both keys; bf16 autocast or bf16 weights are fine."""
    from typer.testing import CliRunner

    from dllm_align.cli.app import app
    from dllm_align.core.errors import UserError

    bad = ["model.attn_implementation=flash_attention_2", "train.mixed_precision=no"]
    with pytest.raises(UserError, match="model.attn_implementation flash_attention_2 needs bf16.*train.mixed_precision"):
        load_recipe("demo", bad)
    assert load_recipe("demo", [bad[0], "train.mixed_precision=bf16"]).model.attn_implementation == "flash_attention_2"
    assert load_recipe("demo", [*bad, "model.dtype=bfloat16"]).model.dtype == "bfloat16"
    res = CliRunner().invoke(app, ["doctor", "demo", "-o", str(tmp_path / "r"), *[x for kv in bad for x in ("--set", kv)]])
    assert res.exit_code == 2 and res.stderr.startswith("Error:") and "train.mixed_precision" in res.stderr
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- the step-0 check has teeth
def _plant(defect: str, monkeypatch):
    """The two step-0 defects this project found, planted in the reference's preparation as they were:
    ``rotary``: the reference's rotary frequencies in bf16 (a bf16 cast without the fp32 rebuild);
    ``tied``: every Linear of the reference cast to bf16, a head tied to the embeddings too (the rule before
    the tied-head fix), which rounds the reference's embedding lookups only."""
    from dllm_align.models import precision
    from dllm_align.training import reference

    good = reference.prepare_reference

    def rotary_in_bf16(model, prec):
        good(model, prec)
        for mod in model.modules():
            if isinstance(getattr(mod, "inv_freq", None), torch.Tensor):
                mod.inv_freq = mod.inv_freq.to(torch.bfloat16)

    def tied_head_rounded(model, prec):
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) or precision._is_experts(mod):
                mod.to(prec.autocast)

    if defect != "none":
        monkeypatch.setattr(reference, "prepare_reference", {"rotary": rotary_in_bf16, "tied": tied_head_rounded}[defect])


def _long_rows(path: Path, n: int, prompt: int, completion: int, vary: int = 0) -> Path:
    """``n`` unpaired rows, row i's completion ``completion + vary * i`` tokens (the byte-level tokenizer)."""
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": [{"role": "user", "content": "p" * prompt + str(i)}],
                                        "completion": [{"role": "assistant", "content": "c" * (completion + vary * i)}],
                                        "label": i % 2 == 0}) + "\n" for i in range(n)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def llada_rotary(tmp_path_factory):
    """A random body with LLaDA's rotary embedding (head dim 128, theta 5e5) and 8 rows of 256 tokens."""
    from dllm_align.models.load import TinySpec, save_tiny

    root = tmp_path_factory.mktemp("rotary")
    folder = save_tiny(root / "model", TinySpec(hidden_size=128, heads=1, layers=2, intermediate_size=128))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 500000.0
    (folder / "config.json").write_text(json.dumps(cfg))
    return {"model": str(folder), "data": _long_rows(root / "rows.jsonl", 16, 80, 176), "max_length": 320, "root": root}


@pytest.fixture(scope="module")
def gemma_rows(tmp_path_factory):
    """DiffusionGemma's shrunk model (a head tied to the embeddings) and 8 rows of 64 tokens."""
    root = tmp_path_factory.mktemp("tied")
    return {"model": "builtin:tiny-diffusiongemma", "data": _long_rows(root / "rows.jsonl", 16, 10, 44), "max_length": 96,
            "root": root}


def _step0(case, *sets):
    from dllm_align.training.distributed import make_accelerator
    from dllm_align.training.doctor import step0_check
    from dllm_align.training.train import setup_run

    rec = load_recipe(None, [f"model.name_or_path={case['model']}", f"data.train={case['data']}", "data.format=unpaired",
                             f"data.max_length={case['max_length']}", "data.padding=none", "train.mixed_precision=bf16",
                             "reference.mode=online", "reference.n_mc=2", "train.n_mc=2", "train.batch_size=4",
                             "train.global_batch_size=8", *sets], output_dir=str(case["root"] / "run"))
    run = setup_run(rec, make_accelerator(rec))
    return run, step0_check(run, 2, same_shapes=True)


@pytest.mark.parametrize("defect", ["none", "rotary", "tied"])
def test_step0_check_fails_on_each_planted_defect_and_passes_on_the_correct_reference(
        defect, llada_rotary, gemma_rows, fresh_accelerate, monkeypatch):
    """bf16 autocast, online reference (the policy's own micro-batches): on the CPU the correct reference gives
    margins of exactly 0, and each planted defect fails the check under the CPU's exact rule and under the rule CUDA
    applies (each row's fp32 summation bound, docs/benchmarks.md#the-step-0-check) alike. On a CUDA device (gpu_check's
    pytest part selects it by name) the same test checks that rule there."""
    from dllm_align.training.doctor import summation_tolerance

    _plant(defect, monkeypatch)
    cases = {"none": [llada_rotary, gemma_rows], "rotary": [llada_rotary], "tied": [gemma_rows]}[defect]
    for case in cases:
        run, check = _step0(case)
        cpu = run.plan.device.type == "cpu"  # on CUDA (the device run) the summation bound is the rule itself
        assert len(check["margins"]) == 16 and check["exact"] == cpu
        over = [abs(p - r) / summation_tolerance(r, n) for p, r, n in _values(run)]
        if defect == "none":
            assert check["worst_excess"] <= 1 and max(over) <= 1, (case["model"], check["worst"], check["nondeterministic_ops"])
            assert check["max_abs_margin"] == 0.0 or not cpu, case["model"]
        else:
            print(f"{defect}: max |margin| {check['max_abs_margin']:.4g} nats, up to {max(over):.1f}x its row's CUDA bound")
            assert check["worst_excess"] > 1 and max(over) > 2, (defect, check["max_abs_margin"], max(over))


def _values(run):
    from dllm_align.training.loop import invariant_values

    return list(invariant_values(run, 2).values())


def test_step0_check_on_a_cache_from_other_micro_batches_allows_the_measured_rounding(llada_rotary, fresh_accelerate,
                                                                                       tmp_path):
    """A cache computed in packed micro-batches of 2 read by a run in micro-batches of 4: rows met other row-mates,
    so bf16 kernels rounded them differently (nonzero margins on the correct code). The check measures that spread on
    this backend (each row scored alone) and passes the correct cache. Measured: max |margin| 0.013 nats, spread 0.033,
    so 0.13 nats allowed: more than the planted rotary defect adds on this random body (0.034), which is why the exact
    check needs a cache made in the run's micro-batches (docs/benchmarks.md#the-step-0-check)."""
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.training import reference as ref
    from dllm_align.training.distributed import make_accelerator
    from dllm_align.training.doctor import step0_check
    from dllm_align.training.train import setup_run

    case = dict(llada_rotary, root=tmp_path, data=_long_rows(tmp_path / "rows.jsonl", 16, 40, 40, vary=12))
    sets = [f"model.name_or_path={case['model']}", f"data.train={case['data']}", "data.format=unpaired",
            f"data.max_length={case['max_length']}", "data.padding=packed", "train.mixed_precision=bf16", "reference.n_mc=2",
            "train.n_mc=2", "train.global_batch_size=8", f"reference.cache={tmp_path / 'cache'}"]
    made = load_recipe(None, sets + ["train.batch_size=2"], output_dir=str(tmp_path / "made"))
    ref_mp = ref.load_reference(made, make_accelerator(made).device)  # the device the run checks on
    exs = load_training_examples(made, ref_mp.tokenizer, quiet=True)
    ref.precompute(made, exs, make_collate(made, ref_mp.tokenizer), None, ref_mp)
    rec = load_recipe(None, sets + ["train.batch_size=4", "reference.mode=cached"], output_dir=str(tmp_path / "run"))
    run = setup_run(rec, make_accelerator(rec), None, exs)
    check = step0_check(run, 2, same_shapes=False)
    assert not check["exact"] and check["composition_spread"] > 0
    assert check["max_abs_margin"] > 0 and check["worst_excess"] <= 1, check["worst"]


@pytest.mark.parametrize("n", [50, 256, 2000])
def test_step0_summation_bound_covers_any_fp32_summation_order(n):
    """The CUDA rule's derivation checked numerically: n log-probabilities (mean -5 nats) summed in fp32 in 200
    random orders (what index_add's atomics may do) stay within the row's bound; measured, the worst pair of orders
    differs by under 0.2 of it at every n."""
    import numpy as np

    from dllm_align.training.doctor import summation_tolerance

    rng = np.random.default_rng(0)
    x = -rng.gamma(2.0, 2.5, n).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    sums = [float(np.cumsum(x[rng.permutation(n)], dtype=np.float32)[-1]) for _ in range(200)]
    spread = max(sums) - min(sums)
    assert 0 < spread < 0.3 * summation_tolerance(exact, n), (spread, summation_tolerance(exact, n))
