"""One 2-process gloo launch that checks several launch configurations (used by test_invariants_distributed.py).

    torchrun --standalone --nproc_per_node 2 tests/dist_invariants.py SPEC.json

SPEC.json: {"out": folder, "data": pairs.jsonl, "caches": {"no": dir, "bf16": dir},
"margins": [[launch, mixed_precision, reference_mode, lora], ...], "loading": [[model folder, lora], ...],
"train": [[launch, lora, run_dir(, mixed_precision, extra sets...)], ...], "resume": [[launch, run_dir(, extra sets...)], ...],
"precompute": [[model folder, mixed_precision, cache dir(, extra sets...)], ...], "precompute_loading": [model folder],
"raw_fsdp1_default_policy": bool}

launch is ddp, fsdp1 or fsdp2. accelerate turns FSDP on only for GPU
backends, so on CPU the accelerator is created for gloo and its state is then
switched to FSDP with the plugin accelerate would build from
recipes/accelerate/fsdp_8gpu.yaml (including accelerate's default bf16
mixed-precision policy, which dllm-align replaces). Rank 0 writes
``out/results.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DLLM_ALIGN_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]


def make_accelerator(launch: str, mp: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return switch_to_fsdp(Accelerator(cpu=True, mixed_precision=mp), launch, mp)


def switch_to_fsdp(acc, launch: str, mp: str):
    """Switch an accelerator made for gloo to FSDP (``launch`` fsdp1 / fsdp2; ddp: unchanged), as an FSDP
    launch would have configured it; also used by tests/multinode.py on the accelerator `train` makes."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if launch.startswith("fsdp"):
        import yaml

        # the shipped config for this FSDP version, translated as `accelerate launch` does
        # "-noac": the same config with activation checkpointing off
        launch, no_ac = launch.removesuffix("-noac"), launch.endswith("-noac")
        name = {"fsdp1": "fsdp1_8gpu.yaml", "fsdp2": "fsdp_8gpu.yaml"}[launch]
        raw = yaml.safe_load((REPO / "recipes" / "accelerate" / name).read_text())["fsdp_config"]
        version = int(raw["fsdp_version"])
        assert version == int(launch[-1]), (name, version)
        keys = {"fsdp_reshard_after_forward": "reshard_after_forward", "fsdp_auto_wrap_policy": "auto_wrap_policy",
                "fsdp_backward_prefetch": "backward_prefetch", "fsdp_forward_prefetch": "forward_prefetch",
                "fsdp_state_dict_type": "state_dict_type", "fsdp_use_orig_params": "use_orig_params",
                "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
                "fsdp_activation_checkpointing": "activation_checkpointing"}
        kw = {keys[k]: v for k, v in raw.items() if k in keys}
        kw["auto_wrap_policy"] = str(kw["auto_wrap_policy"]).lower()
        kw.update(fsdp_version=version, transformer_cls_names_to_wrap=[raw["fsdp_transformer_layer_cls_to_wrap"]])
        kw["cpu_offload"] = bool(raw.get("fsdp_offload_params", False))
        if no_ac:
            kw["activation_checkpointing"] = False
        if version == 1:
            kw["sync_module_states"] = False  # True needs a GPU to initialise on; every rank loads the same weights
        plugin = FullyShardedDataParallelPlugin(**kw)
        if mp != "no":
            plugin.set_mixed_precision(mp)  # what accelerate does for an FSDP launch (param/reduce/buffer bf16)
        acc.state.fsdp_plugin = plugin
        acc.state.distributed_type = DistributedType.FSDP
        # every later AcceleratorState() (autocast set-up under bf16 makes one) copies PartialState's
        # fields over its own: switch both, or a bf16 launch quietly falls back to DDP
        PartialState().distributed_type = DistributedType.FSDP
        if version == 1:
            # FSDP1 on CPU computes on "cpu" and refuses the indexed device_id ("cpu:0") accelerate passes.
            acc.state.device = PartialState().device = torch.device("cpu")
    return acc


