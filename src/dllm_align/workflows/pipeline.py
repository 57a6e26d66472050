"""The pipeline stages as resumable library calls: reference -> train -> generate -> judge.

``dllm-align demo`` and ``dllm-align ablate`` are sequences of these stages
over run folders. Every stage skips work that is already done (a finished
reference cache, a final model, complete generation files, cached
judgements), so a rerun after a kill continues, and a rerun after success
finishes at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from dllm_align.core import console
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.core.io import atomic_write_text
from dllm_align.core.runfolder import check_training_settings
from dllm_align.data.load import load_paired
from dllm_align.generate.run import run_generate
from dllm_align.judge.run import judge_files
from dllm_align.objective.base import objective_for
from dllm_align.training.checkpoint import FINAL
from dllm_align.training.reference import run_precompute
from dllm_align.training.train import train


def reference(recipe) -> None:
    """Fill the reference cache (finished shards are reused) unless the recipe computes it online."""
    if not objective_for(recipe.train).needs_reference or recipe.reference.mode == "online":
        return

    run_precompute(recipe)


def trained_model(recipe, allow_changes=()) -> Path:
    """Train (or resume, or reuse) the policy of ``recipe``; returns its final model folder. ``allow_changes``:
    recipe keys that may differ from the recorded run (``--allow-change``)."""
    out = Path(recipe.output_dir)
    final = out / FINAL
    done = out / "train.done"
    if done.exists() and (final / "config.json").exists():
        check_training_settings(recipe, out, allow_changes)  # a finished model is reused only for the settings that made it
        console.info(f"train: reusing {final}")
        return final
    res = train(recipe, resume=True, allow_changes=allow_changes)
    if console.global_rank() == 0:  # one writer when several processes train
        # The run's steps, not this session's: a run resumed after its last step (killed while exporting) took
        # no step in this session, yet its model has every step.
        summary = json.loads((Path(res.final_dir) / "training_summary.json").read_text(encoding="utf-8"))
        done.write_text(json.dumps({"steps": summary["steps"]}) + "\n")
    return Path(res.final_dir)


def generations(recipe, model: str | Path, out: Path, split: Optional[str] = None) -> Path:
    """Generate for the recipe's test prompts with ``model`` into ``out`` (ids already there are kept)."""
    rec = recipe.model_copy(deep=True)
    rec.model.name_or_path = str(model)
    if split is not None:
        rec.generate.split = split
    run_generate(rec, output=out)
    return out


def targets(recipe, out_dir: Path) -> dict[str, Path]:
    """The test split's own chosen and rejected completions as generation files (the paper's
    'chosen target' and 'rejected target' rows); empty when the test data is not paired."""
    d = recipe.data
    try:
        pairs = load_paired(d.test, split=d.test_split, quiet=True)
    except UserError as e:
        console.warn(f"no chosen/rejected targets: the test data is not paired ({e.message})")
        return {}
    limit = recipe.generate.limit
    pairs = pairs[:limit] if limit else pairs
    files = {}
    for which in ("chosen", "rejected"):
        path = out_dir / f"gen.{which}.jsonl"
        if not path.exists():
            lines = [
                json.dumps({"id": p.id, "prompt": p.prompt, "completion": getattr(p, which)}, ensure_ascii=False)
                for p in pairs
            ]
            atomic_write_text(path, "\n".join(lines) + "\n")
        files[which] = path
    return files


def judged(recipe, a: Path, b: Path, out: Path) -> dict:
    """Judge ``a`` against ``b`` with the recipe's judges; returns results.json's content."""
    res = judge_files(a, b, out, recipe.judge)
    if res.failed:
        raise RunFailure(f"{res.failed} judgement(s) failed in {out}; rerun to retry them")
    return res.results


def first_judge(results: dict) -> dict:
    """The headline numbers: the majority vote with two judges, else the only judge."""
    if "majority_vote" in results:
        return results["majority_vote"]
    return next(iter(results["judges"].values()))
