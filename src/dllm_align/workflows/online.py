"""Online ELBO-KTO: label the policy's own samples with a verifier, then train on them, in rounds.

Round r (folder ``DIR/round-<r>``):

1. ``label``: ``n`` samples per prompt from the current policy (round 0: the recipe's model), each
   labelled by the verifier (:mod:`dllm_align.online.label`), and (``greedy``, the default) one greedy
   decode per prompt with the recipe's decoding, labelled the same way and trained on with the samples:
   the decoding a user runs (and the held-out evaluation measures) is then what the loop learns from;
2. prompts whose samples are all desirable or all undesirable carry no contrast within the prompt:
   kept (the default) or dropped (``--drop-uniform``);
3. class weights balanced for the round, lambda_D n_D = lambda_U n_U (the paper's imbalance rule: a
   verifier's labels are rarely balanced), times the recipe's ``train.lambda_*`` (1 and 1 leave the
   balance as it is; the recipe's choice is honoured as a ratio on top of it), written with both
   factors as the round's ``weights.json``;
4. the reference ELBOs of the round's rows: the reference is the initial model (default) or the
   previous round's policy (``--reference previous``);
5. ELBO-KTO on the round's rows, starting from the current policy, for the recipe's ``train``
   settings (``max_steps`` included); its final model is the next round's policy;
6. the held-out evaluation of that model: the verifier's desirable share on held-out prompts
   (``online.heldout``, default the recipe's ``data.test``), greedy and sampled, with 90% intervals.

Sampling seeds (:func:`dllm_align.online.label.label`'s ``round_``), mask seeds and the batch order
are drawn afresh each round (round 0 keeps the recipe's, so round 0 is what ``label`` + ``train`` give); the held-out samples use the same seeds every
round, so that rounds differ only by their model. ``--keep guard`` (the default) never ends worse than it
began without saying so: a round whose held-out greedy share falls below the 90% interval of the model it
started from is rolled back (that model stays the final one), the loop stops there, says so, and the table
and ``rounds.json`` (``rolled_back_round``) show it; without held-out prompts it cannot check and warns.
``--keep last`` keeps the last round's model whatever it scored; ``--keep best`` makes the round with the
highest held-out greedy share (then sampled share, then the earlier round) the final model.

Every stage is the resumable library call the other commands use: a killed run continues at the
stage it reached (finished labels, caches and models are reused). ``DIR/online.json`` records what
defines a round (model, the prompts' content fingerprint whatever their source, rule, n, temperature,
reference, seeds, train and generate settings); a rerun that differs is refused by name unless let
through with ``--allow-change KEY``, and so is asking for fewer rounds than the folder finished.
A change let through is remembered per round (``online.json``'s ``history``): a rerun with the same settings
continues without repeating the flag. Recipe keys that online sets itself for each round are refused when given
(:data:`SET_BY_ONLINE`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from accelerate import PartialState

from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.core.io import atomic_path, atomic_write_json, atomic_write_text
from dllm_align.core.runfolder import (TRAIN_NEUTRAL, check_shared_folder, differing, flatten, from_rank0, rank0_lock,
                                      recorded_recipe, records_kept_on_refusal, refuse_changes)
from dllm_align.generate.backend import check_serves_each_round, run_record
from dllm_align.generate.settings import row_seed
from dllm_align.online.label import (ROWS, SUMMARY, UNSURE, check_rule, check_temperature, label, label_settings,
                                     prompt_fingerprint, read_prompts)
from dllm_align.online.verifiers import recorded_settings as verifier_settings
from dllm_align.serve.parity import online_gate
from dllm_align.workflows import pipeline

# lazy imports: matplotlib: an optional extra (pip install dllm-align[plot]); without it the run skips its plot

RECORD = "online.json"
ROUNDS = "rounds.json"

# Keys online sets itself for every round: a --set of one of them would be overwritten, so it is refused.
SET_BY_ONLINE = {
    "reference.model": "the reference is chosen with --reference (initial or previous)",
    "reference.cache": "each round computes its own reference cache in its folder",
    "data.format": "each round trains on its own unpaired labelled rows",
    "data.label": "each round trains on its own unpaired labelled rows",
    "data.weights_file": "each round's class weights are computed from its labels (scale them with train.lambda_*)",
    "data.limit": "the number of prompts is --limit (online.limit)",
}
# Round recipe keys that are paths inside the run folder, set by online: a moved folder changes them and
# nothing else (what they hold is pinned by online.json), so a round's training is continued through them.
ROUND_PATHS = ("data.train", "data.weights_file", "model.name_or_path", "reference.model")


def refuse_set_by_online(overrides) -> None:
    """One error naming every ``--set`` of a key that online sets itself (:data:`SET_BY_ONLINE`)."""
    bad = []
    for ov in overrides or []:
        key = ov.partition("=")[0].strip()
        if key in SET_BY_ONLINE:
            bad.append(f"--set {ov}: online would replace it ({SET_BY_ONLINE[key]})")
    if bad:
        raise UserError("; ".join(bad), hint="leave it out: online sets it for every round")


def _check_settings(out: Path, settings: dict, allow=(), main: bool = True) -> None:
    """Record the run's settings in ``online.json``, or refuse a rerun with others (those let through by
    ``--allow-change`` are warned about). A record with no finished stage behind it (no labelled samples yet,
    of a round or a held-out evaluation) binds nothing: a first run refused or stopped before it labelled
    anything leaves nothing that blocks the corrected rerun. Rank 0 alone writes (``main``)."""
    path = out / RECORD
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            old = None
        if not isinstance(old, dict):
            raise UserError(f"{path}: not the record online writes (damaged)",
                            hint="restore it, or remove it to continue with the settings given now")
        if any(out.glob(f"*/{SUMMARY}")):
            # a run recorded before rounds labelled their greedy decodes trained on its samples alone
            old.setdefault("greedy", False)
            diffs = differing(old, settings, neutral=("rounds", "keep", "prompts_source", "heldout_source", "history"))
            allowed = refuse_changes(f"cannot continue the online run in {out}", diffs, allow=allow)
            for k, a, b in allowed:
                console.warn(f"online: {k} differs from the recorded run ({a!r} -> {b!r}): let through by --allow-change")
    if main:  # one writer when several processes run the loop
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, settings)


def _is_key(key: str, tree: dict) -> bool:
    keys = set(flatten(tree))
    return key in keys or any(k.startswith(key + ".") for k in keys)


def _check_allow(allow, settings: dict, recipe_keys: dict) -> None:
    """Every ``--allow-change KEY`` names a key of online.json or of the recipe (or is ``all``)."""
    for a in allow:
        if a != "all" and not _is_key(a, settings) and not _is_key(a, recipe_keys):
            raise UserError(f"--allow-change {a}: no such key of the online run or the recipe",
                            hint="name a key as the refusal did (e.g. prompts_fingerprint, seeds.reference, train.lr), or 'all'")


def _finished_rounds(out: Path) -> int:
    """How many rounds the folder finished (rounds.json, or the rounds whose training is done)."""
    n = 0
    if (out / ROUNDS).exists():
        try:
            n = len(json.loads((out / ROUNDS).read_text(encoding="utf-8")).get("rounds") or [])
        except ValueError:
            n = 0
    while (out / f"round-{n}" / "train.done").exists():
        n += 1
    return n


def round_seed(seed: int, r: int) -> int:
    """The seed of round ``r``: the recipe's in round 0, then a hash of it and the round (31 bits)."""
    if r == 0:
        return seed

    return row_seed(seed, f"online-round-{r}") & 0x7FFFFFFF


