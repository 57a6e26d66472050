"""The `evaluate` command: task plans from the recipe's `evaluate.tasks` (:func:`plan_tasks`), one harness run
per task with its own settings and fingerprint (:func:`evaluate_model`), merged results, and two models side by
side (:func:`comparison_rows`).
"""

from __future__ import annotations

import difflib
import gc
import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional, Sequence

import lm_eval
import torch
from lm_eval.tasks import TaskManager

from dllm_align.config.schema import EvalTask
from dllm_align.core.console import info as _info
from dllm_align.core.errors import UserError
from dllm_align.core.io import atomic_write_json, atomic_write_text
from dllm_align.evaluate.harness import DiffusionLM, HARNESS_NAME, bundled_task_dir, eval_device
from dllm_align.generate.backend import recorded_settings
from dllm_align.generate.settings import SamplerSettings
from dllm_align.models.load import BUILTIN_SPECS, load_from_section, model_source
from dllm_align.objective.elbo import likelihood_for


# --------------------------------------------------------------------------- the evaluate command
@dataclass(frozen=True)
class TaskPlan:
    """One task as the ``evaluate`` command runs it: the recipe's entry resolved against its defaults."""

    key: str  # the name in the table (the recipe's key)
    harness_task: str  # the harness's task or group name
    sampler: Any  # generation.SamplerSettings
    num_fewshot: Optional[int]
    limit: Optional[int]
    metric: Optional[str]
    apply_chat_template: bool

    def describe(self) -> dict:
        return {
            "harness_task": self.harness_task,
            "gen_length": self.sampler.gen_length,
            "block_length": self.sampler.block_length,
            "steps": self.sampler.steps,
            "num_fewshot": self.num_fewshot,
            "limit": self.limit,
            "metric": self.metric,
            "apply_chat_template": self.apply_chat_template,
        }


def plan_tasks(recipe, keys: Optional[Sequence[str]] = None, limit: Optional[int] = None) -> list[TaskPlan]:
    """Resolve the tasks to run: the recipe's ``evaluate.tasks`` (or ``keys``, which may also name
    harness tasks absent from the map, run with the ``generate`` defaults).

    Decoding comes from the task's gen_length / block_length / steps, else the
    ``generate`` section; ``limit`` (the command line) wins over the task's and
    the section's.
    """
    ev = recipe.evaluate
    if keys is None:
        keys = list(ev.tasks)
    if not keys:
        raise UserError(
            "no tasks to evaluate: the recipe's evaluate.tasks is empty and --tasks was not given",
            hint="e.g. --tasks gsm8k,mmlu_generative, or see `dllm-align recipes show table4_downstream`",
        )
    base = SamplerSettings.from_section(recipe.generate)
    plans = []
    for key in keys:
        t = ev.tasks.get(key) or EvalTask()
        try:
            sampler = base.replace(
                gen_length=base.gen_length if t.gen_length is None else t.gen_length,
                block_length=base.block_length if t.block_length is None else t.block_length,
                steps=base.steps if t.steps is None else t.steps,
            )
        except UserError as e:
            raise UserError(f"evaluate.tasks.{key}: {e.message.removeprefix('invalid generation settings: ')}") from None
        plans.append(
            TaskPlan(
                key=key,
                harness_task=t.task or key,
                sampler=sampler,
                num_fewshot=t.num_fewshot,
                limit=next((v for v in (limit, t.limit, ev.limit) if v is not None), None),
                metric=t.metric,
                apply_chat_template=ev.apply_chat_template if t.apply_chat_template is None else t.apply_chat_template,
            )
        )
    return plans


def check_likelihood(recipe, names: Sequence[str]) -> None:
    """``reference.likelihood`` (the likelihood loglikelihood requests are scored with) checked against each model
    that can be read here (a built-in model, a local folder), before anything is written: a family that does not take
    it is refused by name. A hub id is checked once loaded (:class:`DiffusionLM`)."""
    if not recipe.reference.likelihood:
        return
    for name in names:
        if name in BUILTIN_SPECS or name.startswith("builtin:") or Path(name).expanduser().is_dir():
            family = model_source(name, recipe.model.revision).family
            if family is not None:
                likelihood_for(family, recipe.reference.likelihood)


