"""Same numbers on every launch, multi-process: DDP, FSDP1 and FSDP2 on 2 gloo processes.

One ``torchrun`` launch (tests/dist_invariants.py) checks every configuration,
so the suite pays for one process start-up:

* the step-0 invariant (also for a block-diffusion model, online): every row's margin is exactly 0 (CPU; see
  test_invariants.py for why exactly) for DDP / FSDP1 / FSDP2 x fp32 / bf16
  autocast x (cached reference, no LoRA) and (online reference, LoRA);
* the rotary frequencies the forward uses are fp32 under FSDP + bf16, and the
  FSDP policy reduces gradients in fp32 without casting parameters (the
  accelerate default, run raw, still casts them to bf16: the defect);
* LoRA under FSDP: the gradient norm is the global one on every rank
  (each rank's shard alone gives another number), and a NaN in one rank's
  shard is seen by all ranks;
* after 3 steps with clipping active, DDP, FSDP1, FSDP2 and one process hold
  the same weights (fp32; full fine-tune and LoRA);
* an FSDP run stopped after its step-2 checkpoint and resumed ends with the
  same weights as without the stop (FSDP2's DTensor optimiser state included).

The FSDP plugins are built from the shipped recipes/accelerate/fsdp_8gpu.yaml
(FSDP2) and fsdp1_8gpu.yaml, activation checkpointing included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dllm_align.models.load import TinySpec
from fixtures.runs import reset_accelerate
from fixtures.sort_toy import write_pairs

HERE = Path(__file__).resolve().parent
LAUNCHES = ("ddp", "fsdp1", "fsdp2")
CLIP = 0.05  # below every step's gradient norm here (~0.2-0.25): clipping is active


# ~155M parameters: 310 MB of bf16 files, 620 MB as one fp32 copy
BIG = TinySpec(hidden_size=1024, layers=12, heads=8, intermediate_size=2816)


def save_bf16(folder: Path, spec, shard: str) -> Path:
    """The built-in model of ``spec`` written as a published checkpoint is: bf16 safetensors in shards of ``shard``."""
    from dllm_align.models.load import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    build_tiny_model(tok, spec).to(torch.bfloat16).save_pretrained(folder, max_shard_size=shard)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def launched(tmp_path_factory, shared_data):
    from dllm_align.training import reference as ref
    from dllm_align.data.examples import load_training_examples, make_collate
    from dllm_align.models.load import build_tiny_tokenizer
    from dllm_align.training.train import train

    sys.path.insert(0, str(HERE))
    import dist_invariants as d

    root = tmp_path_factory.mktemp("dist")
    data = write_pairs(root / "pairs.jsonl", n=16)
    tok = build_tiny_tokenizer()
    spec = {"out": str(root / "out"), "data": str(data), "caches": {}, "clip": CLIP, "raw_fsdp1_default_policy": True}
    for mp in ("no", "bf16"):
        spec["caches"][mp] = str(root / f"cache-{mp}")
        rec = d.recipe(spec, mp, "cached", False, str(root / "pre"))
        exs = load_training_examples(rec, tok, quiet=True)
        ref.precompute(rec, exs, make_collate(rec, tok), None, None)
    spec["margins"] = [[launch, mp, "cached", False] for launch in LAUNCHES for mp in ("no", "bf16")]
    spec["margins"] += [[launch, mp, "online", True] for launch in LAUNCHES for mp in ("no", "bf16")]
    spec["train"] = [[launch, lora, str(root / f"train-{launch}-{lora}")] for launch in LAUNCHES for lora in (False, True)]
    spec["margins"] += [["fsdp2", "bf16", "cached", lora, "train.fsdp_gather=bf16_layers"] for lora in (False, True)]
    # block diffusion (SDAR's layout): K noisy streams over one shared clean stream, under every wrapper
    sdar = ["model.name_or_path=builtin:tiny-sdar", "data.max_length=160"]  # Qwen's chat turns are longer
    spec["margins"] += [["ddp", "bf16", "online", False, *sdar], ["fsdp1", "bf16", "online", False, *sdar],
                        ["fsdp2", "bf16", "online", True, *sdar], ["fsdp2", "no", "online", False, *sdar]]
    # LLaDA2.0's MoE body (first layer dense, experts and a shared expert; blocks of 8)
    llada2 = ["model.name_or_path=builtin:tiny-llada2", "data.max_length=160"]
    spec["margins"] += [["ddp", "bf16", "online", False, *llada2],
                        ["fsdp2", "bf16", "online", True, *llada2, "train.lora.target_modules=[query_key_value,dense]"]]
    # three DDP steps on it: experts no token picked still get a (zero) gradient on every rank
    spec["train"] += [["ddp", False, str(root / "train-ddp-llada2"), "no", "model.name_or_path=builtin:tiny-llada2",
                       "reference.mode=online"]]
    spec["train"] += [["fsdp2", False, str(root / f"train-fsdp2-bf16-{g}"), "bf16", f"train.fsdp_gather={g}"]
                      for g in ("fp32", "bf16_layers")]
    spec["grad_storage"] = ["fsdp1", "fsdp2"]
    # realistic lengths (where a reference scored in another call layout shows): real kto-mix rows on builtin:small,
    # caches made by one process
    from fixtures.real_rows import write_real_rows

    spec["real"] = {"data": str(write_real_rows(shared_data, root / "real.jsonl")), "caches": {}}
    for mp in ("no", "bf16"):
        spec["real"]["caches"][mp] = str(root / f"real-cache-{mp}")
        rec = d.real_recipe(spec, mp, "cached", str(root / "real-pre"))
        real_exs = load_training_examples(rec, tok, quiet=True)
        ref.precompute(rec, real_exs, make_collate(rec, tok), None, None)
    spec["real_margins"] = [["ddp", "bf16", "cached"], ["fsdp2", "bf16", "cached"], ["fsdp2", "no", "cached"],
                            ["fsdp2", "bf16", "online"]]
    spec["resume"] = [[launch, str(root / f"resume-{launch}")] for launch in ("fsdp1", "fsdp2")]
    # DiffusionGemma (its tied layer pairs as FSDP2 units, activation checkpointing off as the family needs): its
    # tiny vocabulary's rows do not divide by the 2 processes, so the shards are uneven
    spec["resume"] += [["fsdp2-noac", str(root / "resume-gemma"), "model.name_or_path=builtin:tiny-diffusiongemma",
                        "data.max_length=160", "reference.mode=online"]]
    # checkpoints as published (bf16 safetensors shards): FSDP2 reads each process's shard of each weight
    small = save_bf16(root / "bf16-small", TinySpec(), "40KB")
    spec["margins"] += [["fsdp2", "no", "online", lora, f"model.name_or_path={small}"] for lora in (False, True)]
    spec["margins"] += [["fsdp2", "bf16", "online", False, f"model.name_or_path={small}"]]
    spec["train"] += [["fsdp2", False, str(root / "train-fsdp2-bf16-files"), "no", f"model.name_or_path={small}",
                       "reference.mode=online"]]
    spec["loading"] = [[str(save_bf16(root / "bf16-big", BIG, "60MB")), lora] for lora in (True, False)]
    # precompute-ref under FSDP2 (the reference sharded) against one process: shards of 3 and of 1 micro-batch, so a
    # process's share of a shard is smaller than the other's, or empty
    spec["precompute"], single_caches = [], {}
    for mp, size in (("no", 6), ("bf16", 2)):
        sets = [f"reference.shard_size={size}"]
        spec["precompute"].append([str(small), mp, str(root / f"pre2-{mp}"), *sets])
        rec = d.recipe(spec, mp, "cached", False, str(root / "pre1"), f"model.name_or_path={small}",
                       f"reference.cache={root / f'pre1-{mp}'}", *sets)
        ref.precompute(rec, load_training_examples(rec, tok, quiet=True), make_collate(rec, tok), None, None)
        single_caches[mp] = str(root / f"pre1-{mp}")
    spec["precompute_loading"] = [str(root / "bf16-big")]
    (root / "out").mkdir()
    (root / "spec.json").write_text(json.dumps(spec))

    # one process: the same global batch (2 micro-batches of 2)
    single = {}
    reset_accelerate()
    torch.manual_seed(0)
    rec = d.recipe(spec, "no", "online", False, str(root / "train-single-llada2"), "train.max_steps=3",
                   f"train.max_grad_norm={CLIP}", "model.name_or_path=builtin:tiny-llada2")
    train(rec, examples=exs)
    single["llada2"] = rec.output_dir
    reset_accelerate()
    torch.manual_seed(0)
    rec = d.recipe(spec, "no", "online", False, str(root / "train-single-bf16-files"), "train.max_steps=3",
                   f"train.max_grad_norm={CLIP}", f"model.name_or_path={small}")
    train(rec, examples=exs)
    single["bf16-files"] = rec.output_dir
    for lora in (False, True):
        reset_accelerate()
        torch.manual_seed(0)
        rec = d.recipe(spec, "no", "cached", lora, str(root / f"train-single-{lora}"), "train.max_steps=3", f"train.max_grad_norm={CLIP}")
        train(rec, examples=exs)
        single[lora] = rec.output_dir
    reset_accelerate()

    # a fixed mmap threshold: glibc's moving one keeps blocks freed by earlier configurations in the heap, which the
    # loading peaks below would then reuse unseen or not (up to 13% either way); blocks of 1 MiB and more are then
    # mapped and unmapped with their tensors, and VmHWM counts what a load itself holds
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576",
               PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "dist_invariants.py"), str(root / "spec.json")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = json.loads((root / "out" / "results.json").read_text())
    return {"results": results, "single": single, "root": root, "single_caches": single_caches}


def test_step0_margins_are_zero_on_every_launch(launched):
    res = launched["results"]["margins"]
    # 12 launches x precisions x references, + FSDP2 bf16_layers gathering (LoRA off, on), + 6 block-diffusion runs,
    # + FSDP2 reading bf16 files shard by shard (LoRA off, on; bf16 autocast)
    assert len(res) == 23
    assert sum("tiny-sdar" in key for key in res) == 4 and sum("tiny-llada2" in key for key in res) == 2
    for key, r in res.items():
        launch = key.split("/")[0]
        assert r["rows"] == 8, key  # 2 global steps x 4 rows, gathered from both ranks
        assert r["fsdp"] == launch.startswith("fsdp"), key
        assert r["module"] == {"ddp": "DistributedDataParallel", "fsdp1": "FullyShardedDataParallel", "fsdp2": "FSDPPolicyScorer"}[launch], key
        assert r["max_abs_margin"] == 0.0, (key, r["max_abs_margin"])


def test_rotary_frequencies_are_fp32_under_fsdp_bf16(launched):
    res = launched["results"]
    for launch in ("fsdp1", "fsdp2"):
        for mode in ("cached/lora=False", "online/lora=True"):
            r = res["margins"][f"{launch}/bf16/{mode}"]
            assert r["rotary_dtypes"] == ["torch.float32"] and r["rotary_equal_fp32"], (launch, mode, r)
            assert "param_dtype=None" in r["fsdp_policy"] and "reduce_dtype=torch.float32" in r["fsdp_policy"]
    # accelerate's default FSDP policy for bf16 (what the shipped config got before): buffers cast to bf16
    raw = res["raw_fsdp1_default_policy"]
    assert raw["rotary_dtypes"] == ["torch.bfloat16"] and raw["max_freq_error"] > 1e-4


def test_lora_fsdp_gradient_norm_is_global_and_rank_agreed(launched):
    g = launched["results"]["grad_norms"]
    want = g["ddp"]["global"][0]
    for launch in LAUNCHES:
        assert g[launch]["global"][0] == g[launch]["global"][1], launch
        assert g[launch]["global"][0] == pytest.approx(want, rel=1e-9), launch
        assert g[launch]["finite_after_nan_on_rank1"] == [False, False], launch
    for launch in ("fsdp1", "fsdp2"):
        a, b = g[launch]["local"]
        assert abs(a - b) > 1e-3 * want and max(a, b) < want  # one shard alone: not the norm to clip by


@pytest.mark.parametrize("lora", [False, True])
def test_same_weights_after_three_clipped_steps(launched, lora):
    from safetensors.torch import load_file

    single_dir = Path(launched["single"][lora])
    single_m = [json.loads(x) for x in (single_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["grad_norm"] > CLIP for m in single_m)  # clipping was active on every step
    want = load_file(str(single_dir / "final" / "model.safetensors"))
    for launch in LAUNCHES:
        d = launched["results"]["train"][f"{launch}/lora={lora}"]
        got = load_file(str(Path(d["dir"]) / "final" / "model.safetensors"))
        assert got.keys() == want.keys()
        assert d["metrics"]["grad_norm"] == pytest.approx(single_m[-1]["grad_norm"], rel=1e-5), launch
        for k in want:
            # fp32; the gradient is summed in another order (all-reduce vs accumulation), which
            # Adam's normalised update turns into ~1e-7 differences at lr 1e-3
            torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=0, msg=lambda m, k=k, launch=launch: f"{launch} {k}: {m}")
    changed = any(not torch.equal(want[k], load_file(str(single_dir.parent / "train-single-False" / "final" / "model.safetensors"))[k])
                  for k in want) if lora else True
    assert changed


def test_ddp_trains_the_llada2_moe_body_like_one_process(launched):
    """DDP needs a gradient for every parameter on every rank: experts no token picked run on zero rows while
    gradients are recorded. Three clipped DDP steps end with the single-process weights."""
    from safetensors.torch import load_file

    want = load_file(str(Path(launched["single"]["llada2"]) / "final" / "model.safetensors"))
    d = launched["results"]["train"]["ddp/lora=False/no/builtin:tiny-llada2"]
    got = load_file(str(Path(d["dir"]) / "final" / "model.safetensors"))
    assert got.keys() == want.keys() and any(".experts." in k for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("launch", ["fsdp1", "fsdp2", "fsdp2-noac/builtin:tiny-diffusiongemma"])
def test_fsdp_resume_continues_exactly(launched, launch):
    """3 steps with a checkpoint at step 2, final/ removed, resumed: the same weights (per-rank optimiser shards,
    uneven ones included: their moments keep their parameter's global shape)."""
    from safetensors.torch import load_file

    r = launched["results"]["resume"][launch]
    assert (Path(r["dir"]) / "checkpoints" / "step-2").is_dir()
    if launch.startswith("fsdp2"):  # written by both processes, one file each, in save_pretrained's sharded layout
        names = sorted(p.name for p in (Path(r["dir"]) / "checkpoints" / "step-2").glob("model*.safetensors"))
        assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], names
    a = load_file(str(Path(r["dir"]) / "final" / "model.safetensors"))
    b = load_file(str(Path(r["uninterrupted"]) / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), (launch, k)


@pytest.mark.parametrize("launch", ["fsdp1", "fsdp2"])
def test_fsdp_gradient_accumulation_keeps_only_the_shard(launched, launch):
    """FSDP with 2 micro-batches per step: after the first micro-batch's backward each rank holds
    gradient elements equal to its parameter shard (reduce-scattered every micro-batch), not the
    whole unsharded gradient that ``no_sync`` keeps (2x here, ~30 GiB for 8B)."""
    per_rank = launched["results"]["grad_storage"][launch]
    assert len(per_rank) == 2
    for r in per_rank:
        assert r["accum"] == 2
        held, shard = r["training"]
        assert held == shard, (launch, held, shard)
        forced, shard2 = r["no_sync"]
        assert forced >= 1.9 * shard2, (launch, forced, shard2)  # the measure sees the defect


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_bf16_layer_gathering_keeps_step0_margins_exact(launched, lora):
    """``train.fsdp_gather: bf16_layers``: every decoder layer is a bf16-gathered unit (its norms fp32 units),
    and the step-0 margins against the cache stay exactly 0."""
    r = launched["results"]["margins"][f"fsdp2/bf16/cached/lora={lora}/train.fsdp_gather=bf16_layers"]
    assert r["fsdp"] and r["rows"] == 8
    assert r["bf16_units"] == 2  # builtin:tiny's two decoder layers
    assert r["max_abs_margin"] == 0.0


def test_fsdp2_bf16_layer_gathering_trains_like_fp32_gathering(launched):
    """Three clipped bf16-autocast steps under FSDP2: with bf16_layers gathering the first step's loss and
    gradient norm are those of the fp32 gathering up to fp32 summation order (every layer weight's gradient
    is bit-identical; the embedding's accumulates its residual-stream terms in another order, ~2e-6 absolute).
    Later steps are not compared: Adam's first steps turn such rounding into sign flips of tiny updates."""
    t = launched["results"]["train"]
    a = t["fsdp2/lora=False/bf16/fp32"]["metrics"]
    b = t["fsdp2/lora=False/bf16/bf16_layers"]["metrics"]
    assert a["step"] == b["step"] == 3
    import json
    from pathlib import Path

    rows = {g: [json.loads(x) for x in (Path(t[f"fsdp2/lora=False/bf16/{g}"]["dir"]) / "metrics.jsonl").read_text().splitlines()]
            for g in ("fp32", "bf16_layers")}
    first_a, first_b = rows["fp32"][0], rows["bf16_layers"][0]
    assert first_a["loss"] == first_b["loss"] == 0.5  # margins 0 at step 0 on both
    assert first_b["grad_norm"] == pytest.approx(first_a["grad_norm"], rel=1e-4)
    assert first_b["grad_norm"] != 0



def test_step0_margins_exact_on_real_rows_ddp_and_fsdp2(launched):
    """Real kto-mix rows of 150-520 tokens on builtin:small, 2 gloo processes: every margin exactly 0 under
    DDP and FSDP2, bf16 and fp32, cached (made by one process, in training's micro-batches) and online."""
    res = launched["results"]["real_margins"]
    assert len(res) == 4
    for key, r in res.items():
        assert r["rows"] == 16 and r["min_tokens"] >= 150, key
        assert r["fsdp"] == key.startswith("fsdp"), key
        assert r["max_abs_margin"] == 0.0, (key, r["max_abs_margin"])


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_reads_bf16_shards_with_step0_margins_exact(launched, lora):
    """A checkpoint as published (bf16 safetensors shards) under FSDP2: each process reads its own rows of each
    weight into its fp32 shard, the online reference its rows into its own shards (gathered in fp32, cast per call
    under bf16 autocast as the policy's are); the step-0 margins stay exactly 0, fp32 and bf16 autocast."""
    keys = [k for k in launched["results"]["margins"] if "bf16-small" in k and f"lora={lora}" in k]
    assert len(keys) == (1 if lora else 2)
    for key in keys:
        r = launched["results"]["margins"][key]
        assert r["sharded_read"] and r["reference_sharded"] and r["max_abs_margin"] == 0.0, (key, r)


def test_fsdp2_from_bf16_shards_trains_like_one_process(launched):
    from safetensors.torch import load_file

    want = load_file(str(Path(launched["single"]["bf16-files"]) / "final" / "model.safetensors"))
    d = next(v for k, v in launched["results"]["train"].items() if k.startswith("fsdp2/lora=False/no/") and "bf16-small" in k)
    got = load_file(str(Path(d["dir"]) / "final" / "model.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("lora", [True, False])
def test_fsdp2_loading_peak_is_what_doctor_predicts(launched, lora):
    """Each process's peak resident memory while loading (VmHWM, reset before loading, less the resident size then)
    is within 10% of doctor's host-RAM figure per process, and below one fp32 copy of the model."""
    from dllm_align.training.doctor import host_ram_needed
    from dllm_align.training.memory import Launch, model_shape

    sys.path.insert(0, str(HERE))
    import dist_invariants as d

    folder = launched["root"] / "bf16-big"
    spec = json.loads((launched["root"] / "spec.json").read_text())
    rec = d.recipe(spec, "no", "cached", lora, str(launched["root"] / "doctor"), f"model.name_or_path={folder}")
    shape = model_shape(rec)
    ram = host_ram_needed(rec, Launch(distributed_type="FSDP", processes=2, fsdp_version=2), shape)
    assert ram.sharded_read
    for rank in launched["results"]["loading"][f"lora={lora}"]:
        added = rank["peak"] - rank["before"]
        assert rank["sharded_read"] and rank["shard_bytes"] >= shape.params * 4 // 2
        assert added < shape.params * 4, (added, shape.params * 4)
        assert added == pytest.approx(ram.per_process, rel=0.10), (added, ram.per_process, ram.why)


@pytest.mark.parametrize("mp", ["no", "bf16"])
def test_fsdp2_precompute_with_a_sharded_reference_equals_one_process(launched, mp):
    """precompute-ref on 2 processes under FSDP2 reads bf16 safetensors shards into a sharded reference (each process
    its rows of each weight) and writes the very cache one process writes with the whole reference: every value
    equal, shard by shard (fp32 and bf16 autocast; shards where one process has fewer micro-batches, or none)."""
    from dllm_align.training.cache import SHARD_FMT, read_shard

    got = launched["results"]["precompute"][mp]
    want = Path(launched["single_caches"][mp])
    assert got["shards"] >= 3 and got["sharded"] == 1
    for s in range(got["shards"]):
        a, b = read_shard(Path(got["cache"]) / SHARD_FMT.format(s)), read_shard(want / SHARD_FMT.format(s))
        assert a[1:] == b[1:] and np.array_equal(a[0], b[0]), (mp, s)


def test_fsdp2_precompute_loading_peak_is_what_doctor_predicts(launched):
    """precompute-ref's reference loading under FSDP2 from bf16 shards: each process's peak resident memory
    (VmHWM, less the resident size before) within 10% of doctor's precompute host-RAM figure per process, and
    below one fp32 copy of the model (what every process held before)."""
    from dllm_align.training.doctor import host_ram_precompute
    from dllm_align.training.memory import Launch, model_shape

    sys.path.insert(0, str(HERE))
    import dist_invariants as d

    spec = json.loads((launched["root"] / "spec.json").read_text())
    rec = d.recipe(spec, "no", "cached", False, str(launched["root"] / "doctor-pre"),
                   f"model.name_or_path={launched['root'] / 'bf16-big'}")
    shape = model_shape(rec)
    ram = host_ram_precompute(rec, Launch(distributed_type="FSDP", processes=2, fsdp_version=2), shape)
    assert ram.sharded_read and "sharded read" in ram.why
    for rank in launched["results"]["precompute_loading"]:
        added = rank["peak"] - rank["before"]
        assert rank["sharded"] and rank["shard_bytes"] >= shape.params * 4 // 2
        assert added < shape.params * 4, (added, shape.params * 4)
        assert added == pytest.approx(ram.per_process, rel=0.10), (added, ram.per_process, ram.why)