def _read_rows(rows_path: Path) -> list[dict]:
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
    return rows


def _round_rows(rows_path: Path, keep_uniform: bool, out: Path, lambdas: tuple[float, float],
                greedy_path: Optional[Path] = None) -> tuple[Path, dict]:
    """The round's training rows (uniform prompts dropped unless kept) and their class weights: balanced
    (lambda_D n_D = lambda_U n_U, the larger 1) times the recipe's lambda_D, lambda_U. The greedy decodes
    (``greedy_path``) join the samples with ids of their own (``<prompt>:greedy``): a row's id seeds its
    masks, and the greedy decode of a prompt is not its sample 0."""
    rows = _read_rows(rows_path)
    greedy_rows = []
    if greedy_path is not None:
        for r in _read_rows(greedy_path):
            greedy_rows.append({**r, "id": f"{r['prompt_id']}:greedy"})
    rows = rows + greedy_rows
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
    bal_d, bal_u = (1.0, n_d / n_u) if n_d >= n_u else (n_u / n_d, 1.0)
    lam_d, lam_u = bal_d * lambdas[0], bal_u * lambdas[1]
    train_path = out / "train_rows.jsonl"
    atomic_write_text(train_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    weights = {"lambda_desirable": lam_d, "lambda_undesirable": lam_u, "balance_desirable": bal_d, "balance_undesirable": bal_u,
               "recipe_lambda_desirable": lambdas[0], "recipe_lambda_undesirable": lambdas[1]}
    atomic_write_json(out / "weights.json", weights)
    greedy = None if greedy_path is None else sum(r["label"] for r in greedy_rows) / max(1, len(greedy_rows))
    return train_path, {"kept_rows": len(kept), "desirable": n_d, "undesirable": n_u, **weights,
                        "mixed_prompts": len(mixed), "prompts": len(by_prompt), "greedy_desirable_share": greedy}


def _share_ci(rows: list[dict]) -> dict:
    """The desirable share of labelled rows with a 90% interval over prompts (the samples of one prompt are
    not independent: the standard error is that of the per-prompt means). An unsure row (label None) counts
    as not desirable, so that a model cannot raise its share by answering so that the verifier abstains;
    ``unsure`` says how many there were."""
    per: dict[str, list[bool]] = {}
    for r in rows:
        per.setdefault(r["prompt_id"], []).append(r["label"] is True)
    means = [sum(v) / len(v) for v in per.values()]
    p = len(means)
    m = sum(means) / p
    sd = math.sqrt(sum((x - m) ** 2 for x in means) / (p - 1)) if p > 1 else 0.0
    h = 1.6448536269514722 * sd / math.sqrt(p)
    return {"share": m, "ci90": [max(0.0, m - h), min(1.0, m + h)], "prompts": p, "samples": len(rows),
            "unsure": sum(r["label"] is None for r in rows)}


def heldout_eval(recipe, model, out: Path, *, rule: str, n: int, temperature: Optional[float], answer_column: str,
                 heldout: Optional[str], limit: Optional[int]) -> Optional[dict]:
    """The verifier's desirable share of ``model`` on the held-out prompts, greedy (one decode per prompt with the
    recipe's decoding, as ``generate``) and sampled (``n`` per prompt at the online temperature, as the labeller), each with its 90% interval; reused when done.
    None when there are no held-out prompts."""
    if heldout is None and recipe.data.test is None:
        return None
    res = {}
    # greedy: the recipe's own decoding, as `generate` (and the demo's judging) decodes; sampled: as the labeller samples
    for kind, k, t, fast in (("greedy", 1, 0.0, False), ("sampled", n, temperature, True)):
        d = out / kind
        if not (d / SUMMARY).exists():
            if heldout is not None:
                label(recipe, d, rule=rule, n=k, prompts=heldout, model=str(model), limit=limit, temperature=t,
                      answer_column=answer_column, round_=0, fast=fast)
            else:
                rec = recipe.model_copy(deep=True)
                rec.data.train = recipe.data.test
                label(rec, d, rule=rule, n=k, split="test", model=str(model), limit=limit, temperature=t,
                      answer_column=answer_column, round_=0, fast=fast)
        rows = [json.loads(x) for name in (ROWS, UNSURE) if (d / name).exists()
                for x in (d / name).read_text(encoding="utf-8").splitlines() if x.strip()]
        res[kind] = _share_ci(rows)
    return res


def run_online(recipe, out_dir: str | Path, *, rounds: int, rule: str, n: int, limit: Optional[int] = None,
               prompts: Optional[str] = None, reference: str = "initial", keep_uniform: bool = True,
               temperature: Optional[float] = None, answer_column: str = "answer", heldout: Optional[str] = None,
               heldout_limit: Optional[int] = None, heldout_n: int = 4, keep: str = "guard",
               greedy: bool = True, allow_changes=(), parity: Optional[str] = None, skip_parity: bool = False) -> list[dict]:
    """Run (or continue) ``rounds`` rounds; returns one row per round for the table (module docstring).
    ``parity``: a passing parity record, which a served backend needs (``skip_parity``: go without, recorded)."""
    if rounds < 1:
        raise UserError(f"--rounds {rounds}: at least one round")
    if reference not in ("initial", "previous"):
        raise UserError(f"--reference {reference}: initial or previous")
    if keep not in ("guard", "last", "best"):
        raise UserError(f"--keep {keep}: guard, last or best")
    check_temperature(temperature, n)
    # each round samples the policy the round before trained: a backend that cannot be handed that folder
    # would sample another model (and the held-out share would measure it), so it is refused before round 0
    check_serves_each_round(recipe.generate.backend, own=recipe.generate.own_settings(recipe.generate.backend))
    gate = online_gate(recipe, parity, skip_parity)
    if keep == "best" and heldout is None and recipe.data.test is None:
        raise UserError("--keep best: no held-out prompts to rank the rounds by",
                        hint="set data.test in the recipe, or online.heldout (--heldout FILE)")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: a file, not a folder", hint="name a folder for the run")
    done = _finished_rounds(out)
    if rounds < done:
        raise UserError(f"--rounds {rounds}: {out} has {done} finished rounds; fewer would rewrite its record without them",
                        hint=f"use --rounds {done} (or more), or another run folder (-o); --keep best picks among the finished rounds")
    # The rule and the prompts are refused before the folder is made or recorded (each round's label checks
    # them again, with the model).
    verifier = check_rule(rule, answer_column, recipe)
    source = prompts or recipe.data.train
    if source is None:
        raise UserError("no prompts: pass --prompts FILE, or set data.train in the recipe")
    if not read_prompts(str(source), None if prompts else "train", limit, verifier):
        raise UserError(f"{source}: no prompts")

    rank, world = _process_group()
    if world > 1:
        # rank 0 writes the run's records and labelled rows, every rank reads them back
        check_shared_folder(out, "online run folder")
    # One online run per folder: the second is refused while the first holds it (the lock makes the folder).
    with rank0_lock(out, f"{out}: another online run is writing this folder; wait for it, or use another (-o)", rank, world), \
            records_kept_on_refusal(out, main=rank == 0):
        return _run_rounds(recipe, out, rank=rank, world=world, rounds=rounds, rule=rule, n=n, limit=limit, prompts=prompts,
                           reference=reference, keep_uniform=keep_uniform, temperature=temperature,
                           answer_column=answer_column, heldout=heldout, heldout_limit=heldout_limit, heldout_n=heldout_n,
                           keep=keep, greedy=greedy, allow_changes=allow_changes, gate=gate)


def _run_rounds(recipe, out: Path, *, rank: int, world: int, rounds: int, rule: str, n: int, limit: Optional[int],
                prompts: Optional[str], reference: str, keep_uniform: bool, temperature: Optional[float],
                answer_column: str, heldout: Optional[str], heldout_limit: Optional[int], heldout_n: int, keep: str,
                greedy: bool, allow_changes, gate: Optional[dict] = None) -> list[dict]:
    base = recipe.model.name_or_path
    source = prompts or recipe.data.train
    if source is None:
        raise UserError("no prompts: pass --prompts FILE, or set data.train in the recipe")
    settings = _run_settings(recipe, rule=rule, n=n, limit=limit, prompts=prompts, source=source, reference=reference,
                             keep_uniform=keep_uniform, answer_column=answer_column, temperature=temperature,
                             heldout=heldout, heldout_limit=heldout_limit, heldout_n=heldout_n, greedy=greedy,
                             rounds=rounds, keep=keep)
    if gate is not None:  # a served backend: the parity record it was trusted on, or the skip
        settings["parity"] = gate
    recipe_keys = recipe.model_dump(mode="json")
    _check_allow(allow_changes, settings, recipe_keys)
    main = rank == 0
    history = settings["history"] = _history(out)
    _check_settings(out, settings, allow_changes, main)
    _barrier(world)
    lambdas = (recipe.train.lambda_desirable, recipe.train.lambda_undesirable)
    # a round's training continues through the keys let through that are recipe keys (online.json's own are checked above)
    allow_round = tuple(ROUND_PATHS) + tuple(a for a in allow_changes if a == "all" or _is_key(a, recipe_keys))
    held_args = dict(rule=rule, n=heldout_n, temperature=temperature, answer_column=answer_column, heldout=heldout,
                     limit=heldout_limit)
    initial = heldout_eval(recipe, base, out / "heldout-initial", **held_args)
    if keep == "guard" and initial is None and main:
        console.warn("online: --keep guard has no held-out prompts to check the rounds by: every round is kept "
                     "(set data.test, or --heldout FILE)")
    policy, table, rolled_back = base, [], None
    for r in range(rounds):
        rd = out / f"round-{r}"
        rec = recipe.model_copy(deep=True)
        summary, greedy_rows = _label_round(rec, rd, r, policy, world, main, rule=rule, n=n, prompts=prompts,
                                            limit=limit, temperature=temperature, answer_column=answer_column,
                                            greedy=greedy)
        train_rows, counts = _train_rows(rd, r, keep_uniform, lambdas, greedy_rows, world, main)
        _round_recipe(rec, recipe, rd, r, policy, base, reference, train_rows)
        pipeline.reference(rec)
        let_through = _let_through(rd, rec, history.get(str(r), {}))
        final = pipeline.trained_model(rec, allow_changes=allow_round + tuple(let_through))
        changed = _changed(rd, rec)
        if changed:
            # what this round's training was continued (or reused) under, so that a rerun with the same settings
            # continues without repeating --allow-change
            history[str(r)] = changed
            if main:
                atomic_write_json(out / RECORD, settings)
        held = heldout_eval(recipe, final, rd / "heldout", **held_args)
        table.append(_round_row(r, policy, summary, counts, held, final))
        fell = _fell(table[-2]["heldout"] if r else initial, held)
        if keep == "guard" and fell:
            table[-1]["rolled_back"] = True
            rolled_back = r
            if main:
                console.warn(f"online: round {r}: held-out greedy share {fell}: rolled back to {policy}, which stays "
                             f"the final model, and the loop stops here (--keep last keeps every round); "
                             f"{smaller_step(recipe.train)}")
            break
        policy = str(final)
    best = None
    if keep == "best":
        best = max(range(len(table)), key=lambda i: (table[i]["heldout"]["greedy"]["share"],
                                                     table[i]["heldout"]["sampled"]["share"], -i))
        policy = table[best]["model"]
        console.info(f"online: --keep best: round {best} (held-out greedy "
                     f"{100 * table[best]['heldout']['greedy']['share']:.1f}%) is the final model")
    if main:
        atomic_write_json(out / ROUNDS, {"rounds": table, "initial_heldout": initial, "keep": keep, "best_round": best,
                                         "rolled_back_round": rolled_back, "final_model": policy})
        _plot(out, table, initial)
    _barrier(world)
    return table


def _history(out: Path) -> dict:
    """online.json's ``history``: per round, the recipe keys (with their values) in which the settings it was last
    continued or reused with differ from its training record, each let through once by --allow-change."""
    path = out / RECORD
    try:
        old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (ValueError, UnicodeDecodeError):
        return {}  # _check_settings refuses the damaged record by name
    got = old.get("history") if isinstance(old, dict) else None
    return got if isinstance(got, dict) else {}


def _changed(rd: Path, rec) -> dict:
    """The keys (and the values asked for now) in which ``rec`` differs from the training record of round folder
    ``rd``, apart from the round's own paths (online sets those); empty without a record."""
    old = recorded_recipe(rd, "train")
    if old is None:
        return {}
    return {k: b for k, _, b in differing(old, rec.model_dump(mode="json"), TRAIN_NEUTRAL) if k not in ROUND_PATHS}


def _let_through(rd: Path, rec, earlier: dict) -> list[str]:
    """The keys a rerun need not let through again for round folder ``rd``: those whose value now is the one an
    earlier --allow-change let through for this round (``earlier``, from online.json's history)."""
    return [k for k, v in _changed(rd, rec).items() if k in earlier and earlier[k] == v]


def smaller_step(train) -> str:
    """What to change when a round is rolled back, naming the keys: every fall measured on the toy task
    (docs/online.md) came from a round's update being too large, and a quarter of the offline lr, one epoch per
    round, held over 5 rounds at 3 seeds."""
    fix = f"--set train.lr={train.lr / 4:.3g} (now {train.lr:g})"
    if train.max_steps is not None:  # a fixed step count trains many epochs of a small round
        fix += f" and --set train.max_steps=null for one epoch of each round's rows (now {train.max_steps} steps)"
    return f"for rounds, a smaller step per round is the measured fix (docs/online.md), in a new run folder: {fix}"


def _fell(before: Optional[dict], after: Optional[dict]) -> Optional[str]:
    """How the held-out greedy share fell below the 90% interval of the model before (a sentence), or None when it
    did not (or there is nothing to compare)."""
    if not before or not after:
        return None
    b, a = before["greedy"], after["greedy"]
    if a["share"] >= b["ci90"][0]:
        return None
    return (f"{100 * a['share']:.1f}% fell below the previous model's {100 * b['share']:.1f}% "
            f"[{100 * b['ci90'][0]:.1f}, {100 * b['ci90'][1]:.1f}]")


def _run_settings(recipe, *, rule, n, limit, prompts, source, reference, keep_uniform, answer_column, temperature,
                  heldout, heldout_limit, heldout_n, greedy, rounds, keep) -> dict:
    """What defines the run (``online.json``): the generate section as far as the backend uses it."""
    return {
        "model": recipe.model.name_or_path, "rule": rule, "n": n, "limit": limit, "prompts_source": str(source),
        "prompts_fingerprint": prompt_fingerprint(str(source), None if prompts else "train", limit),
        "reference": reference, "keep_uniform": keep_uniform, "answer_column": answer_column,
        "temperature": label_settings(recipe, temperature)[0].temperature,
        "heldout_source": str(heldout or recipe.data.test) if (heldout or recipe.data.test) else None,
        "heldout_fingerprint": (prompt_fingerprint(str(heldout), None, heldout_limit) if heldout else
                                prompt_fingerprint(str(recipe.data.test), "test", heldout_limit) if recipe.data.test else None),
        "heldout_n": heldout_n, "greedy": greedy,
        "seeds": {"generate": recipe.generate.seed, "reference": recipe.reference.seed, "data": recipe.data.seed,
                  "train": recipe.train.seed},
        "train": recipe.train.model_dump(mode="json"), "generate": run_record(recipe.generate),
        "rounds": rounds, "keep": keep,
        # how the verifier reads and where its unsure samples go (a record without them is not compared on them)
        "verifier_settings": verifier_settings(rule, recipe), "unsure_judge": recipe.online.unsure_judge,
    }


def _label_round(rec, rd: Path, r: int, policy, world: int, main: bool, *, rule, n, prompts, limit, temperature,
                 answer_column, greedy: bool) -> tuple[dict, Optional[Path]]:
    """The round's labelled samples of ``policy`` (reused when done) and, with ``greedy``, its labelled greedy
    decodes' rows file."""
    if _agreed((rd / SUMMARY).exists(), world):  # rank 0's view: every rank takes the same path
        if main:
            console.info(f"online: round {r}: reusing its labelled samples")
        summary = json.loads((rd / SUMMARY).read_text(encoding="utf-8"))
    else:
        summary = label(rec, rd, rule=rule, n=n, prompts=prompts, model=policy, limit=limit, temperature=temperature,
                        answer_column=answer_column, round_=r)
    if not greedy:
        return summary, None
    # the recipe's own decoding (as generate, the demo's judging and the held-out greedy share decode),
    # which sampling in fast mode at temperature 1 never shows the loop
    gd = rd / "greedy"
    if not _agreed((gd / SUMMARY).exists(), world):
        label(rec, gd, rule=rule, n=1, prompts=prompts, model=policy, limit=limit, temperature=0.0,
              answer_column=answer_column, round_=r, fast=False)
    return summary, gd / ROWS


def _train_rows(rd: Path, r: int, keep_uniform: bool, lambdas, greedy_rows, world: int, main: bool):
    """The round's training rows and class weights (written by rank 0, read by every rank)."""
    if world > 1:
        train_rows, counts = from_rank0(lambda: _round_rows(rd / ROWS, keep_uniform, rd, lambdas, greedy_rows)
                                        if main else None)
    else:
        train_rows, counts = _round_rows(rd / ROWS, keep_uniform, rd, lambdas, greedy_rows)
    if lambdas != (1.0, 1.0):
        console.info(f"online: round {r}: class weights lambda_D {counts['lambda_desirable']:g}, lambda_U "
                     f"{counts['lambda_undesirable']:g} (balanced {counts['balance_desirable']:g} / "
                     f"{counts['balance_undesirable']:g} times the recipe's {lambdas[0]:g} / {lambdas[1]:g})")
    return train_rows, counts


def _round_recipe(rec, recipe, rd: Path, r: int, policy, base, reference: str, train_rows: Path) -> None:
    """``rec`` made the round's recipe: its folder, policy, reference, seeds and rows (:data:`SET_BY_ONLINE`)."""
    rec.output_dir = str(rd)
    rec.model.name_or_path = policy
    rec.reference.model = base if (reference == "initial" or r == 0) else policy
    rec.reference.cache = None
    rec.reference.seed = round_seed(recipe.reference.seed, r)
    rec.data.seed = round_seed(recipe.data.seed, r)
    rec.train.seed = round_seed(recipe.train.seed, r)
    rec.data.train, rec.data.format, rec.data.label = str(train_rows), "unpaired", None
    rec.data.weights_file = str(rd / "weights.json")
    rec.data.limit = None


def _round_row(r: int, policy, summary: dict, counts: dict, held, final: Path) -> dict:
    """The round's line of the table (rounds.json), with the model the backend served for its samples."""
    metrics = json.loads((final / "training_summary.json").read_text(encoding="utf-8")).get("last_metrics") or {}
    return {"round": r, "policy": str(policy), "rows": summary["rows"], "desirable_share": summary["desirable_share"],
            # a folder labelled before verdicts could be unsure has none
            "unsure": summary.get("unsure", 0), "unsure_share": summary.get("unsure_share", 0.0),
            "prompts_all_desirable": summary["prompts_all_desirable"],
            "prompts_all_undesirable": summary["prompts_all_undesirable"], **counts,
            "reasons": summary.get("reasons"), "heldout": held,
            "reward_desirable": metrics.get("reward_desirable"), "reward_undesirable": metrics.get("reward_undesirable"),
            "model": str(final), "served": summary.get("served")}


def _process_group() -> tuple[int, int]:
    """(rank, world size) of a torchrun / accelerate launch, its process group opened (as `generate` opens it);
    (0, 1) in one process. Sampling is dealt across the ranks; rank 0 alone writes."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return 0, 1

    state = PartialState(cpu=not torch.cuda.is_available())
    return state.process_index, state.num_processes


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _agreed(value, world: int):
    """Rank 0's ``value`` on every rank."""
    if world < 2:
        return value

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _plot(out: Path, table: list[dict], initial: Optional[dict] = None) -> None:
    """rounds.png: the desirable share of each round's samples (the policy entering it), and the held-out
    shares, greedy and sampled, of the model each round trained (x = round + 1; the initial model at 0)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot([t["round"] for t in table], [100 * t["desirable_share"] for t in table], marker="o", label="round's samples (policy entering it)")
    held = [(t["round"] + 1, t["heldout"]) for t in table if t.get("heldout")]
    if initial:
        held = [(0, initial)] + held
    for kind, mark in (("greedy", "s"), ("sampled", "^")):
        if held:
            xs = [x for x, _ in held]
            ys = [100 * h[kind]["share"] for _, h in held]
            lo = [100 * (h[kind]["share"] - h[kind]["ci90"][0]) for _, h in held]
            hi = [100 * (h[kind]["ci90"][1] - h[kind]["share"]) for _, h in held]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker=mark, capsize=3, label=f"held-out {kind} (after round x-1)")
    ax.set_xlabel("round")
    ax.set_ylabel("desirable (%)")
    ax.set_title("Online ELBO-KTO: the verifier's verdict per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / "rounds.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def markdown_table(table: list[dict]) -> str:
    """The per-round table: the round's samples (and greedy decodes, when labelled) and weights, then the held-out
    shares of the model it trained."""
    head = ("| round | samples | desirable % | unsure % | greedy desirable % | all-good prompts | all-bad prompts | lambda_D "
            "| lambda_U | reward D | reward U | not desirable, by reason | held-out greedy % [90% CI] | held-out sampled % [90% CI] |")
    lines = [head, "|" + "---|" * 14]

    def f(v):
        return "-" if v is None else f"{v:+.3f}"

    def h(t, kind):
        x = (t.get("heldout") or {}).get(kind)
        back = " **rolled back**" if kind == "greedy" and t.get("rolled_back") else ""
        return "-" if not x else f"{100 * x['share']:.1f} [{100 * x['ci90'][0]:.1f}, {100 * x['ci90'][1]:.1f}]{back}"

    def why(t):
        reasons = {k: v for k, v in (t.get("reasons") or {}).items() if k != "correct" and v}
        return ", ".join(f"{k} {v}" for k, v in reasons.items()) or "-"

    for t in table:
        g = t.get("greedy_desirable_share")
        gs = "-" if g is None else f"{100 * g:.1f}"
        lines.append(f"| {t['round']} | {t['rows']} | {100 * t['desirable_share']:.1f} | {100 * t.get('unsure_share', 0.0):.1f} | {gs} | "
                     f"{t['prompts_all_desirable']} | "
                     f"{t['prompts_all_undesirable']} | {t['lambda_desirable']:.2f} | {t['lambda_undesirable']:.2f} | "
                     f"{f(t['reward_desirable'])} | {f(t['reward_undesirable'])} | {why(t)} | {h(t, 'greedy')} | {h(t, 'sampled')} |")
    return "\n".join(lines)
