"""``dllm-align doctor``: check the node, the memory and a few real steps before a long run.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command

ConfigOpt = Annotated[Optional[str], typer.Option("--config", metavar="FILE", help="The accelerate config the run will use (e.g. fsdp_8gpu.yaml from the bundled recipes/accelerate/).")]
SmokeOpt = Annotated[int, typer.Option("--smoke", metavar="N", min=0, max=1000, help="Run N real optimiser steps (written nowhere in the run folder).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.", metavar="")]
GpuOpt = Annotated[Optional[float], typer.Option("--gpu-memory", metavar="GB", min=1, max=100_000, help="GB of memory per device to plan for (default: detected; 80 GB H100 when a GPU config is read on a machine without GPUs).")]
OutputOpt = Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder whose disk space and reference cache are checked (default: the recipe's output_dir). Nothing is written there.")]


@command("doctor")
def doctor(
    recipe: RecipeArg,
    config: ConfigOpt = None,
    smoke: SmokeOpt = 0,
    json_: JsonOpt = False,
    gpu_memory: GpuOpt = None,
    output_dir: OutputOpt = None,
    set_: SetOpt = None,
) -> None:
    """Preflight for a long run: environment, per-device memory estimate and verdict, traffic per step, optional smoke steps.

    The memory estimate reads only the model's config.json (no weights are
    downloaded); with a multi-node --config, the bytes each node sends to the
    others per step (all-gathers, reduce-scatters or all-reduces) are shown
    with their arithmetic. `--smoke N` runs N real steps on the real model and data in a
    temporary folder, checks that every margin is 0 before the first update,
    measures peak memory and seconds per step, and extrapolates the recipe's
    precompute, epoch and generation time. Exit code 1 when the memory does
    not fit or the invariant fails.

    Example: dllm-align doctor kto_mix_14k --config recipes/accelerate/fsdp_8gpu.yaml

    Example: dllm-align doctor demo --smoke 3 --json

    Example: accelerate launch --config_file recipes/accelerate/fsdp_8gpu.yaml -m dllm_align doctor kto_mix_14k --config recipes/accelerate/fsdp_8gpu.yaml --smoke 3
    """
    import json
    import os

    from dllm_align.training import doctor as d
    from dllm_align.core.console import result
    from dllm_align.core.errors import RunFailure
    from dllm_align.training.memory import model_shape, read_launch
    from dllm_align.training.traffic import traffic
    from dllm_align.config.recipe import load_recipe

    from dllm_align.training.plan import resolve_recipe

    launch = read_launch(config)
    r, _ = resolve_recipe(load_recipe(recipe, set_, output_dir), fsdp=launch.fsdp, fsdp_version=launch.fsdp_version,
                          checkpointing=launch.activation_checkpointing)
    shape = model_shape(r)
    report = {"recipe": r.name, "environment": d.environment(r, launch, shape), "memory": d.memory_report(r, launch, gpu_memory, shape),
              "traffic": traffic(shape, r, launch)}
    if smoke:
        report["smoke"] = d.smoke(r, smoke, launch)
        cpu_launch = read_launch(None) if config is None else launch
        est = d.memory_report(r, cpu_launch, gpu_memory, shape)["estimate"]
        reserve = est["lines"].get("runtime reserve (CUDA context, NCCL, fragmentation)", 0)
        predicted = est["total"] - (0 if report["smoke"]["peak_memory_kind"].startswith("torch.cuda") else reserve)
        report["smoke"]["estimated_peak_bytes"] = predicted
        peak = report["smoke"]["peak_memory_bytes"]
        report["smoke"]["estimate_over_measured"] = predicted / peak if peak else None
    failures = []
    if "problem" in report["traffic"]:
        failures.append(f"launch: {report['traffic']['problem']}")
    if not report["memory"]["fits"]:
        failures.append(f"memory: ~{report['memory']['estimate']['total_gib']:.1f} GiB per device does not fit "
                        f"{report['memory']['capacity_bytes'] / 2**30:.1f} GiB ({report['memory']['capacity_source']})")
    if smoke and not report["smoke"]["invariant"]["ok"]:
        inv = report["smoke"]["invariant"]
        row = inv.get("worst_row") or {}
        failures.append(f"step-0 invariant: row {row.get('id')}'s |margin| {abs(row.get('margin', inv['max_abs_margin'])):.3g} "
                        f"> its tolerance {inv['tolerance']:.3g} (max |margin| {inv['max_abs_margin']:.3g})")
    report["ok"] = not failures
    if int(os.environ.get("RANK", "0")) == 0:  # under accelerate launch / torchrun: one report
        result(json.dumps(report, indent=1, default=str) if json_ else render(report))
    if failures:
        raise RunFailure("doctor: " + "; ".join(failures), hint="; ".join(report["memory"]["advice"]) or None)


def render(report: dict) -> str:
    from dllm_align.training.doctor import fmt_bytes, fmt_seconds

    env, mem = report["environment"], report["memory"]
    lines = [f"dllm-align doctor: {report['recipe']}", "", "environment"]
    devs = env["devices"] or []
    lines.append(f"  devices: {len(devs)} CUDA" + "".join(f"\n    {x['index']}: {x['name']}, {fmt_bytes(x['total_bytes'])}" for x in devs) if devs else "  devices: no CUDA device (CPU)")
    lines.append(f"  bf16: {env['bf16']}; NCCL: {env['nccl']}")
    lines.append("  attention: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in env["attention_backends"].items()))
    disk = env["disk"]
    lines.append(f"  disk {disk['output_dir']}: {fmt_bytes(disk['free_bytes'])} free, needs ~{fmt_bytes(disk['needed_bytes'])} ({disk['why']})")
    ram = env["host_ram"]
    lines.append(f"  host RAM: {fmt_bytes(ram['available_bytes'])} available, needs ~{fmt_bytes(ram['needed_bytes'])} ({ram['why']})")
    pre = env.get("host_ram_precompute")
    if pre:
        lines.append(f"  host RAM for precompute-ref: needs ~{fmt_bytes(pre['needed_bytes'])} ({pre['why']})")
    for p in env["problems"]:
        lines.append(f"  ! {p}")
    m = mem["model"]
    est = mem["estimate"]
    machines = mem["launch"].get("machines", 1)
    spread = f" on {machines} nodes x {mem['launch']['processes'] // machines}" if machines > 1 else ""
    lines += ["", f"memory per device ({mem['launch']['source']}: {mem['launch']['type']} x {mem['launch']['processes']}{spread})",
              f"  model: {m['params'] / 1e9:.3g}B parameters ({m['trainable'] / 1e9:.3g}B trainable), "
              f"{mem['tokens_per_forward']:,} tokens per forward"]
    for k, v in est["lines"].items():
        lines.append(f"  {k:<58} {v / 2**30:8.2f} GiB")
    if est.get("loading", 0) > est.get("steps", est["total"]):  # the reference's fp32 load is the peak
        lines.append(f"  {'a training step':<58} {est['steps'] / 2**30:8.2f} GiB")
        lines.append(f"  {'while loading (policy + fp32 reference before its cast)':<58} {est['loading'] / 2**30:8.2f} GiB")
    lines.append(f"  {'total':<58} {est['total'] / 2**30:8.2f} GiB ({est['total'] / 1e9:.1f} GB)")
    lines.append(f"  with activation checkpointing {est['total_with_checkpointing'] / 2**30:.1f} GiB; "
                 f"without {est['total_without_checkpointing'] / 2**30:.1f} GiB")
    lines.append(f"  verdict: {mem['verdict']} in {mem['capacity_bytes'] / 2**30:.1f} GiB ({mem['capacity_source']})")
    for a in mem["advice"]:
        lines.append(f"  - {a}")
    pre = mem.get("precompute")
    if pre:
        lines += ["", f"precompute-ref per device ({pre['route']} read of the reference, {pre['tokens']:,} tokens per forward)"]
        for k, v in pre["lines"].items():
            lines.append(f"  {k:<58} {v / 2**30:8.2f} GiB")
        if pre["loading"] > sum(pre["lines"].values()):
            lines.append(f"  {'while loading (the whole reference before its cast)':<58} {pre['loading'] / 2**30:8.2f} GiB")
        lines.append(f"  {'total':<58} {pre['total'] / 2**30:8.2f} GiB: {'fits' if pre['fits'] else 'does not fit'}")
    if "traffic" in report:
        from dllm_align.training.traffic import render as render_traffic

        lines += [""] + render_traffic(report["traffic"])
    if "smoke" in report:
        s = report["smoke"]
        inv = s["invariant"]
        x = s["extrapolated"]
        allowed = "exact: 0 allowed" if inv.get("exact") else f"tolerance {inv['tolerance']:.3g} on the worst row"
        lines += ["", f"smoke ({s['steps']} steps, {s['processes']} process(es))",
                  f"  step-0 invariant: max |margin| {inv['max_abs_margin']:.3g} over {inv['rows']} rows "
                  f"({inv.get('steps_checked', 1)} global step(s)) "
                  f"({allowed}, {inv['reference']} reference): {'ok' if inv['ok'] else 'FAILED'}"]
        if inv["note"]:
            lines.append(f"  note: {inv['note']}")
        lines.append(f"  peak memory: {fmt_bytes(s['peak_memory_bytes'])} ({s['peak_memory_kind']}); estimate {fmt_bytes(s['estimated_peak_bytes'])}")
        lines.append(f"  {s['seconds_per_step']:.3f} s/step")
        lines.append(f"  extrapolated: precompute {fmt_seconds(x['precompute_seconds'])}, epoch {fmt_seconds(x['epoch_seconds'])} "
                     f"({x['steps_per_epoch']} steps), training {fmt_seconds(x['training_seconds'])} ({x['total_steps']} steps), "
                     f"generation {fmt_seconds(x['generation_seconds'])} ({x['generation_prompts']} prompts)")
    lines += ["", "ok" if report["ok"] else "NOT ok"]
    return "\n".join(lines)
