"""`dllm-align label`: sample the policy's own completions and label each one with a verifier.

For every prompt (a prompts file, or the prompts of the recipe's data), ``n`` completions are sampled
from the recipe's model (or ``--model``) with the recipe's sampler, in fast mode by default and at a
temperature that gives different samples (1.0 unless ``generate.temperature`` is set above 0); each
completion is labelled by a verifier (:mod:`dllm_align.online.verifiers`). The output is unpaired rows,
``prompt``, ``completion``, ``label``, plus their provenance (``round``, ``model``, ``sampler``,
``labeller``, ``verdict``, ``prompt_id``; the fast mode's cache and threshold only in the summary), which ``precompute-ref`` and ``train`` read as they are; and a
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

import torch
import torch.distributed as dist

from dllm_align.config.schema import FAST_CACHE, FAST_THRESHOLD
from dllm_align.core.console import info, progress, warn
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.core.io import atomic_write_json, atomic_write_text, check_not_input
from dllm_align.core.runfolder import differing, from_rank0, refuse_changes, run_folder
from dllm_align.data.layouts import as_messages
from dllm_align.data.read import read_tables
from dllm_align.data.rows import BadValue, content_hash
from dllm_align.generate.backend import backend_component, make_generator, recorded_settings
from dllm_align.generate.rules import rule_fast_cache
from dllm_align.generate.settings import SamplerSettings, encode_prompt, length_batches, row_seed, unused_by_rule
from dllm_align.judge.client import FatalApiError, JudgementFailed
from dllm_align.online.verifiers import Outcome, Rule, apply, get_rule
from dllm_align.online.verifiers import recorded_settings as recorded_settings_of

ROWS = "labelled.jsonl"
SUMMARY = "label_summary.json"
UNSURE = "unsure.jsonl"  # the rows the verifier was unsure of: counted, kept for a look, never trained on
# Decoding keys that are the same for every sample of a run (the fast mode's): recorded once, in the summary.
PER_RUN_KEYS = frozenset({"cache", "threshold"})


@dataclass
class Prompt:
    id: str
    messages: list
    row: dict  # the source row's columns (reference answers live here)
    where: str


# A prompt this long is no prompt a diffusion model of these families can take (their contexts are at most a
# few tens of thousands of tokens); refused before it is tokenized, which alone would take minutes.
MAX_PROMPT_CHARS = 200_000


def _prompt_id(d: dict, msgs: list, where: str) -> str:
    for col in ("prompt_id", "id"):
        v = d.get(col)
        if v is None or v == "":
            continue
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise UserError(f"{where}: {col} must be a string or a whole number, got {type(v).__name__}")
        return str(v)
    return content_hash({"prompt": msgs})


def read_prompts(source: str, split: Optional[str], limit: Optional[int], verifier=None) -> list[Prompt]:
    """Prompts of a file with their source rows, so that a verifier can read columns such as ``answer``; each
    prompt, its id and the columns the verifier reads checked here, naming the file and line."""
    out: list[Prompt] = []
    seen: dict[str, str] = {}
    for t in read_tables(source, split, allow_txt=True):
        for rec in t.records:
            if rec.problem:
                raise UserError(f"{rec.where}: {rec.problem}")
            d = rec.data or {}
            col = "prompt" if "prompt" in d else "question" if "question" in d else None  # question: GSM8K's name
            if col is None:
                raise UserError(f"{rec.where}: no prompt (or question) column")
            raw = d[col]
            if isinstance(raw, str) and len(raw) > MAX_PROMPT_CHARS:
                raise UserError(f"{rec.where}: the {col} has {len(raw):,} characters; at most {MAX_PROMPT_CHARS:,} are read",
                                hint="shorten it: no model of these families has room for it")
            try:
                msgs, _ = as_messages(raw, col, t.textual)
            except BadValue as e:
                raise UserError(f"{rec.where}: {e}") from None
            if sum(len(str(m.get("content", ""))) for m in msgs) > MAX_PROMPT_CHARS:
                raise UserError(f"{rec.where}: the {col} is longer than {MAX_PROMPT_CHARS:,} characters")
            pid = _prompt_id(d, msgs, rec.where)
            if pid in seen:
                raise UserError(f"{rec.where}: prompt id {pid!r} repeats the one at {seen[pid]}",
                                hint="give each prompt its own id (samples and their seeds are named after it)")
            seen[pid] = rec.where
            if verifier is not None:
                for need in verifier.needs:
                    if need not in d:
                        raise UserError(f"{rec.where}: no {need!r} column, which --rule {verifier.name} compares against",
                                        hint="add the reference answers, or name their column with --answer-column")
                if verifier.check_row is not None:
                    problem = verifier.check_row(d)
                    if problem:
                        raise UserError(f"{rec.where}: {problem}")
            out.append(Prompt(pid, msgs, dict(d), rec.where))
            if limit and len(out) >= limit:
                return out
    return out


def with_instruction(p: Prompt, instruction: str) -> Prompt:
    """``p`` with ``instruction`` appended to its last user message (its id and source row unchanged): how a
    verifier's answer format is stated in the prompt."""
    msgs = [dict(m) for m in p.messages]
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if not users:
        return p
    last = msgs[users[-1]]
    last["content"] = f"{last['content'].rstrip()}\n\n{instruction}"
    return Prompt(p.id, msgs, p.row, p.where)


