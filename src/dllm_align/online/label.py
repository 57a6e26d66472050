"""`dllm-align label`: sample the policy's own completions and label each one with a verifier.

For every prompt (a prompts file, or the prompts of the recipe's data), ``n`` completions are sampled
from the recipe's model (or ``--model``) with the recipe's sampler, in fast mode by default and at a
temperature that gives different samples (1.0 unless ``generate.temperature`` is set above 0); each
completion is labelled by a verifier (:mod:`dllm_align.online.verifiers`). The output is unpaired rows,
``prompt``, ``completion``, ``label``, plus their provenance (``round``, ``model``, ``sampler``,
``labeller``, ``verdict``, ``prompt_id``), which ``precompute-ref`` and ``train`` read as they are; and a
summary (rows, desirable share, prompts whose samples are all good or all bad).

Everything is checked before the first sample (the rule, and the columns it needs in the prompts file);
the rows and the summary are written atomically at the end, so a failure leaves nothing half-written.
Samples are a pure function of (seed, prompt id, sample index): a rerun gives the same rows.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dllm_align.core.errors import UserError

ROWS = "labelled.jsonl"
SUMMARY = "label_summary.json"


@dataclass
class Prompt:
    id: str
    messages: list
    row: dict  # the source row's columns (reference answers live here)
    where: str


def _prompts_with_rows(source: str, split: Optional[str], limit: Optional[int]) -> list[Prompt]:
    """Prompts of a file with their source rows, so that a verifier can read columns such as ``answer``."""
    from dllm_align.data.layouts import _messages
    from dllm_align.data.read import read_tables
    from dllm_align.data.rows import content_hash

    out: list[Prompt] = []
    for t in read_tables(source, split, allow_txt=True):
        for rec in t.records:
            if rec.problem:
                raise UserError(f"{rec.where}: {rec.problem}")
            d = rec.data or {}
            if "prompt" in d:
                raw = d["prompt"]
            elif "question" in d:  # GSM8K's column name
                raw = d["question"]
            else:
                raise UserError(f"{rec.where}: no prompt (or question) column")
            msgs, _ = _messages(raw, "prompt", t.textual)
            pid = str(d.get("prompt_id") or d.get("id") or content_hash({"prompt": msgs}))
            out.append(Prompt(pid, msgs, dict(d), rec.where))
            if limit and len(out) >= limit:
                return out
    return out


def prompt_fingerprint(source: str, split: Optional[str], limit: Optional[int]) -> str:
    """A hash of the prompts' content (ids, messages and source rows), whatever file or built-in holds them:
    what a resumed online run must still be labelling."""
    from dllm_align.data.rows import content_hash

    return content_hash([[p.id, p.messages, p.row] for p in _prompts_with_rows(source, split, limit)], n=32)


def _verdict(verifier, judge, p: "Prompt", completion: str, j: int):
    """One sample's label: the verifier's True/False; None when an absolute judge could not decide."""
    from dllm_align.core.errors import RunFailure
    from dllm_align.judge.client import FatalApiError, JudgementFailed
    from dllm_align.online.verifiers import apply

    where = f"{p.where} (prompt {p.id!r}, sample {j})"
    if judge is None:
        return apply(verifier, _prompt_text(p.messages), completion, p.row, where)
    try:
        return judge(_prompt_text(p.messages), completion, p.row)
    except FatalApiError as e:
        raise (UserError(str(e)) if e.user_error else RunFailure(str(e))) from None
    except JudgementFailed as e:
        raise RunFailure(f"judging {where} failed: {e}", hint="run the same command again: cached verdicts are kept") from None


def _reason_counts(rule: str, reasons: Counter) -> dict[str, int]:
    """The verdicts per reason; for math_answer every reason is listed, zeros included, so that the summaries
    of different rounds have the same keys."""
    if rule == "math_answer":
        from dllm_align.online.math_answer import reason_counts

        return reason_counts(reasons.elements())
    if rule == "sort":
        from dllm_align.online.verifiers import SORT_REASONS

        return {k: reasons.get(k, 0) for k in SORT_REASONS}
    return dict(sorted(reasons.items()))


def _labels(verifier, judge, items: list, flat: list, texts: list[str], section) -> list:
    """Every sample's label, in order: the verifier's, or the absolute judge's (live, or through the Batch API
    when ``judge.batch`` is set, as ``judge`` does)."""
    if judge is not None and section.batch:
        from dllm_align.core.errors import RunFailure
        from dllm_align.judge.client import FatalApiError, JudgementFailed

        try:
            return judge.batch([(_prompt_text(items[i].messages), t) for (i, _), t in zip(flat, texts)])
        except FatalApiError as e:
            raise (UserError(str(e)) if e.user_error else RunFailure(str(e))) from None
        except JudgementFailed as e:
            raise RunFailure(f"the batch could not go on: {e}",
                             hint="run the same command again: it continues the batch from the stage it reached") from None
    return [_verdict(verifier, judge, items[i], t, j) for (i, j), t in zip(flat, texts)]


def _prompt_text(messages: list) -> str:
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return users[-1] if users else (messages[-1].get("content", "") if messages else "")


def _settings(recipe, temperature: Optional[float], fast: bool = True):
    from dllm_align.config.schema import FAST_CACHE, FAST_THRESHOLD
    from dllm_align.generate.settings import SamplerSettings

    s = SamplerSettings.from_section(recipe.generate)
    upd = {}
    if temperature is not None:
        upd["temperature"] = temperature
    elif s.temperature == 0:
        upd["temperature"] = 1.0  # greedy samples of one prompt would all be the same completion
    if fast and s.cache == "none" and s.threshold is None:
        upd.update(cache=FAST_CACHE, threshold=FAST_THRESHOLD)
    return s.replace(**upd)


def label(recipe, out_dir: str | Path, *, rule: str, n: int, prompts: Optional[str] = None, split: str = "train",
          model: Optional[str] = None, limit: Optional[int] = None, temperature: Optional[float] = None,
          answer_column: str = "answer", round_: int = 0, device=None, fast: bool = True) -> dict:
    """Sample ``n`` completions per prompt and label them; returns the summary (module docstring). ``fast``
    False keeps the recipe's decoding as it is (as ``generate`` decodes), instead of fast mode."""
    import torch

    from dllm_align.core.console import info
    from dllm_align.core.io import check_not_input
    from dllm_align.generate.backend import backend_factory, make_generator
    from dllm_align.generate.settings import encode_prompt, row_seed
    from dllm_align.online.verifiers import get_rule

    if n < 1:
        raise UserError(f"--n {n}: at least one sample per prompt")
    if temperature == 0 and n > 1:
        raise UserError(f"--temperature 0 with --n {n}: greedy decoding gives the same completion {n} times per prompt",
                        hint="sample at a temperature above 0, or use --n 1")
    backend_factory(recipe.generate.backend)  # an unknown backend is refused before anything is read or written
    judge = None
    if rule.startswith("judge:"):
        if not rule[len("judge:"):]:
            raise UserError("--rule judge:MODEL: name the judge model, e.g. judge:gpt-4o-mini")
        from dllm_align.online.verifiers import Rule

        verifier = Rule(rule, lambda p, c, r: True)  # replaced by the judge once the checks pass
    else:
        verifier = get_rule(rule, answer_column=answer_column)
    source = prompts or recipe.data.train
    if source is None:
        raise UserError("no prompts: pass --prompts FILE, or set data.train in the recipe")
    items = _prompts_with_rows(str(source), None if prompts else split, limit)
    if not items:
        raise UserError(f"{source}: no prompts")
    for col in verifier.needs:
        missing = next((p for p in items if col not in p.row), None)
        if missing is not None:
            raise UserError(f"{missing.where}: no {col!r} column, which --rule {verifier.name} compares against",
                            hint="add the reference answers, or name their column with --answer-column")
    out = Path(out_dir)
    rows_path, summary_path = out / ROWS, out / SUMMARY
    for p in (rows_path, summary_path):
        check_not_input(p)
    rank, world = _ranks()
    if rule.startswith("judge:") and rank == 0:  # the judge (and its cache in the run folder) lives on rank 0
        from dllm_align.online.absolute import AbsoluteJudge
        from dllm_align.online.verifiers import Rule

        out.mkdir(parents=True, exist_ok=True)
        judge = AbsoluteJudge(rule[len("judge:"):], recipe.judge, out)
        verifier = Rule(rule, judge)
    settings = _settings(recipe, temperature, fast)
    dev = device or (f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    name = recipe.model.name_or_path if model is None else model
    gen = make_generator(recipe.generate.backend, recipe.model, device=dev, name_or_path=name)
    ids = [encode_prompt(gen.tokenizer, p.messages) for p in items]
    flat = [(i, j) for i in range(len(items)) for j in range(n)]
    # Round 0 keeps the seeds of `label` itself; later rounds draw new ones, so that a policy that did not
    # change is not asked the very same random questions again.
    seeds = [row_seed(settings.seed, f"{items[i].id}:{j}" if round_ == 0 else f"round{round_}:{items[i].id}:{j}") for i, j in flat]
    if rank == 0:
        info(f"label: {len(items)} prompts x {n} samples from {name} (temperature {settings.temperature}, "
             f"cache {settings.cache}, threshold {settings.threshold}), rule {verifier.name}"
             + (f"; sampling dealt across {world} processes" if world > 1 else ""))
    comps = _sample(gen, [ids[i] for i, _ in flat], settings, seeds, recipe.generate.batch_size, rank, world)
    if world > 1:
        # rank 0 labels and writes; the others take its outcome (the same error on every rank)
        return from_rank0(lambda: _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_,
                                                    rows_path, summary_path, recipe.judge) if rank == 0 else None)
    return _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_, rows_path, summary_path,
                            recipe.judge)


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the process group a multi-process launch opened; (0, 1) alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sample(gen, prompts: list, settings, seeds: list, batch_size: int, rank: int, world: int) -> list:
    """Every sample's completion, the length-grouped batches dealt across the processes (batch j to rank
    j mod world, as ``generate`` deals them) and gathered: the same batches, hence the same samples, as one
    process draws."""
    from dllm_align.core.console import progress
    from dllm_align.generate.settings import length_batches

    batches = length_batches([len(p) for p in prompts], batch_size)
    mine = [b for j, b in enumerate(batches) if j % world == rank]
    got: list = []
    with progress("sampling", sum(len(b) for b in mine), unit="samples") as bar:
        for b in mine:
            res = gen.generate([prompts[i] for i in b], settings, [seeds[i] for i in b], batch_size=len(b))
            got += list(zip(b, res))
            bar.advance(len(b))
    if world > 1:
        import torch.distributed as dist

        parts: list = [None] * world
        dist.all_gather_object(parts, got)
        got = [x for part in parts for x in part]
    comps: list = [None] * len(prompts)
    for i, c in got:
        comps[i] = c
    return comps