def recipe(spec, mp, mode, lora, out, *more):
    from dllm_align.config.recipe import load_recipe

    sets = [
        f"data.train={spec['data']}", "data.format=paired", "data.max_length=64",
        "reference.n_mc=4", "reference.shard_size=8", "reference.batch_size=16",
        f"reference.cache={spec['caches'][mp]}", f"reference.mode={mode}",
        f"train.mixed_precision={mp}", "train.batch_size=2", "train.global_batch_size=4",
        "train.lr=1e-3", "train.warmup_ratio=0", "train.scheduler=constant",
    ]
    if lora:
        sets += ["train.lora.enabled=true", "train.lora.r=4", "train.lora.target_modules=[q_proj,v_proj,gate_proj]"]
    return load_recipe(None, sets + list(more), output_dir=out)


def real_recipe(spec, mp, mode, out):
    """16 real kto-mix rows of 150-520 tokens on builtin:small, 4 rows per process per step."""
    from dllm_align.config.recipe import load_recipe

    return load_recipe(None, [
        f"data.train={spec['real']['data']}", "data.format=unpaired", "data.max_length=640", "data.padding=packed",
        "model.name_or_path=builtin:small", "reference.n_mc=4", "reference.batch_size=16", "reference.shard_size=6",
        f"reference.mode={mode}", f"reference.cache={spec['real']['caches'][mp]}", f"train.mixed_precision={mp}",
        "train.batch_size=4", "train.global_batch_size=8", "train.lr=1e-3",
    ], output_dir=out)


def rotary_probe(model):
    """Record the dtype (and values) of every rotary inv_freq as the forward uses it."""
    seen = []

    def hook(mod, args):
        seen.append((str(mod.inv_freq.dtype), mod.inv_freq.detach().float().clone()))

    for m in model.modules():
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            m.register_forward_pre_hook(hook)
    return seen


def grad_norm_probe(run) -> dict:
    """One backward on this rank's rows: each rank's shard-local gradient norm and the global one."""
    from dllm_align.training.optim import clip_global_grad_norm

    b = run.to_device(run.collate_units(run.data.micro_batches(0, run.plan)[0]))
    run.policy_elbo(b).sum().backward()
    grads = [p.grad for p in run.policy.params if p.grad is not None]
    local = float(sum((g.to_local() if hasattr(g, "to_local") else g).double().pow(2).sum() for g in grads) ** 0.5)
    locals_ = [None] * run.plan.world
    torch.distributed.all_gather_object(locals_, local)
    norm = clip_global_grad_norm(run.policy.params, float("inf"), sharded=run.plan.fsdp, device=run.plan.device)
    norms = [None] * run.plan.world
    torch.distributed.all_gather_object(norms, norm)
    # a NaN in one rank's shard only: every rank must see a non-finite norm (or one raises while the other waits)
    if run.plan.rank == 1:  # on the local shard: a DTensor op here would be a collective only this rank enters
        shards = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        next(x for x in shards if x.numel()).view(-1)[:1] = float("nan")
    bad = clip_global_grad_norm(run.policy.params, 1.0, sharded=run.plan.fsdp, device=run.plan.device)
    finite = [None] * run.plan.world
    torch.distributed.all_gather_object(finite, bool(bad == bad and abs(bad) != float("inf")))
    run.policy.optimizer.zero_grad(set_to_none=True)
    return {"local": locals_, "global": norms, "finite_after_nan_on_rank1": finite}