def prompt_fingerprint(source: str, split: Optional[str], limit: Optional[int]) -> str:
    """A hash of the prompts' content (ids, messages and source rows), whatever file or built-in holds them:
    what a resumed online run must still be labelling."""
    return content_hash([[p.id, p.messages, p.row] for p in read_prompts(source, split, limit)], n=32)


def _verdict(verifier, judge, p: "Prompt", completion: str, j: int):
    """One sample's :class:`~dllm_align.online.verifiers.Outcome` (an absolute judge that could not decide:
    unsure, reason ``unjudgeable``)."""
    where = f"{p.where} (prompt {p.id!r}, sample {j})"
    if judge is None:
        return apply(verifier, _prompt_text(p.messages), completion, p.row, where)
    try:
        return _judged(judge(_prompt_text(p.messages), completion, p.row))
    except FatalApiError as e:
        raise (UserError(str(e)) if e.user_error else RunFailure(str(e))) from None
    except JudgementFailed as e:
        raise RunFailure(f"judging {where} failed: {e}", hint="run the same command again: cached verdicts are kept") from None


def _judged(v):
    """An absolute judge's True / False / None as an outcome."""
    return Outcome("unsure", "unjudgeable") if v is None else Outcome("desirable" if v else "undesirable")


def _reason_counts(verifier, reasons: Counter) -> dict[str, int]:
    """The verdicts per reason; a verifier that lists its reasons (``Rule.reasons``) gets every one, zeros
    included, so that the summaries of different rounds have the same keys."""
    if verifier.reasons:
        return {k: reasons[k] for k in verifier.reasons}
    return dict(sorted(reasons.items()))


def _labels(verifier, judge, items: list, flat: list, texts: list[str], section) -> list:
    """Every sample's label, in order: the verifier's, or the absolute judge's (live, or through the Batch API
    when ``judge.batch`` is set, as ``judge`` does)."""
    if judge is not None and section.batch:
        try:
            return [_judged(v) for v in judge.batch([(_prompt_text(items[i].messages), t) for (i, _), t in zip(flat, texts)])]
        except FatalApiError as e:
            raise (UserError(str(e)) if e.user_error else RunFailure(str(e))) from None
        except JudgementFailed as e:
            raise RunFailure(f"the batch could not go on: {e}",
                             hint="run the same command again: it continues the batch from the stage it reached") from None
    return [_verdict(verifier, judge, items[i], t, j) for (i, j), t in zip(flat, texts)]


