"""The training loop (docs/design.md#the-step-batch, #the-elbo-kto-loss) on the built-in tiny model, in process, on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dllm_align.core.errors import RunFailure, UserError
from dllm_align.config.recipe import load_recipe
from dllm_align.training.checkpoint import merged_state_dict
from dllm_align.training.monitor import MarginWatch
from dllm_align.training.optim import lr_at
from dllm_align.training.train import train

from fixtures.sort_toy import write_pairs




@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """16 sorting pairs (32 unpaired rows) and their reference cache (K=4)."""
    from dllm_align.training import reference as ref
    from dllm_align.models.load import load_model
    from dllm_align.data.examples import load_training_examples, make_collate

    root = tmp_path_factory.mktemp("toy")
    data = write_pairs(root / "pairs.jsonl", n=16)
    cache = root / "ref_cache"
    rec = recipe_for(root, data, cache)
    mp = load_model("builtin:tiny")
    exs = load_training_examples(rec, mp.tokenizer, quiet=True)
    ref.precompute(rec, exs, make_collate(rec, mp.tokenizer), None, mp)
    return {"root": root, "data": data, "cache": cache, "examples": exs}


def recipe_for(root: Path, data: Path, cache: Path, *sets: str, out: str = "run"):
    return load_recipe(
        None,
        [
            f"data.train={data}",
            "data.format=paired",
            "data.max_length=64",
            "reference.n_mc=4",
            "reference.shard_size=8",
            "reference.batch_size=16",
            f"reference.cache={cache}",
            "train.lr=1e-3",
            "train.warmup_ratio=0",
            "train.scheduler=constant",
            *sets,
        ],
        output_dir=str(root / out),
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def assert_same_params(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


# --------------------------------------------------------------------------- pure pieces
def test_lr_schedule_hand_values():
    """10 steps, 20% warm-up (2 steps), cosine: 0.5, 1.0, then 0.5 (1 + cos(pi k / 8)) for k = 0..7."""
    got = [lr_at(s, 10, 1.0, 0.2, "cosine") for s in range(10)]
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert got == pytest.approx(want)
    assert [lr_at(s, 4, 2.0, 0.0, "linear") for s in range(4)] == pytest.approx([2.0, 1.5, 1.0, 0.5])
    assert lr_at(3, 4, 2.0, 0.0, "constant") == 2.0
    # the paper's 3%: ceil(0.03 * 1687) = 51 warm-up steps, peak reached at step index 50
    assert lr_at(50, 1687, 1e-6, 0.03, "cosine") == pytest.approx(1e-6)
    assert lr_at(49, 1687, 1e-6, 0.03, "cosine") < 1e-6


def test_lora_merge_matches_peft():
    from peft import LoraConfig, get_peft_model

    from dllm_align.models.load import build_tiny_model
    from dllm_align.config.schema import LoraSection

    model = build_tiny_model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoraSection(r=4, alpha=8)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_()
    sd = {"model." + k: v for k, v in peft_model.base_model.model.state_dict().items()}
    merged, adapter = merged_state_dict(sd, lora)
    assert adapter and all(".lora_" in k for k in adapter)
    reference = peft_model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], reference[k], atol=1e-6, rtol=1e-6)
    changed = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)


def test_margin_watch_warns_on_three_falling_windows():
    w = MarginWatch(window=2)
    msgs = [w.add(s, v) for s, v in enumerate([0.5, 0.5, 0.2, 0.2, -0.1, -0.1, -0.4, -0.4, -0.3, -0.3])]
    fired = [i for i, m in enumerate(msgs) if m]
    assert fired == [7]  # windows 0.5 > 0.2 > -0.1 > -0.4: the fourth window closes at step 7
    again = MarginWatch.from_state(json.loads(json.dumps(w.state())), 2)
    assert again.means == w.means
    assert MarginWatch(window=2).add(0, None) is None


# --------------------------------------------------------------------------- the baseline over the whole step
def test_accumulation_equals_one_big_batch(toy):
    """1 x batch 4, 1 x (4 micro-batches of 1) and 1 x (2 of 2): same loss, baseline, gradient norm, parameters.

    Adam's update is nearly invariant to the gradient's scale, so the gradient
    norm is compared too: it catches a wrong 1/m or a per-micro-batch baseline.
    """
    runs = {}
    for name, b, a in (("b4", 4, 1), ("a4", 1, 4), ("a2", 2, 2)):
        rec = recipe_for(toy["root"], toy["data"], toy["cache"], f"train.batch_size={b}", f"train.grad_accum={a}", "train.max_steps=3", out=f"eq-{name}")
        train(rec, examples=toy["examples"])
        runs[name] = (metrics(rec.output_dir), final_params(rec.output_dir))
    ref_m, ref_p = runs["b4"]
    assert ref_m[-1]["grad_norm"] > 0 and ref_m[-1]["baseline"] != 0
    for name in ("a4", "a2"):
        m, p = runs[name]
        for x, y in zip(ref_m, m):
            for key in ("loss", "baseline", "grad_norm", "reward_desirable", "reward_undesirable"):
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (name, x["step"], key)
        # Splitting the step changes the order of float sums (and, with packed rows, which sequences
        # share a row); Adam's normalised update (lr 1e-3) turns that rounding into parameter
        # differences of ~5e-6 on elements with tiny gradients.
        assert_same_params(ref_p, p, atol=1e-5)


def test_per_micro_batch_baseline_would_differ(toy):
    """The check above has teeth: one micro-batch of 4 with baseline 0 gives another gradient."""
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", "train.baseline=none", out="eq-none")
    train(rec, examples=toy["examples"])
    with_b = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", out="eq-b4-2")
    train(with_b, examples=toy["examples"])
    a, b = metrics(rec.output_dir), metrics(with_b.output_dir)
    assert a[-1]["baseline"] == 0.0
    assert abs(a[-1]["grad_norm"] - b[-1]["grad_norm"]) > 1e-4 * b[-1]["grad_norm"]


def test_online_reference_gives_the_cached_losses(toy):
    sets = ("train.batch_size=2", "train.grad_accum=2", "train.max_steps=4")
    cached = recipe_for(toy["root"], toy["data"], toy["cache"], *sets, out="ref-cached")
    online = recipe_for(toy["root"], toy["data"], toy["cache"], *sets, "reference.mode=online", out="ref-online")
    train(cached, examples=toy["examples"])
    train(online, examples=toy["examples"])
    a, b = metrics(cached.output_dir), metrics(online.output_dir)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6)
        assert y["baseline"] == pytest.approx(x["baseline"], abs=1e-4)
    assert_same_params(final_params(cached.output_dir), final_params(online.output_dir), atol=1e-5)


def test_fewer_draws_than_cached(toy):
    """train.n_mc = 2 uses draws 0 and 1 of the 4 cached: the first step's margins are still exactly ~0."""
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.n_mc=2", "train.batch_size=4", "train.max_steps=2", out="k2")
    train(rec, examples=toy["examples"])
    m = metrics(rec.output_dir)
    assert abs(m[0]["reward_desirable"]) < 1e-4 and abs(m[0]["reward_undesirable"]) < 1e-4
    assert m[0]["loss"] == pytest.approx(0.5, abs=1e-5)