def grad_elements(run) -> tuple[int, int]:
    """(gradient elements this rank holds, elements of its parameter shard) after a backward.

    FSDP1: the flat parameters' gradients (unsharded under no_sync, the shard after a
    reduce-scatter); FSDP2: each parameter's local gradient shard plus the unsharded
    gradients FSDP2 keeps for a later reduce-scatter (``set_requires_gradient_sync(False)``).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flat = [f._handle.flat_param for f in FSDP.fsdp_modules(run.policy.module) if f._handle is not None]
    if flat:
        held = sum(fp.grad.numel() for fp in flat if fp.grad is not None and fp.requires_grad)
        shard = sum(fp.numel() for fp in flat if fp.requires_grad)
        return held, shard
    held = sum((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel() for p in run.policy.params if p.grad is not None)
    shard = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in run.policy.params)
    for m in run.policy.module.modules():
        get = getattr(m, "_get_fsdp_state", None)
        grp = get()._fsdp_param_group if get is not None else None
        for fp in (grp.fsdp_params if grp is not None else []):
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and up.grad is not None:
                held += up.grad.numel()
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                held += fp.unsharded_accumulated_grad.numel()
    return held, shard


def grad_storage_probe(run) -> dict:
    """Per-rank gradient elements after the first of two micro-batches: the training path, and forced no_sync."""
    b = run.to_device(run.collate_units(run.data.micro_batches(0, run.plan)[0]))
    out = {}
    for name, ctx in (("training", lambda: run.sync(False)), ("no_sync", lambda: run.accelerator.no_sync(run.policy.module))):
        with ctx():
            run.policy_elbo(b).sum().backward()
        out[name] = grad_elements(run)
        run.policy.optimizer.zero_grad(set_to_none=True)
        # finish the step's reduction (a later synced backward), so no unsharded gradient outlives the probe
        run.policy_elbo(b).sum().backward()
        run.policy.optimizer.zero_grad(set_to_none=True)
    out["accum"] = run.plan.accum
    return out


def status_kib(field: str) -> int:
    """A /proc/self/status figure in KiB (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    from dllm_align.data.examples import load_training_examples
    from dllm_align.models.load import BUILTIN_SPECS, build_tiny_model, build_tiny_tokenizer
    from dllm_align.training.loop import invariant_margins
    from dllm_align.training.train import setup_run
    from dllm_align.training.train import train

    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    tok = build_tiny_tokenizer()
    exs = load_training_examples(recipe(spec, "no", "cached", False, str(out / "x")), tok, quiet=True)
    fp32_freq = build_tiny_model(tok).model.rotary_emb.inv_freq.float()
    results: dict = {"margins": {}, "train": {}}

    for launch, mp, mode, lora, *sets in spec.get("margins", []):
        acc = make_accelerator(launch, mp)
        rec = recipe(spec, mp, mode, lora, str(out / f"m-{launch}-{mp}-{mode}-{lora}{'-'.join([''] + sets)}"), *sets)
        torch.manual_seed(rec.train.seed)  # as train() does: the same LoRA init on every rank and launch
        family = BUILTIN_SPECS.get(rec.model.name_or_path, BUILTIN_SPECS["builtin:tiny"]).family
        run = setup_run(rec, acc, None, exs if family == "llada" else
                   load_training_examples(rec, build_tiny_tokenizer(family), quiet=True))
        seen = rotary_probe(run.mp.model)
        local = invariant_margins(run, steps=2)
        gathered = [None] * acc.num_processes
        torch.distributed.all_gather_object(gathered, local)
        allm = {k: v for d in gathered for k, v in d.items()}
        key = f"{launch}/{mp}/{mode}/lora={lora}" + "".join(f"/{x}" for x in sets)
        if lora and mp == "no" and mode == "online" and not sets:
            results.setdefault("grad_norms", {})[launch] = grad_norm_probe(run)
        results["margins"][key] = {
            "fsdp": run.plan.fsdp,
            "sharded_read": run.mp.weight_sources is not None,
            "reference_sharded": type(getattr(run.reference, "model", None)).__name__ == "ShardedReference",
            "module": type(run.policy.module).__name__,
            "mixed_precision": acc.mixed_precision,
            "rows": len(allm),
            "max_abs_margin": max(abs(v) for v in allm.values()),
            "rotary_dtypes": sorted({d for d, _ in seen}),
            "rotary_equal_fp32": all(torch.equal(v, fp32_freq) for _, v in seen),
            "fsdp_policy": repr(getattr(getattr(acc.state, "fsdp_plugin", None), "mixed_precision_policy", None)),
            "bf16_units": sum(1 for m in run.policy.module.modules() if hasattr(m, "_get_fsdp_state")
                              and getattr(m._get_fsdp_state()._mp_policy, "param_dtype", None) == torch.bfloat16),
        }
        del run
        acc.free_memory()

    for launch, mp, mode in spec.get("real_margins", []):
        acc = make_accelerator(launch, mp)
        rec = real_recipe(spec, mp, mode, str(out / f"r-{launch}-{mp}-{mode}"))
        real_exs = load_training_examples(rec, tok, quiet=True)
        run = setup_run(rec, acc, None, real_exs)
        local = invariant_margins(run, steps=2)
        gathered = [None] * acc.num_processes
        torch.distributed.all_gather_object(gathered, local)
        allm = {k: v for d in gathered for k, v in d.items()}
        results.setdefault("real_margins", {})[f"{launch}/{mp}/{mode}"] = {
            "fsdp": run.plan.fsdp, "rows": len(allm), "max_abs_margin": max(abs(v) for v in allm.values()),
            "min_tokens": min(ex.length for ex in real_exs)}
        del run
        acc.free_memory()

    for launch in spec.get("grad_storage", []):
        acc = make_accelerator(launch, "no")
        rec = recipe(spec, "no", "cached", False, str(out / f"g-{launch}"), "train.global_batch_size=8")
        torch.manual_seed(rec.train.seed)
        run = setup_run(rec, acc, None, exs)
        held = grad_storage_probe(run)
        gathered = [None] * acc.num_processes
        torch.distributed.all_gather_object(gathered, held)
        results.setdefault("grad_storage", {})[launch] = gathered
        del run
        acc.free_memory()

    for launch, lora, run_dir, *more in spec.get("train", []):
        mp = more[0] if more else "no"
        acc = make_accelerator(launch, mp)
        rec = recipe(spec, mp, "cached", lora, run_dir, "train.max_steps=3", f"train.max_grad_norm={spec['clip']}", *more[1:])
        family = BUILTIN_SPECS.get(rec.model.name_or_path, BUILTIN_SPECS["builtin:tiny"]).family
        res = train(rec, examples=exs if family in ("llada", "llada2") else
                    load_training_examples(rec, build_tiny_tokenizer(family), quiet=True), accelerator=acc)
        key = f"{launch}/lora={lora}" + (f"/{mp}/{more[1].split('=')[1]}" if len(more) > 1 else "")
        results["train"][key] = {"dir": run_dir, "metrics": res.last_metrics}
        acc.free_memory()

    for launch, run_dir, *sets in spec.get("resume", []):
        # 3 steps with a checkpoint at step 2; final/ removed; resumed: the same weights as without the stop
        import shutil

        acc = make_accelerator(launch, "no")
        rec = recipe(spec, "no", "cached", False, run_dir, "train.max_steps=3", "train.save_every=2", f"train.max_grad_norm={spec['clip']}", *sets)
        family = BUILTIN_SPECS.get(rec.model.name_or_path, BUILTIN_SPECS["builtin:tiny"]).family
        rows = exs if family == "llada" else load_training_examples(rec, build_tiny_tokenizer(family), quiet=True)
        train(rec, examples=rows, accelerator=acc)
        if torch.distributed.get_rank() == 0:
            shutil.copytree(Path(run_dir) / "final", Path(run_dir + "-uninterrupted"))
            shutil.rmtree(Path(run_dir) / "final")
        torch.distributed.barrier()
        acc = make_accelerator(launch, "no")
        train(rec, examples=rows, accelerator=acc, resume=True)
        key = launch + "".join(f"/{x.split('=', 1)[1]}" for x in sets[:1])
        results.setdefault("resume", {})[key] = {"dir": run_dir, "uninterrupted": run_dir + "-uninterrupted"}

    for folder, lora in spec.get("loading", []):
        # FSDP2 loading from bf16 safetensors shards: what each process holds at its peak while loading
        from dllm_align.training.plan import plan_run
        from dllm_align.training.policy import load_policy, wrap_policy

        acc = make_accelerator("fsdp2", "no")
        rec = recipe(spec, "no", "cached", lora, str(out / f"l-{lora}"), f"model.name_or_path={folder}")
        rec, plan = plan_run(rec, acc)
        torch.manual_seed(rec.train.seed)
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the resident size
        before = status_kib("VmRSS")
        mp = load_policy(rec.model, rec.train.lora, rec.data.max_length, plan, None)
        held = wrap_policy(mp, rec.train, plan, acc)
        peak = status_kib("VmHWM")
        gathered = [None] * acc.num_processes
        local = {"before": before * 1024, "peak": peak * 1024, "sharded_read": mp.weight_sources is not None,
                 "shard_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in held.module.parameters())}
        torch.distributed.all_gather_object(gathered, local)
        results.setdefault("loading", {})[f"lora={lora}"] = gathered
        del held, mp
        acc.free_memory()

    for folder, mp, cache, *sets in spec.get("precompute", []):
        # precompute-ref under FSDP2 on both processes: the reference sharded, each process's micro-batches its own
        from dllm_align.training import reference as ref

        sharded, shard = [], ref.shard_reference
        ref.shard_reference = lambda *a: sharded.append(1) or shard(*a)  # counts the sharded loads
        acc = make_accelerator("fsdp2", mp)
        rec = recipe(spec, mp, "cached", False, str(out / f"p-{mp}"), f"model.name_or_path={folder}",
                     f"reference.cache={cache}", *sets)
        rep, _ = ref.run_precompute(rec, accelerator=acc)
        ref.shard_reference = shard
        results.setdefault("precompute", {})[mp] = {"cache": cache, "shards": rep.n_shards, "sharded": len(sharded)}
        acc.free_memory()

    for folder in spec.get("precompute_loading", []):
        # precompute-ref's reference from bf16 safetensors shards under FSDP2: each process's peak while loading
        from dllm_align.training.reference import load_reference
        from dllm_align.training.reference_model import ShardedReference

        acc = make_accelerator("fsdp2", "no")
        rec = recipe(spec, "no", "cached", False, str(out / "pl"), f"model.name_or_path={folder}")
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the resident size
        before = status_kib("VmRSS")
        ref_mp = load_reference(rec, acc.device, accelerator=acc)
        peak = status_kib("VmHWM")
        local = {"before": before * 1024, "peak": peak * 1024, "sharded": isinstance(ref_mp, ShardedReference),
                 "shard_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in ref_mp.model.parameters())}
        gathered = [None] * acc.num_processes
        torch.distributed.all_gather_object(gathered, local)
        results["precompute_loading"] = gathered
        del ref_mp
        acc.free_memory()

    if spec.get("raw_fsdp1_default_policy"):
        # The defect as accelerate's default FSDP policy produces it: buffers cast to bf16.
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

        m = build_tiny_model(tok)
        seen = rotary_probe(m)
        w = FSDP(m, mixed_precision=MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16), device_id=torch.device("cpu"))
        with torch.no_grad():
            w(input_ids=torch.tensor([[1, 2, 3]]))
        results["raw_fsdp1_default_policy"] = {"rotary_dtypes": sorted({d for d, _ in seen}),
                                               "max_freq_error": max(float((v - fp32_freq).abs().max()) for _, v in seen)}

    if torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