def _prompt_text(messages: list) -> str:
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return users[-1] if users else (messages[-1].get("content", "") if messages else "")


def label_settings(recipe, temperature: Optional[float], fast: bool = True):
    """The sampler settings of a labelling run, and whether the fast defaults were filled in (their cache is
    then chosen for the model's rule once it is known: :func:`_for_model`). ``fast`` False keeps the recipe's
    decoding as it is. Nothing is filled in that the recipe's named rule does not read (DiffusionGemma's rule
    reads no temperature and has no cache); a ``temperature`` the user gives it is refused by name."""
    s = SamplerSettings.from_section(recipe.generate)
    unread = unused_by_rule(s.sampler)
    if temperature is not None:
        _refuse_unread_temperature(s.sampler, temperature, unread)
    upd = {}
    if temperature is not None:
        upd["temperature"] = temperature
    elif s.temperature == 0 and "temperature" not in unread:
        upd["temperature"] = 1.0  # greedy samples of one prompt would all be the same completion
    filled = fast and s.cache == "none" and s.threshold is None and "cache" not in unread
    if filled:
        upd.update(cache=FAST_CACHE, threshold=FAST_THRESHOLD)
    return s.replace(**upd), filled


def _refuse_unread_temperature(rule: str, temperature: float, unread) -> None:
    if "temperature" in unread and temperature != 0:
        raise UserError(f"--temperature {temperature:g}: the {rule} rule samples with its own temperature schedule and "
                        "reads no temperature", hint="leave --temperature out: its samples differ by seed")


def _for_model(gen, settings, fast: bool, chosen_temperature: bool = True):
    """``settings`` as the model decodes them, refused by its rule's checks before anything is written. The
    fast cache filled in for the user is the rule's own: the block rule keeps finished blocks only (prefix); a
    rule with no cache (DiffusionGemma's) gets none. A rule with its own temperature schedule (DiffusionGemma's;
    its draws differ by seed at any temperature) takes none: the 1.0 filled in for sampling is dropped, one the
    user chose (``chosen_temperature``) refused by name."""
    rule = gen.settings_for(settings.replace(cache="none", threshold=None, temperature=0.0)).sampler
    unread = unused_by_rule(rule)
    if chosen_temperature:
        _refuse_unread_temperature(rule, settings.temperature, unread)
    if "temperature" in unread:
        settings = settings.replace(temperature=0.0)
    if fast and "cache" in unread:
        settings = settings.replace(cache="none", threshold=None)
    elif fast:
        # threshold only for a rule that reads it (LLaDA2.1's has thresholds of its own)
        settings = settings.replace(cache=rule_fast_cache(rule), threshold=None if "threshold" in unread else settings.threshold)
    return gen.settings_for(settings)


def check_temperature(temperature: Optional[float], n: int) -> None:
    """Greedy samples of one prompt are one completion n times: ``--temperature 0`` with ``--n`` above 1 is refused."""
    if temperature == 0 and n > 1:
        raise UserError(f"--temperature 0 with --n {n}: greedy decoding gives one completion {n} times, with nothing "
                        "to contrast", hint="sample at a temperature above 0 (1.0 by default), or --n 1")


def check_rule(rule: str, answer_column: str, recipe):
    """The verifier ``rule`` names, every check that needs no model done (a judge's key and URL included)."""
    return get_rule(rule, answer_column=answer_column, recipe=recipe)