# --------------------------------------------------------------------------- learning the toy
def _margin_gap(final_dir: Path, examples, seed: int = 123) -> float:
    """Mean fresh-mask ELBO margin (policy - reference) of desirable rows minus that of undesirable rows."""
    from dllm_align.data.batching import collate
    from dllm_align.objective.elbo import DrawConfig, elbo
    from dllm_align.models.load import load_model

    pol = load_model(str(final_dir))
    ref = load_model("builtin:tiny")
    cfg = DrawConfig(n_mc=16, seed=seed)  # masks the training never saw
    batch = collate(examples, "none", 64, pol.tokenizer.pad_token_id)
    with torch.no_grad():
        r = elbo(pol, batch, cfg) - elbo(ref, batch, cfg)
    d = batch["labels"]
    return float(r[d].mean() - r[~d].mean())


@pytest.mark.parametrize("objective", ["elbo_kto", "vrpo"])
def test_training_opens_a_gap_between_the_classes(toy, objective):
    # elbo_kto: one batch of all 32 rows. With uniform batches of 8 (the default, as the paper draws them) a
    # batch rarely holds both rows of a prompt, and 24 steps at lr 3e-3 open the training gap but
    # not the fresh-mask one (measured -0.13; length-grouped batches of 8, which pair the equally
    # long chosen and rejected rows, gave 1.55).
    batch = {"elbo_kto": 32, "vrpo": 8}[objective]
    rec = recipe_for(
        toy["root"], toy["data"], toy["cache"], f"train.objective={objective}", f"train.batch_size={batch}",
        "train.max_steps=24", "train.lr=3e-3", out=f"learn-{objective}",
    )
    train(rec, examples=toy["examples"])
    m = metrics(rec.output_dir)
    gap = [x["reward_desirable"] - x["reward_undesirable"] for x in m]
    assert sum(gap[-6:]) / 6 > sum(gap[:6]) / 6 + 0.5, gap
    held_out = _margin_gap(Path(rec.output_dir) / "final", toy["examples"])
    assert held_out > 1.0, held_out  # at the start it is exactly 0: policy = reference
    if objective == "vrpo":
        assert m[-1]["reward_accuracy"] > 0.5


