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

from dllm_align.config import components
from dllm_align.core.errors import UserError
from dllm_align.core.runfolder import from_rank0, run_folder

ROWS = "labelled.jsonl"
SUMMARY = "label_summary.json"
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
    from dllm_align.data.rows import content_hash

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
    from dllm_align.data.layouts import as_messages
    from dllm_align.data.read import read_tables
    from dllm_align.data.rows import BadValue

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


def prompt_fingerprint(source: str, split: Optional[str], limit: Optional[int]) -> str:
    """A hash of the prompts' content (ids, messages and source rows), whatever file or built-in holds them:
    what a resumed online run must still be labelling."""
    from dllm_align.data.rows import content_hash

    return content_hash([[p.id, p.messages, p.row] for p in read_prompts(source, split, limit)], n=32)


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


def label_settings(recipe, temperature: Optional[float], fast: bool = True):
    """The sampler settings of a labelling run, and whether the fast defaults were filled in (their cache is
    then chosen for the model's rule once it is known: :func:`_for_model`). ``fast`` False keeps the recipe's
    decoding as it is."""
    from dllm_align.config.schema import FAST_CACHE, FAST_THRESHOLD
    from dllm_align.generate.settings import SamplerSettings

    s = SamplerSettings.from_section(recipe.generate)
    upd = {}
    if temperature is not None:
        upd["temperature"] = temperature
    elif s.temperature == 0:
        upd["temperature"] = 1.0  # greedy samples of one prompt would all be the same completion
    filled = fast and s.cache == "none" and s.threshold is None
    if filled:
        upd.update(cache=FAST_CACHE, threshold=FAST_THRESHOLD)
    return s.replace(**upd), filled


def _for_model(gen, settings, fast: bool, chosen_temperature: bool = True):
    """``settings`` as the model decodes them, refused by its rule's checks before anything is written. The
    fast cache filled in for the user is the rule's own: the block rule keeps finished blocks only (prefix). A rule
    with its own temperature schedule (DiffusionGemma's; its draws differ by seed at any temperature) takes none:
    the 1.0 filled in for sampling is dropped, one the user chose (``chosen_temperature``) refused by name."""
    from dllm_align.generate.rules import rule_fast_cache

    rule = gen.settings_for(settings.replace(cache="none", threshold=None, temperature=0.0)).sampler
    if "temperature" in components.get("rule", rule, key="generate.sampler").ignores and settings.temperature != 0:
        if chosen_temperature:
            raise UserError(f"--temperature {settings.temperature:g}: the {rule} rule samples with its own temperature "
                            "schedule and reads no temperature", hint="leave --temperature out: its samples differ by seed")
        settings = settings.replace(temperature=0.0)
    if fast:
        settings = settings.replace(cache=rule_fast_cache(gen.settings_for(settings.replace(cache="none", threshold=None)).sampler))
    return gen.settings_for(settings)


def check_temperature(temperature: Optional[float], n: int) -> None:
    """Greedy samples of one prompt are one completion n times: ``--temperature 0`` with ``--n`` above 1 is refused."""
    if temperature == 0 and n > 1:
        raise UserError(f"--temperature 0 with --n {n}: greedy decoding gives one completion {n} times, with nothing "
                        "to contrast", hint="sample at a temperature above 0 (1.0 by default), or --n 1")


def check_rule(rule: str, answer_column: str, recipe):
    """The verifier ``rule`` names, every check that needs no model done (a judge's key and URL included)."""
    from dllm_align.online.verifiers import get_rule

    return get_rule(rule, answer_column=answer_column, recipe=recipe)


def _refuse_relabel(summary_path: Path, settings: dict) -> None:
    """A folder labelled with other settings is not relabelled over: its rows would mix rules, models or samples."""
    from dllm_align.core.runfolder import differing, refuse_changes

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
    import torch

    from dllm_align.core.io import check_not_input
    from dllm_align.generate.backend import backend_component, make_generator, recorded_settings
    from dllm_align.generate.settings import encode_prompt, row_seed

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
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: a file, not a folder", hint="name a folder for the labelled rows")
    rows_path, summary_path = out / ROWS, out / SUMMARY
    for p in (rows_path, summary_path):
        check_not_input(p)
    rank, world = _ranks()
    settings, filled = label_settings(recipe, temperature, fast)
    name = recipe.model.name_or_path if model is None else model
    record = {"--rule": rule, "--n": n, "--model": str(name), "--prompts": str(source), "--limit": limit,
              "--answer-column": answer_column, "generate": recorded_settings(settings)}
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
                             record, rank, world)


def _label_locked(recipe, out: Path, gen, items, ids, flat, seeds, settings, verifier, rule, name, n, round_, record,
                  rank: int, world: int) -> dict:
    """Sampling, labelling and writing, with the folder locked (on rank 0) and every check passed."""
    from dllm_align.core.console import info
    from dllm_align.generate.backend import recorded_settings

    rows_path, summary_path = out / ROWS, out / SUMMARY
    judge = None
    if verifier.bind is not None and rank == 0:  # a verifier bound to the run folder (a judge's cache) lives on rank 0
        from dllm_align.online.verifiers import Rule

        judge = verifier.bind(out)
        verifier = Rule(rule, judge)
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
                                                    rows_path, summary_path, recipe.judge, record, gen.serving())
                                 if rank == 0 else None)
    return _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_, rows_path, summary_path,
                            recipe.judge, record, gen.serving())


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


def _label_and_write(verifier, judge, items, flat, comps, settings, name, n, round_, rows_path, summary_path,
                     judge_section, record: dict, served: Optional[dict]) -> dict:
    from dllm_align.core.io import atomic_write_json, atomic_write_text
    from dllm_align.generate.backend import recorded_settings

    # The run's decoding is recorded once, in the summary; each row keeps what tells its samples apart from
    # another run's, without the fast mode's cache and threshold (the same for every row of the run).
    sampler = recorded_settings(settings)
    row_sampler = {k: v for k, v in sampler.items() if k not in PER_RUN_KEYS}
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
               "round": round_, "model": name, "sampler": row_sampler, "labeller": verifier.name,
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
        "reasons": _reason_counts(verifier, reasons) if reasons else None, "settings": record,
    }
    summary["served"] = served  # the model the backend says it served (None where it cannot tell)
    atomic_write_text(rows_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_json(summary_path, summary)
    return summary