def from_rank0(fn):
    """``fn()`` run on rank 0 (the other ranks pass a function returning None), its result given to every
    rank, or its error raised on every rank: no rank waits for a rank 0 that has stopped."""
    import torch.distributed as dist

    from dllm_align.core.errors import DllmAlignError, RunFailure

    box: list = [None]
    err = None
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except DllmAlignError as e:
            box, err = [("error", e.exit_code, e.message, e.hint)], e
        except Exception as e:  # noqa: BLE001 - said to the other ranks, then raised here as it is
            box, err = [("error", 1, f"rank 0 stopped: {type(e).__name__}: {e}", None)], e
    dist.broadcast_object_list(box, src=0)
    if err is not None:
        raise err
    if box[0][0] == "error":
        _, code, message, hint = box[0]
        raise (UserError if code == 2 else RunFailure)(message, hint=hint)
    return box[0][1]


def _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_, rows_path, summary_path,
                     judge_section) -> dict:
    from dllm_align.core.io import atomic_write_json, atomic_write_text

    sampler = {k: v for k, v in settings.to_dict().items()}
    rows = []
    try:
        labels = _labels(verifier, judge, items, flat, [c.text for c in comps], judge_section)
    finally:
        if judge is not None:
            judge.close()
    reasons: Counter = Counter()
    for ((i, j), c), ok in zip(zip(flat, comps), labels):
        p = items[i]
        if ok is None:  # an absolute judge that gave no verdict even when asked for it alone
            continue
        row = {"id": f"{p.id}:s{j}", "prompt_id": p.id, "prompt": p.messages, "completion": c.text, "label": ok,
               "round": round_, "model": name, "sampler": sampler, "labeller": verifier.name,
               "verdict": "desirable" if ok else "undesirable"}
        why = verifier.explain(_prompt_text(p.messages), c.text, p.row) if judge is None else None
        if why is not None:
            row["reason"] = why
            reasons[why] += 1
        rows.append(row)
    per_prompt = Counter()
    good = Counter()
    for r in rows:
        per_prompt[r["prompt_id"]] += 1
        good[r["prompt_id"]] += r["label"]
    n_good = sum(r["label"] for r in rows)
    if judge is not None and judge.unjudgeable:  # said before the error below, which refers to it
        from dllm_align.core.console import warn

        warn(f"label: {judge.unjudgeable} sample(s) got no [[YES]]/[[NO]] verdict even when asked for it alone: left out")
    if not rows:
        raise UserError("no sample got a verdict: nothing to write", hint="see the warning above")
    summary = {
        "rows": len(rows), "prompts": len(items), "samples_per_prompt": n, "desirable": n_good,
        "undesirable": len(rows) - n_good, "desirable_share": n_good / len(rows),
        "prompts_all_desirable": sum(1 for k in per_prompt if good[k] == per_prompt[k]),
        "prompts_all_undesirable": sum(1 for k in per_prompt if good[k] == 0),
        "model": name, "labeller": verifier.name, "round": round_, "sampler": sampler, "rows_file": ROWS,
        "unjudgeable": judge.unjudgeable if judge is not None else 0,
        "reasons": _reason_counts(verifier.name, reasons) if reasons else None,
    }
    atomic_write_text(rows_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_json(summary_path, summary)
    return summary