def test_sft_raises_the_elbo(toy):
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.objective=sft", "train.sft_rows=desirable",
                     "train.batch_size=8", "train.max_steps=12", "train.lr=3e-3", out="sft")
    train(rec, examples=toy["examples"])
    m = metrics(rec.output_dir)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5  # loss = -ELBO per token
    assert "reward_desirable" not in m[0] and "baseline" not in m[0]  # SFT reports no margins


# --------------------------------------------------------------------------- checkpoints, LoRA, failures
def test_checkpoints_reload_with_plain_transformers(toy):
    from transformers import AutoModelForCausalLM

    from dllm_align.models.load import load_model

    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=5",
                     "train.save_every=2", "train.keep_checkpoints=1", out="ckpt")
    train(rec, examples=toy["examples"])
    out = Path(rec.output_dir)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]  # step-2 pruned, no temp dirs
    # checkpoints keep the native layout (plain transformers reads them); final/ is in LLaDA's published layout
    # (tests/test_export_roundtrip.py), which dllm-align reads back to the same numbers
    folder = out / "checkpoints" / "step-4"
    plain = AutoModelForCausalLM.from_pretrained(str(folder))
    mp = load_model(str(folder))
    x = torch.randint(0, 256, (1, 10))
    torch.testing.assert_close(plain(x).logits, mp.logits(x))
    assert not plain.config.is_causal
    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == ["LLaDAModelLM"]
    assert load_model(str(out / "final")).logits(x).shape == mp.logits(x).shape
    summary = json.loads((out / "final" / "training_summary.json").read_text())
    assert summary["steps"] == 5 and summary["steps_per_s"] > 0
    st = json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert st["step"] == 4 and st["global_batch_size"] == 4
    opt = torch.load(out / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    assert opt["state"]
    assert (out / "recipe.train.yaml").exists() and (out / "run_info.train.json").exists()


def test_lora_trains_adapter_only_and_exports_merged(toy):
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=3", "train.save_every=2",
                     "train.lora.enabled=true", "train.lora.r=4", "train.lr=1e-2", out="lora")
    train(rec, examples=toy["examples"])
    from dllm_align.models.load import build_tiny_model

    from dllm_align.models.export import published_state

    base = published_state("llada", build_tiny_model().state_dict())  # final/ has LLaDA's published weight names
    final = final_params(rec.output_dir)
    assert final.keys() == base.keys()
    changed = {k for k in final if not torch.equal(final[k], base[k])}
    assert changed and all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "attn_out")) for k in changed)
    ck = Path(rec.output_dir) / "checkpoints" / "step-2"
    assert (ck / "adapter.safetensors").exists()
    # the checkpoint holds what trains: the adapters, their AdamW state and the run's state, not the base
    from safetensors.torch import load_file

    adapters = load_file(str(ck / "adapter.safetensors"))
    a_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    size = sum(p.stat().st_size for p in ck.rglob("*") if p.is_file())
    assert not list(ck.glob("model*.safetensors")) and size < 2 * (a_bytes + 2 * a_bytes), (size, a_bytes)
    # final/: the merged model and the adapters, which peft applies to the base to the same numbers
    from peft import PeftModel

    from dllm_align.models.load import load_model

    peft_model = PeftModel.from_pretrained(build_tiny_model(), str(Path(rec.output_dir) / "final" / "adapter"))
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        want = peft_model(input_ids=x).logits
    torch.testing.assert_close(load_model(str(Path(rec.output_dir) / "final")).logits(x), want, atol=1e-5, rtol=1e-5)


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(toy):
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=6",
                     "train.save_every=1", "train.lr=1e30", "train.max_grad_norm=null", out="nan")
    with pytest.raises(RunFailure) as e:
        train(rec, examples=toy["examples"])
    msg = e.value.message
    step = int(msg.split(" at step ")[1].split(";")[0])
    assert "non-finite" in msg and step >= 2
    good = Path(rec.output_dir) / "checkpoints" / f"step-{step - 1}"
    assert str(good) in msg and (good / "trainer_state.json").exists()
    assert not (Path(rec.output_dir) / "final").exists()