def _refuse_relabel(summary_path: Path, settings: dict) -> None:
    """A folder labelled with other settings is not relabelled over: its rows would mix rules, models or samples."""
    if not summary_path.is_file():
        return
    try:
        old = json.loads(summary_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{summary_path}: not the JSON summary label writes", hint="remove the folder, or use another (-o)") from None
    if not isinstance(old, dict):
        raise UserError(f"{summary_path}: not the JSON summary label writes", hint="remove the folder, or use another (-o)")
    recorded = old.get("settings") if isinstance(old.get("settings"), dict) else {
        "--rule": old.get("labeller"), "--n": old.get("samples_per_prompt"), "--model": old.get("model")}
    refuse_changes(f"cannot relabel {summary_path.parent}", differing(recorded, settings),
                   hint="label into another run folder (-o), or with the settings it was labelled with")


def label(recipe, out_dir: str | Path, *, rule: str, n: int, prompts: Optional[str] = None, split: str = "train",
          model: Optional[str] = None, limit: Optional[int] = None, temperature: Optional[float] = None,
          answer_column: str = "answer", round_: int = 0, device=None, fast: bool = True) -> dict:
    """Sample ``n`` completions per prompt and label them; returns the summary (module docstring). ``fast``
    False keeps the recipe's decoding as it is (as ``generate`` decodes), instead of fast mode.

    Everything that can be refused is refused before the run folder is created: the rule (a user's function
    imported and its arity checked; a judge's key and URL), every prompt row, a folder labelled with other
    settings, the model and its decoding rule, each prompt's length against the model's positions. The
    folder is then locked (:class:`dllm_align.core.io.DirLock`, by rank 0 when several processes sample)
    while samples are drawn and labelled."""
    if n < 1:
        raise UserError(f"--n {n}: at least one sample per prompt")
    check_temperature(temperature, n)
    backend_component(recipe.generate.backend)  # an unknown backend is refused before anything is read or written
    verifier = check_rule(rule, answer_column, recipe)
    source = prompts or recipe.data.train
    if source is None:
        raise UserError("no prompts: pass --prompts FILE, or set data.train in the recipe")
    items = read_prompts(str(source), None if prompts else split, limit, verifier)
    if not items:
        raise UserError(f"{source}: no prompts")
    if verifier.instruction:
        items = [with_instruction(p, verifier.instruction) for p in items]
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: a file, not a folder", hint="name a folder for the labelled rows")
    rows_path, summary_path = out / ROWS, out / SUMMARY
    for p in (rows_path, summary_path, out / UNSURE):
        check_not_input(p)
    rank, world = _ranks()
    settings, filled = label_settings(recipe, temperature, fast)
    name = recipe.model.name_or_path if model is None else model
    record = {"--rule": rule, "--n": n, "--model": str(name), "--prompts": str(source), "--limit": limit,
              "--answer-column": answer_column, "generate": recorded_settings(settings)}
    if verifier.instruction:  # recorded only where there is one: folders labelled without one keep their record
        record["instruction"] = verifier.instruction
    own = recorded_settings_of(rule, recipe)
    if own is not None:  # how the verifier reads (math_answer's format): relabelling with another is refused
        record["verifier_settings"] = own
    second = _unsure_judge(recipe, rule)
    if second is not None:
        record["unsure_judge"] = second.name
    _refuse_relabel(summary_path, record)
    dev = device or (f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    gen = make_generator(recipe.generate, recipe.model, device=dev, name_or_path=name)
    settings = _for_model(gen, settings, filled, temperature is not None or recipe.generate.temperature != 0)
    ids = [encode_prompt(gen.tokenizer, p.messages) for p in items]
    max_pos = gen.max_positions
    for p, x in zip(items, ids):
        if max_pos and len(x) + settings.gen_length > max_pos:
            # Beyond its positions a model gives garbage, slowly: said before the first sample.
            raise UserError(f"{p.where}: the prompt is {len(x):,} tokens; with generate.gen_length {settings.gen_length} "
                            f"that is beyond the model's {max_pos:,} positions",
                            hint="shorten it or leave it out, or lower generate.gen_length")
    flat = [(i, j) for i in range(len(items)) for j in range(n)]
    # Round 0 keeps the seeds of `label` itself; later rounds draw new ones, so that a policy that did not
    # change is not asked the very same random questions again.
    seeds = [row_seed(settings.seed, f"{items[i].id}:{j}" if round_ == 0 else f"round{round_}:{items[i].id}:{j}") for i, j in flat]
    # A run that stopped before writing leaves no empty folder of its own making (a judge's verdict cache is kept:
    # the rerun reuses it).
    with run_folder(out, f"{out}: another command is writing this folder; wait for it, or label into another (-o)",
                    rank=rank, world=world):
        return _label_locked(recipe, out, gen, items, ids, flat, seeds, settings, verifier, rule, name, n, round_,
                             record, rank, world, second)


def _unsure_judge(recipe, rule: str):
    """The judge verifier ``online.unsure_judge`` names (its key and URL checked now), or None: unset, or the rule is
    itself a judge."""
    online = getattr(recipe, "online", None)
    model = online.unsure_judge if online is not None else None
    if model is None or rule.startswith("judge:"):
        return None
    return get_rule(f"judge:{model}", recipe=recipe)


def _label_locked(recipe, out: Path, gen, items, ids, flat, seeds, settings, verifier, rule, name, n, round_, record,
                  rank: int, world: int, second=None) -> dict:
    """Sampling, labelling and writing, with the folder locked (on rank 0) and every check passed. ``second``: the
    judge verifier the unsure samples go to (None: none)."""
    rows_path, summary_path = out / ROWS, out / SUMMARY
    judge = None
    if verifier.bind is not None and rank == 0:  # a verifier bound to the run folder (a judge's cache) lives on rank 0
        judge = verifier.bind(out)
        verifier = Rule(rule, judge)
    second = second.bind(out) if second is not None and rank == 0 else None
    if rank == 0:
        fast = (f", cache {settings.cache}, threshold {settings.threshold}"
                if PER_RUN_KEYS <= set(recorded_settings(settings)) else "")  # said only where the backend uses them
        info(f"label: {len(items)} prompts x {n} samples from {name} (temperature {settings.temperature}"
             f"{fast}), rule {verifier.name}"
             + (f"; sampling dealt across {world} processes" if world > 1 else ""))
    comps = _sample(gen, [ids[i] for i, _ in flat], settings, seeds, recipe.generate.batch_size, rank, world)
    if world > 1:
        # rank 0 labels and writes; the others take its outcome (the same error on every rank)
        return from_rank0(lambda: _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_,
                                                    rows_path, summary_path, recipe.judge, record, gen.serving(), second)
                                 if rank == 0 else None)
    return _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_, rows_path, summary_path,
                            recipe.judge, record, gen.serving(), second)


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the process group a multi-process launch opened; (0, 1) alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sample(gen, prompts: list, settings, seeds: list, batch_size: int, rank: int, world: int) -> list:
    """Every sample's completion, the length-grouped batches dealt across the processes (batch j to rank
    j mod world, as ``generate`` deals them) and gathered: the same batches, hence the same samples, as one
    process draws."""
    batches = length_batches([len(p) for p in prompts], batch_size)
    mine = [b for j, b in enumerate(batches) if j % world == rank]
    got: list = []
    with progress("sampling", sum(len(b) for b in mine), unit="samples") as bar:
        for b in mine:
            res = gen.generate([prompts[i] for i in b], settings, [seeds[i] for i in b], batch_size=len(b))
            got += list(zip(b, res))
            bar.advance(len(b))
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, got)
        got = [x for part in parts for x in part]
    comps: list = [None] * len(prompts)
    for i, c in got:
        comps[i] = c
    return comps