def task_manager(names: Sequence[str], include_path: Optional[str | Sequence[str]] = None):
    """A harness TaskManager that knows ``names``; unknown names are a UserError with a did-you-mean.

    Indexing the harness's ~15k built-in tasks takes several seconds, so when
    every name is found in the include paths (the bundled task folder and the
    user's) the built-in index is skipped.
    """
    paths = [str(bundled_task_dir())] if bundled_task_dir().is_dir() else []
    if include_path:
        for p in [include_path] if isinstance(include_path, (str, Path)) else include_path:
            if not Path(p).is_dir():
                raise UserError(f"--include-path {p}: not a folder of task YAMLs")
            paths.append(str(p))
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(n in local.all_tasks for n in names):
        return local
    tm = TaskManager(include_path=paths)
    for n in names:
        if n not in tm.all_tasks:
            close = difflib.get_close_matches(n, tm.all_tasks, n=3)
            raise UserError(
                f"lm-evaluation-harness has no task or group named '{n}'"
                + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""),
                hint="`lm-eval ls tasks` lists them; local YAMLs go in --include-path DIR",
            )
    return tm


def model_label(name_or_path: str) -> str:
    """A folder name for a model: the hub id with '/' -> '__', or a path's last two parts."""
    if name_or_path.startswith("builtin:"):
        return name_or_path.replace(":", "_")
    p = Path(name_or_path).expanduser()
    if p.exists() or name_or_path.startswith((".", "/", "~")):
        parts = [x for x in p.resolve().parts if x not in ("/", "")]
        return "__".join(parts[-2:]) or "model"
    return name_or_path.replace("/", "__")


def model_fingerprint(name_or_path: str, revision: Optional[str] = None) -> str:
    """What identifies a model's weights without loading them: a folder's config and the
    sizes and times of its weight files; a hub id and revision; the built-in spec."""
    h = hashlib.sha256(f"{name_or_path}@{revision}".encode())
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        h = hashlib.sha256(str(p.resolve()).encode())
        for f in sorted(p.iterdir()):
            if f.suffix in (".json", ".safetensors", ".bin") and f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
                if f.name == "config.json":
                    h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _fingerprint(plan: TaskPlan, ev, model_fp: str, model_section, reference) -> dict:
    return {
        "model": model_fp,
        "tokenizer": model_section.tokenizer,
        "dtype": model_section.dtype,
        "task": plan.describe() | {"sampler": recorded_settings(plan.sampler)},
        "mc_num": ev.mc_num,
        "mc_seed": ev.mc_seed,
        "stratified": ev.stratified,
        "greedy_check": ev.greedy_check,
        "max_length": ev.max_length,
        "fewshot_as_multiturn": ev.fewshot_as_multiturn,
        "system_instruction": ev.system_instruction,
        "lm_eval": version("lm-eval"),
    } | reference.likelihood_record()  # a chosen likelihood (nothing for the family's: earlier results stay valid)


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def run_task(lm: DiffusionLM, plan: TaskPlan, ev, tm) -> Optional[dict]:
    """One harness run of one task with the plan's settings; the harness's result dict on rank 0, None elsewhere."""
    lm.configure(sampler=plan.sampler)
    if ev.allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # the harness's code_eval metric checks this
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=[plan.harness_task],
            num_fewshot=plan.num_fewshot,
            limit=plan.limit,
            task_manager=tm,
            bootstrap_iters=ev.bootstrap_iters,
            log_samples=ev.log_samples,
            apply_chat_template=plan.apply_chat_template,
            fewshot_as_multiturn=ev.fewshot_as_multiturn and plan.apply_chat_template,
            system_instruction=ev.system_instruction,
            confirm_run_unsafe_code=ev.allow_code_execution,
        )
    except ValueError as e:
        if "unsafe" in str(e):
            raise UserError(
                f"task '{plan.key}' runs model-written code to score it",
                hint="pass --allow-code-execution (or evaluate.allow_code_execution: true) on a sandboxed machine",
            ) from None
        raise