def test_existing_run_needs_resume_or_overwrite(toy):
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=1", out="again")
    train(rec, examples=toy["examples"])
    with pytest.raises(UserError, match="already holds a training run") as e:
        train(rec, examples=toy["examples"])
    assert "--resume" in e.value.hint and "--overwrite" in e.value.hint
    train(rec, examples=toy["examples"], overwrite=True)
    assert len(metrics(rec.output_dir)) == 1


def test_global_batch_size_derives_accumulation(toy):
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=2", "train.global_batch_size=4",
                     "train.max_steps=1", out="gbs")
    train(rec, examples=toy["examples"])
    st = json.loads((Path(rec.output_dir) / "final" / "training_summary.json").read_text())
    assert st["global_batch_size"] == 4
    with pytest.raises(UserError, match="global_batch_size"):
        recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=3", "train.global_batch_size=4")


@pytest.mark.parametrize("lora", [False, True])
def test_resume_continues_exactly(toy, lora):
    """2 steps, then --resume to 4 (constant lr), equals 4 straight steps bitwise (optimiser state restored)."""
    extra = ["train.lora.enabled=true", "train.lora.r=4", "train.lr=1e-2"] if lora else []
    straight = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=4", *extra, out=f"res-straight-{lora}")
    train(straight, examples=toy["examples"])
    first = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", "train.save_every=2", *extra, out=f"res-split-{lora}")
    train(first, examples=toy["examples"])
    more = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=4", "train.save_every=2", *extra, out=f"res-split-{lora}")
    train(more, examples=toy["examples"], resume=True)
    a, b = final_params(straight.output_dir), final_params(more.output_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["step"] for r in metrics(more.output_dir)] == [1, 2, 3, 4]


def test_gradient_checkpointing_gives_the_same_steps(toy):
    plain = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", out="gc-off")
    ckpt = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", "model.gradient_checkpointing=true", out="gc-on")
    train(plain, examples=toy["examples"])
    train(ckpt, examples=toy["examples"])
    for x, y in zip(metrics(plain.output_dir), metrics(ckpt.output_dir)):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)


def test_class_weights_from_the_sidecar(toy, tmp_path):
    from dllm_align.training.plan import class_weights

    side = tmp_path / "w.weights.json"
    side.write_text(json.dumps({"lambda_desirable": 1.0, "lambda_undesirable": 0.25}))
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], f"data.weights_file={side}")
    assert class_weights(rec) == (1.0, 0.25)
    assert class_weights(recipe_for(toy["root"], toy["data"], toy["cache"], "train.lambda_undesirable=0.3")) == (1.0, 0.3)
    # the loss uses them: at step 1 policy = reference, so every row has 1 - sigmoid(0) = 1/2 and loss = mean(lambda) / 2
    from dllm_align.data.batching import plan_batches

    rec = recipe_for(toy["root"], toy["data"], toy["cache"], f"data.weights_file={side}", "train.batch_size=8", "train.max_steps=1", out="weights")
    train(rec, examples=toy["examples"])
    first = plan_batches([ex.length for ex in toy["examples"]], 8, 0, 0, True, drop_last=True)[0]
    n_d = sum(1 for i in first if toy["examples"][i].label)
    assert 0 < n_d < 8
    assert metrics(rec.output_dir)[0]["loss"] == pytest.approx((n_d * 1.0 + (8 - n_d) * 0.25) / 8 / 2, abs=1e-6)