def _second_opinions(second, items, flat, comps, labels: list) -> set:
    """The unsure samples' verdicts asked of the judge ``second`` (in place; its own no-verdict stays unsure, the
    verifier's reason is kept); returns the indices it decided."""
    decided = set()
    for k, got in enumerate(labels):
        if got.verdict != "unsure":
            continue
        i, j = flat[k]
        again = _verdict(None, second, items[i], comps[k].text, j)
        if again.verdict != "unsure":
            labels[k] = Outcome(again.verdict, got.reason)
            decided.add(k)
    return decided


def _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_, rows_path, summary_path,
                     judge_section, record: dict, served: Optional[dict], second=None) -> dict:
    # The run's decoding is recorded once, in the summary; each row keeps what tells its samples apart from
    # another run's, without the fast mode's cache and threshold (the same for every row of the run).
    sampler = recorded_settings(settings)
    row_sampler = {k: v for k, v in sampler.items() if k not in PER_RUN_KEYS}
    rows = []
    judged: set = set()
    try:
        labels = _labels(verifier, judge, items, flat, [c.text for c in comps], judge_section)
        if second is not None:
            sent = sum(o.verdict == "unsure" for o in labels)
            judged = _second_opinions(second, items, flat, comps, labels)
            info(f"label: {sent} unsure sample(s) sent to the judge {second.model}: {len(judged)} decided")
    finally:
        for j in (judge, second):
            if j is not None:
                j.close()
    reasons: Counter = Counter()
    unsure = []
    for k, (((i, j), c), got) in enumerate(zip(zip(flat, comps), labels)):
        p = items[i]
        row = {"id": f"{p.id}:s{j}", "prompt_id": p.id, "prompt": p.messages, "completion": c.text, "label": got.label,
               "round": round_, "model": name, "sampler": row_sampler, "labeller": verifier.name, "verdict": got.verdict}
        if k in judged:  # the verifier was unsure: the verdict is the judge's
            row["judged_by"] = f"judge:{second.model}"
        if got.reason is not None:
            row["reason"] = got.reason
            reasons[got.reason] += 1
        # an unsure row is kept apart from the training rows, with its reason (an absolute judge's included)
        (unsure if got.label is None else rows).append(row)
    per_prompt = Counter()
    good = Counter()
    for r in rows:
        per_prompt[r["prompt_id"]] += 1
        good[r["prompt_id"]] += r["label"]
    n_good = sum(r["label"] for r in rows)
    if judge is not None and judge.unjudgeable:  # said before the error below, which refers to it
        warn(f"label: {judge.unjudgeable} sample(s) got no [[YES]]/[[NO]] verdict even when asked for it alone: left out")
    if unsure:
        why = Counter(r.get("reason", "no reason given") for r in unsure)
        info(f"label: {len(unsure)} of {len(flat)} samples unsure ({100 * len(unsure) / len(flat):.1f}%), left out of "
             f"training and written to {UNSURE}: " + ", ".join(f"{k} {v}" for k, v in why.most_common()))
    if not rows:
        raise UserError("no sample got a verdict of desirable or undesirable: nothing to write",
                        hint="see the warning above" if judge is not None and judge.unjudgeable
                        else "see the unsure samples counted above")
    summary = {
        "rows": len(rows), "prompts": len(items), "samples_per_prompt": n, "desirable": n_good,
        "undesirable": len(rows) - n_good, "desirable_share": n_good / len(rows),
        "prompts_all_desirable": sum(1 for k in per_prompt if good[k] == per_prompt[k]),
        "prompts_all_undesirable": sum(1 for k in per_prompt if good[k] == 0),
        "model": name, "labeller": verifier.name, "round": round_, "sampler": sampler, "rows_file": ROWS,
        "unjudgeable": judge.unjudgeable if judge is not None else 0,
        "unsure": len(unsure), "unsure_share": len(unsure) / len(flat), "unsure_file": UNSURE,
        "unsure_judged": len(judged),
        "reasons": _reason_counts(verifier, reasons) if reasons else None, "settings": record,
    }
    summary["served"] = served  # the model the backend says it served (None where it cannot tell)
    atomic_write_text(rows_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(rows_path.parent / UNSURE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in unsure))
    atomic_write_json(summary_path, summary)
    return summary