def evaluate_model(
    recipe,
    name_or_path: str,
    plans: Sequence[TaskPlan],
    out_dir: Path,
    *,
    rerun: bool = False,
    lm_factory=None,
    tm=None,
) -> Optional[dict]:
    """Run every planned task on one model; write ``out_dir/results.json`` (the harness's JSON, all
    tasks merged), ``tasks/<key>.json`` and ``samples_<key>.jsonl``; return the merged dict (rank 0).

    A task whose ``tasks/<key>.json`` was made with the same model and
    settings is not run again unless ``rerun`` (so a killed run, or a second
    comparison against the same base, resumes). The model is loaded only if a
    task has to run.
    """
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def info(msg: str) -> None:
        if rank0:
            _info(msg)

    ev = recipe.evaluate
    out_dir = Path(out_dir)
    model_fp = model_fingerprint(name_or_path, recipe.model.revision)
    names = [p.harness_task for p in plans]
    lm = None
    per_task: dict[str, dict] = {}
    for plan in plans:
        fp = _fingerprint(plan, ev, model_fp, recipe.model, recipe.reference)
        task_file = out_dir / "tasks" / f"{plan.key}.json"
        if not rerun and task_file.is_file():
            try:
                old = json.loads(task_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                old = {}
            if old.get("fingerprint") == fp:
                info(f"{plan.key}: reusing {task_file}")
                per_task[plan.key] = old["results"]
                continue
        if tm is None:
            tm = task_manager(names, ev.include_path)
        if lm is None:
            lm = lm_factory() if lm_factory else make_lm(recipe, name_or_path)
        shots = plan.num_fewshot if plan.num_fewshot is not None else "task default"
        info(
            f"{plan.key}: {plan.harness_task} on {name_or_path} (shots {shots}; generation: gen {plan.sampler.gen_length} / "
            f"block {plan.sampler.block_length} / steps {plan.sampler.steps}; loglikelihood: {ev.mc_num} ELBO draws"
            + (f" of the {lm.likelihood} likelihood, reference.likelihood" if recipe.reference.likelihood else "") + ")"
        )
        res = run_task(lm, plan, ev, tm)
        if res is None:  # not rank 0: the merged result lives there
            continue
        res = _jsonable(dict(res))
        samples = res.pop("samples", None)
        res.pop("pretty_env_info", None)
        if samples is not None:
            lines = []
            for task_name, rows in samples.items():
                for row in rows:
                    lines.append(json.dumps({"task": task_name, **row}, ensure_ascii=False))
            atomic_write_text(out_dir / f"samples_{plan.key}.jsonl", "\n".join(lines) + ("\n" if lines else ""))
        atomic_write_json(task_file, {"fingerprint": fp, "results": res})
        per_task[plan.key] = res
    if lm is not None:  # free the weights before the next model loads
        del lm

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not rank0:
        return None
    merged = merge_results(per_task, plans, name_or_path)
    atomic_write_json(out_dir / "results.json", merged)
    return merged


def make_lm(recipe, name_or_path: str) -> DiffusionLM:
    """Load ``name_or_path`` as the recipe's model section describes and wrap it for the harness."""
    ev = recipe.evaluate
    mp = load_from_section(recipe.model, device=eval_device(), name_or_path=name_or_path)
    g = recipe.generate
    return DiffusionLM(
        pretrained=name_or_path, predictor=mp, batch_size=ev.batch_size, mc_num=ev.mc_num, mc_seed=ev.mc_seed,
        stratified=ev.stratified, greedy_check=ev.greedy_check, max_length=ev.max_length, packing=ev.packing,
        gen_length=g.gen_length, block_length=g.block_length, steps=g.steps, remasking=g.remasking,
        temperature=g.temperature, cfg=g.cfg, cache=g.cache, threshold=g.threshold, seed=g.seed,
        backend=g.backend, generate=g, model_section=recipe.model, likelihood=recipe.reference.likelihood,
        reference=recipe.reference,
    )


_MERGED_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def merge_results(per_task: dict[str, dict], plans: Sequence[TaskPlan], name_or_path: str) -> dict:
    """One harness-shaped JSON for all tasks (each task ran on its own), plus this project's plan."""
    merged: dict[str, Any] = {k: {} for k in _MERGED_KEYS}
    for plan in plans:
        res = per_task.get(plan.key)
        if not res:
            continue
        for k in _MERGED_KEYS:
            merged[k].update(res.get(k) or {})
        for k in ("config", "lm_eval_version", "transformers_version", "git_hash"):
            if k in res:
                merged[k] = res[k]
    if merged.get("config"):
        merged["config"]["model"] = HARNESS_NAME
        merged["config"]["model_args"] = {"pretrained": name_or_path}
    merged["dllm_align"] = {
        "model": name_or_path,
        "tasks": {p.key: p.describe() | {"sampler": recorded_settings(p.sampler)} for p in plans},
        "scores": {p.key: headline(merged, p) for p in plans if p.key in per_task},
    }
    return merged


def headline(results: dict, plan: TaskPlan) -> dict:
    """The score shown for a task: its group's entry if it is a group, the chosen (or first) metric."""
    entry = (results.get("groups") or {}).get(plan.harness_task) or results["results"].get(plan.harness_task)
    if entry is None:
        raise UserError(f"the harness returned no result for '{plan.harness_task}'")
    metrics = [k for k in entry if "," in k and "_stderr," not in k]
    if plan.metric is not None:
        if plan.metric not in entry:
            raise UserError(
                f"evaluate.tasks.{plan.key}.metric: '{plan.metric}' is not among the task's metrics",
                hint="metrics: " + ", ".join(metrics),
            )
        metric = plan.metric
    else:
        numeric = [m for m in metrics if isinstance(entry[m], (int, float))]
        if not numeric:
            raise UserError(f"task '{plan.key}' reported no numeric metric")
        metric = numeric[0]
    name, _, filt = metric.partition(",")
    se = entry.get(f"{name}_stderr,{filt}")
    return {
        "metric": metric,
        "value": entry[metric],
        "stderr": se if isinstance(se, (int, float)) else None,
        "n_shot": (results.get("n-shot") or {}).get(plan.harness_task),
    }


def comparison_rows(a: dict, b: dict, plans: Sequence[TaskPlan]) -> list[dict]:
    """Rows of the side-by-side table (paper Table 4): task, shots, metric, score A, score B, B - A."""
    rows = []
    for p in plans:
        sa, sb = a["dllm_align"]["scores"].get(p.key), b["dllm_align"]["scores"].get(p.key)
        if sa is None or sb is None:
            continue
        rows.append(
            {
                "task": p.key,
                "n_shot": sa["n_shot"] if sa["n_shot"] is not None else p.num_fewshot,
                "metric": sa["metric"],
                "a": sa["value"],
                "a_stderr": sa["stderr"],
                "b": sb["value"],
                "b_stderr": sb["stderr"],
                "delta": sb["value"] - sa["value"],
            }
        )
    return rows


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{100 * v:.2f}"


def comparison_markdown(rows: Sequence[dict], name_a: str, name_b: str) -> str:
    """A markdown table of :func:`comparison_rows` in percent, the better score in bold."""
    lines = [
        f"| Task (shots) | Metric | {name_a} | {name_b} | Δ |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        a, b = _pct(r["a"]), _pct(r["b"])
        if r["b"] > r["a"]:
            b = f"**{b}**"
        elif r["a"] > r["b"]:
            a = f"**{a}**"
        if r["a_stderr"] is not None:
            a += f" ± {_pct(r['a_stderr'])}"
        if r["b_stderr"] is not None:
            b += f" ± {_pct(r['b_stderr'])}"
        shots = "" if r["n_shot"] is None else f" ({r['n_shot']})"
        lines.append(f"| {r['task']}{shots} | {r['metric']} | {a} | {b} | {100 * r['delta']:+.2f} |")
    return "\n".join(lines) + "\n"


def scores_markdown(merged: dict, plans: Sequence[TaskPlan], name: str) -> str:
    """A one-model markdown table of the headline scores (percent)."""
    lines = [f"| Task (shots) | Metric | {name} |", "|---|---|---:|"]
    for p in plans:
        s = merged["dllm_align"]["scores"].get(p.key)
        if s is None:
            continue
        shots = "" if s["n_shot"] is None else f" ({s['n_shot']})"
        se = "" if s["stderr"] is None else f" ± {_pct(s['stderr'])}"
        lines.append(f"| {p.key}{shots} | {s['metric']} | {_pct(s['value'])}{se} |")
    return "\n".join(lines) + "\n"