def test_lora_unmerged_export_is_a_peft_adapter(toy):
    from peft import PeftModel

    from dllm_align.models.load import build_tiny_model, load_model

    rec = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", "train.lora.enabled=true",
                     "train.lora.r=4", "train.lr=1e-2", "train.lora.merge_on_export=false", out="lora-peft")
    train(rec, examples=toy["examples"])
    final = Path(rec.output_dir) / "final"
    assert (final / "adapter_model.safetensors").exists() and not (final / "model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(build_tiny_model(), str(final))
    # the same function as the merged export of the same run
    merged = recipe_for(toy["root"], toy["data"], toy["cache"], "train.batch_size=4", "train.max_steps=2", "train.lora.enabled=true",
                        "train.lora.r=4", "train.lr=1e-2", out="lora-merged")
    train(merged, examples=toy["examples"])
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, load_model(str(Path(merged.output_dir) / "final")).logits(x), atol=1e-5, rtol=1e-5)


def test_fused_optimizer_gives_the_loop_update():
    """build_optimizer's fused AdamW (CPU) makes the per-tensor loop's updates, decay groups included."""
    from dllm_align.config.schema import TrainSection
    from dllm_align.training.optim import build_optimizer

    t = TrainSection(lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 5)
            self.norm = torch.nn.LayerNorm(5)

        def forward(self, x):
            return self.norm(self.proj(x))

    def model():
        m = Net()
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        return m

    a, b = model(), model()
    fused = build_optimizer(a.named_parameters(), t)
    assert fused.param_groups[0]["fused"] is True
    assert [len(gr["params"]) for gr in fused.param_groups] == [1, 3]  # the projection decays; its bias and the norm do not
    assert [gr["weight_decay"] for gr in fused.param_groups] == [0.1, 0.0]
    loop = torch.optim.AdamW(
        [{"params": [b.proj.weight], "weight_decay": 0.1}, {"params": [b.proj.bias, *b.norm.parameters()], "weight_decay": 0.0}],
        lr=1e-2, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=False,
    )
    for _ in range(4):
        x = torch.randn(3, 6, generator=g)
        for m, opt in ((a, fused), (b, loop)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    assert build_optimizer(a.named_parameters(), TrainSection(mixed_precision="fp16")).param_groups[0]["fused"] is not True
    assert build_optimizer(a.named_parameters(), t, fused_ok=False).param_groups[0]["fused"] is not True


def test_a_run_resolves_its_recipe_once_and_reads_config_json_once(toy, tiny_dir, monkeypatch):
    """One `train` of a model folder with the reference loaded beside the policy (the three loads that each
    read the folder's config.json before: the plan, the policy, the reference; the export a fourth time): the
    plan reads it once and every later step takes it from the plan; the family, the padding and the FSDP launch
    are resolved once. Reads inside transformers' own from_pretrained are not dllm-align's and not counted."""
    import builtins
    import io
    import os
    import sys

    from dllm_align.training import plan as plan_mod

    config = str(tiny_dir / "config.json")
    reads: list[str] = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if str(file) == config:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.endswith("pathlib.py"):
                frame = frame.f_back
            where = frame.f_code.co_filename if frame is not None else ""
            if f"{os.sep}dllm_align{os.sep}" in where:  # transformers' own reads inside from_pretrained are its own
                reads.append(frame.f_code.co_name)
        return real_open(file, *args, **kwargs)

    calls = {"model_source": 0, "resolve_padding": 0, "check_fsdp": 0}

    def counted(name):
        real = getattr(plan_mod, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in calls:
        monkeypatch.setattr(plan_mod, name, counted(name))
    rec = recipe_for(toy["root"], toy["data"], toy["cache"], f"model.name_or_path={tiny_dir}", "reference.mode=online",
                     "train.batch_size=4", "train.max_steps=1", out="config-once")
    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    result = train(rec)
    monkeypatch.setattr(io, "open", real_open)
    monkeypatch.setattr(builtins, "open", real_open)
    assert result.steps == 1 and (result.final_dir / "config.json").is_file()
    assert calls == {"model_source": 1, "resolve_padding": 1, "check_fsdp": 1}
    assert reads == ["model_source"]
