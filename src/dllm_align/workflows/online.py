"""Online ELBO-KTO: label the policy's own samples with a verifier, then train on them, in rounds.

Round r (folder ``DIR/round-<r>``):

1. ``label``: ``n`` samples per prompt from the current policy (round 0: the recipe's model), each
   labelled by the verifier (:mod:`dllm_align.online.label`);
2. prompts whose samples are all desirable or all undesirable carry no contrast within the prompt:
   kept (the default) or dropped (``--drop-uniform``);
3. class weights balanced for the round, lambda_D n_D = lambda_U n_U (the paper's imbalance rule: a
   verifier's labels are rarely balanced), written as the round's ``weights.json``;
4. the reference ELBOs of the round's rows: the reference is the initial model (default) or the
   previous round's policy (``--reference previous``);
5. ELBO-KTO on the round's rows, starting from the current policy; its final model is the next
   round's policy.

Every stage is the resumable library call the other commands use: a killed run continues at the
stage it reached (finished labels, caches and models are reused), and a rerun with other settings is
refused by name (``DIR/online.json`` records them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from dllm_align.core import console
from dllm_align.core.errors import UserError

RECORD = "online.json"


def _check_settings(out: Path, settings: dict) -> None:
    """Record the run's settings in ``online.json``, or refuse a rerun with others. A record with no finished
    stage behind it (no round's labelled samples yet) binds nothing: a first run refused or stopped before it
    labelled anything leaves nothing that blocks the corrected rerun."""
    from dllm_align.core.io import atomic_write_json
    from dllm_align.online.label import SUMMARY

    path = out / RECORD
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            old = None
        if not isinstance(old, dict):
            raise UserError(f"{path}: not the record online writes (damaged)",
                            hint="restore it, or remove it to continue with the settings given now")
        diffs = [(k, old.get(k), v) for k, v in settings.items() if old.get(k) != v and k != "rounds"]
        if diffs and any(out.glob(f"round-*/{SUMMARY}")):
            listed = "; ".join(f"{k} (was {a!r}, now {b!r})" for k, a, b in diffs)
            raise UserError(f"cannot continue the online run in {out}: settings differ from the recorded run: {listed}",
                            hint="use the recorded settings, or another run folder (-o)")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, settings)


def _round_rows(rows_path: Path, keep_uniform: bool, out: Path) -> tuple[Path, dict]:
    """The round's training rows (uniform prompts dropped unless kept) and their balanced class weights."""
    from dllm_align.core.io import atomic_write_json, atomic_write_text

    rows = []
    for i, line in enumerate(rows_path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if not isinstance(r, dict) or not isinstance(r.get("prompt_id"), str) or not isinstance(r.get("label"), bool):
            raise UserError(f"{rows_path}:{i}: not a row label wrote (damaged)",
                            hint=f"remove {rows_path.parent} to label the round again")
        rows.append(r)
    by_prompt: dict[str, list[bool]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(r["label"])
    mixed = {k for k, v in by_prompt.items() if any(v) and not all(v)}
    kept = rows if keep_uniform else [r for r in rows if r["prompt_id"] in mixed]
    n_d = sum(r["label"] for r in kept)
    n_u = len(kept) - n_d
    if n_d == 0 or n_u == 0:
        raise UserError(f"{rows_path}: every kept sample is {'undesirable' if n_d == 0 else 'desirable'}: no contrast to train on",
                        hint="sample more (--n), change the temperature, or keep uniform prompts (leave out --drop-uniform)")
    lam_d, lam_u = (1.0, n_d / n_u) if n_d >= n_u else (n_u / n_d, 1.0)
    train_path = out / "train_rows.jsonl"
    atomic_write_text(train_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    atomic_write_json(out / "weights.json", {"lambda_desirable": lam_d, "lambda_undesirable": lam_u})
    return train_path, {"kept_rows": len(kept), "desirable": n_d, "undesirable": n_u, "lambda_desirable": lam_d,
                        "lambda_undesirable": lam_u, "mixed_prompts": len(mixed), "prompts": len(by_prompt)}


def run_online(recipe, out_dir: str | Path, *, rounds: int, rule: str, n: int, limit: Optional[int] = None,
               prompts: Optional[str] = None, reference: str = "initial", keep_uniform: bool = True,
               temperature: Optional[float] = None, answer_column: str = "answer") -> list[dict]:
    """Run (or continue) ``rounds`` rounds; returns one row per round for the table."""
    from dllm_align.online.label import check_rule, check_temperature, read_prompts

    if rounds < 1:
        raise UserError(f"--rounds {rounds}: at least one round")
    if reference not in ("initial", "previous"):
        raise UserError(f"--reference {reference}: initial or previous")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: a file, not a folder", hint="name a folder for the run")
    # The rule and the prompts are refused before the folder is made or recorded (each round's label checks
    # them again, with the model).
    check_temperature(temperature, n)
    verifier = check_rule(rule, answer_column, recipe)
    source = prompts or recipe.data.train
    if source is None:
        raise UserError("no prompts: pass --prompts FILE, or set data.train in the recipe")
    if not read_prompts(str(source), None if prompts else "train", limit, None if rule.startswith("judge:") else verifier):
        raise UserError(f"{source}: no prompts")
    from dllm_align.core.io import DirLock

    # One online run per folder: the second is refused while the first holds it (the lock makes the folder).
    with DirLock(out, f"{out}: another online run is writing this folder; wait for it, or use another (-o)"):
        return _run_rounds(recipe, out, rounds=rounds, rule=rule, n=n, limit=limit, prompts=prompts, reference=reference,
                           keep_uniform=keep_uniform, temperature=temperature, answer_column=answer_column)


def _run_rounds(recipe, out: Path, *, rounds: int, rule: str, n: int, limit: Optional[int], prompts: Optional[str],
                reference: str, keep_uniform: bool, temperature: Optional[float], answer_column: str) -> list[dict]:
    from dllm_align.online.label import ROWS, SUMMARY, label
    from dllm_align.workflows import pipeline

    base = recipe.model.name_or_path
    _check_settings(out, {"model": base, "rule": rule, "n": n, "limit": limit, "prompts": prompts, "reference": reference,
                          "keep_uniform": keep_uniform, "temperature": temperature, "answer_column": answer_column,
                          "train": recipe.train.model_dump(mode="json"), "generate": recipe.generate.model_dump(mode="json")})
    policy, table = base, []
    for r in range(rounds):
        rd = out / f"round-{r}"
        if (rd / SUMMARY).exists():
            console.info(f"online: round {r}: reusing its labelled samples")
            summary = json.loads((rd / SUMMARY).read_text(encoding="utf-8"))
        else:
            summary = label(recipe, rd, rule=rule, n=n, prompts=prompts, model=policy, limit=limit, temperature=temperature,
                            answer_column=answer_column, round_=r)
        train_rows, counts = _round_rows(rd / ROWS, keep_uniform, rd)
        rec = recipe.model_copy(deep=True)
        rec.output_dir = str(rd)
        rec.model.name_or_path = policy
        rec.reference.model = base if (reference == "initial" or r == 0) else policy
        rec.reference.cache = None
        rec.data.train, rec.data.format, rec.data.label = str(train_rows), "unpaired", None
        rec.data.weights_file = str(rd / "weights.json")
        rec.data.limit = None
        rec.train.max_steps = None
        pipeline.reference(rec)
        final = pipeline.trained_model(rec)
        metrics = json.loads((final / "training_summary.json").read_text(encoding="utf-8")).get("last_metrics") or {}
        table.append({"round": r, "policy": str(policy), "rows": summary["rows"], "desirable_share": summary["desirable_share"],
                      "prompts_all_desirable": summary["prompts_all_desirable"],
                      "prompts_all_undesirable": summary["prompts_all_undesirable"], **counts,
                      "reward_desirable": metrics.get("reward_desirable"), "reward_undesirable": metrics.get("reward_undesirable")})
        policy = str(final)
    from dllm_align.core.io import atomic_write_json

    atomic_write_json(out / "rounds.json", {"rounds": table, "final_model": policy})
    _plot(out, table)
    return table


def _plot(out: Path, table: list[dict]) -> None:
    """rounds.png: the desirable share of each round's samples (the policy's own accuracy under the verifier)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from dllm_align.core.io import atomic_path

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([t["round"] for t in table], [100 * t["desirable_share"] for t in table], marker="o")
    ax.set_xlabel("round (samples of the policy entering it)")
    ax.set_ylabel("desirable samples (%)")
    ax.set_title("Online ELBO-KTO: the verifier's verdict per round")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out / "rounds.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def markdown_table(table: list[dict]) -> str:
    head = "| round | samples | desirable % | all-good prompts | all-bad prompts | lambda_D | lambda_U | reward D | reward U |"
    lines = [head, "|" + "---|" * 9]
    for t in table:
        def f(v):
            return "-" if v is None else f"{v:+.3f}"
        lines.append(f"| {t['round']} | {t['rows']} | {100 * t['desirable_share']:.1f} | {t['prompts_all_desirable']} | "
                     f"{t['prompts_all_undesirable']} | {t['lambda_desirable']:.2f} | {t['lambda_undesirable']:.2f} | "
                     f"{f(t['reward_desirable'])} | {f(t['reward_undesirable'])} |")
    return "\n".join(lines)
