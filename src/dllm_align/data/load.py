"""The public loaders: unpaired rows, pairs and prompts from any source, and the rows a recipe's `data`
section describes. Bad rows are listed with file and line; nothing is dropped silently.
"""


from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.data.rows import BadValue, Format, PairRow, Problem, PromptRow, Row, Table, explicit_id, report_problems, unpair
from dllm_align.data.read import read_tables
from dllm_align.data.layouts import as_messages, assign_ids, check_prompt_turn, column_names, finish_counters, note_layout, pair_hash, parse_paired, parse_unpaired, prompt_hash, row_hash, same_messages, source_name, table_layout
from dllm_align.data.imbalance import class_counts, subsample


# --------------------------------------------------------------------------- public loaders
def _parse_tables(tables, format: str, label, problems: list, counters: dict, prompts_only: str):
    """Parse every table of a source by its layout: (paired rows, unpaired rows, layouts)."""
    parsed_pairs: list[tuple] = []
    parsed_rows: list[tuple] = []
    layouts = []
    for t in tables:
        lay = table_layout(t, format)
        layouts.append(lay)
        if lay == "paired":
            parsed_pairs += parse_paired(t, problems)
        elif lay == "unpaired":
            parsed_rows += parse_unpaired(t, label, problems, counters)
        else:
            raise UserError(f"{t.name}: {prompts_only}")
    return parsed_pairs, parsed_rows, layouts


def load_unpaired(
    source: str | Path,
    split: Optional[str] = None,
    format: Format = "auto",
    label: Optional[bool] = None,
    skip_invalid: bool = False,
    *,
    quiet: bool = False,
) -> list[Row]:
    """Read any supported source as unpaired (KTO) rows; paired data is unpaired (chosen -> true).

    ``label`` gives the class of rows that have no ``label`` column (a file of
    one class). A folder of ``chosen.*`` + ``rejected.*`` files is read with labels
    true / false and ids ``ID:chosen`` / ``ID:rejected`` (pair id ``ID`` when the
    other file has the same id and prompt).
    """
    tables = read_tables(source, split)
    if tables[0].role is not None:
        return _unpaired_from_pair_files(tables, skip_invalid, quiet)
    problems: list[Problem] = []
    counters: dict = {}
    parsed_pairs, parsed_rows, layouts = _parse_tables(
        tables, format, label, problems, counters, "holds prompts only (no completion or chosen/rejected columns); training needs completions"
    )
    # Ids are assigned over all files of a source at once (shards may hold copies of each other's rows).
    rows = unpair(assign_ids(parsed_pairs, problems, pair_hash, counters))
    rows += assign_ids(parsed_rows, problems, row_hash, counters)
    report_problems(problems, source_name(tables, source), skip_invalid)
    note_layout(tables, layouts, quiet)
    finish_counters(counters, label)
    if parsed_pairs and parsed_rows:
        _check_unique([r.id for r in rows], str(source))
    if not rows:
        raise UserError(f"{source}: no valid rows")
    return rows


def _check_unique(ids: list[str], what: str) -> None:
    seen = set()
    for i in ids:
        if i in seen:
            raise UserError(f"{what}: id '{i}' occurs twice, once from paired and once from unpaired rows")
        seen.add(i)


def _pair_file_rows(tables: list[Table], problems: list[Problem]) -> dict[str, list[tuple[str, Row]]]:
    counters: dict = {}
    out = {}
    for t in tables:
        if column_names(t) and "completion" not in column_names(t):
            raise UserError(f"{t.name}: a {t.role} file needs a 'completion' column")
        parsed = parse_unpaired(t, None, problems, counters)
        good = []
        seen: dict[str, str] = {}
        for where, row, rid in parsed:
            if rid is None:
                problems.append(Problem(where, f"missing column 'id' (needed to match {t.role} rows with their partners)"))
                continue
            if rid in seen:
                problems.append(Problem(where, f"duplicate id '{rid}' (first at {seen[rid]})"))
                continue
            seen[rid] = where
            good.append((where, row))
        out[t.role] = good
    return out


def _unpaired_from_pair_files(tables: list[Table], skip_invalid: bool, quiet: bool) -> list[Row]:
    problems: list[Problem] = []
    by_role = _pair_file_rows(tables, problems)
    report_problems(problems, f"{Path(tables[0].name).parent}", skip_invalid)
    rejected = {r.id: r for _, r in by_role["rejected"]}
    rows = []
    n_pairs = 0
    used: set[str] = set()
    # Interleaved like unpair(): a chosen row, then its rejected partner, so that
    # taking the first N rows (data.limit) keeps both classes.
    for _, c in by_role["chosen"]:
        o = rejected.get(c.id)
        paired = o is not None and same_messages(o.prompt, c.prompt)
        rows.append(Row(f"{c.id}:chosen", c.prompt, c.completion, True, c.id if paired else None))
        if o is not None:
            n_pairs += paired
            used.add(c.id)
            rows.append(Row(f"{o.id}:rejected", o.prompt, o.completion, False, o.id if paired else None))
    for _, r in by_role["rejected"]:
        if r.id not in used:
            rows.append(Row(f"{r.id}:rejected", r.prompt, r.completion, False, None))
    if not quiet:
        console.info(
            f"{Path(tables[0].name).parent}: chosen + rejected files, {len(by_role['chosen']):,} + "
            f"{len(by_role['rejected']):,} rows ({n_pairs:,} pairs share an id and prompt)"
        )
    return rows


def _pairs_from_pair_files(tables: list[Table], skip_invalid: bool, quiet: bool) -> list[PairRow]:
    problems: list[Problem] = []
    by_role = _pair_file_rows(tables, problems)
    rej = {r.id: (w, r) for w, r in by_role["rejected"]}
    chosen_ids = {r.id for _, r in by_role["chosen"]}
    pairs = []
    for where, c in by_role["chosen"]:
        if c.id not in rej:
            problems.append(Problem(where, f"id '{c.id}' has no rejected partner"))
            continue
        rw, r = rej[c.id]
        if not same_messages(c.prompt, r.prompt):
            problems.append(Problem(where, f"id '{c.id}': prompt differs from the rejected row's ({rw})"))
            continue
        pairs.append(PairRow(c.id, c.prompt, c.completion, r.completion))
    for where, r in by_role["rejected"]:
        if r.id not in chosen_ids:
            problems.append(Problem(where, f"id '{r.id}' has no chosen partner"))
    report_problems(problems, f"{Path(tables[0].name).parent}", skip_invalid)
    if not quiet:
        console.info(f"{Path(tables[0].name).parent}: chosen + rejected files joined on id, {len(pairs):,} pairs")
    return pairs


def load_paired(
    source: str | Path,
    split: Optional[str] = None,
    format: Format = "auto",
    skip_invalid: bool = False,
    *,
    quiet: bool = False,
) -> list[PairRow]:
    """Read preference pairs (for VRPO).

    Paired layouts are read directly; a folder of ``chosen.*`` + ``rejected.*``
    files is joined on id; unpaired rows are re-paired by their ``pair_id`` (the
    output of ``dllm-align convert``): each pair id needs one desirable and one
    undesirable row with the same prompt.
    """
    tables = read_tables(source, split)
    if tables[0].role is not None:
        return _pairs_from_pair_files(tables, skip_invalid, quiet)
    problems: list[Problem] = []
    counters: dict = {}
    parsed_pairs, parsed_rows, layouts = _parse_tables(
        tables, format, None, problems, counters, "holds prompts only; pairs need chosen and rejected completions"
    )
    pairs = assign_ids(parsed_pairs, problems, pair_hash, counters)
    if parsed_rows:
        pairs += _repair(parsed_rows, source_name(tables, source), problems)
    report_problems(problems, source_name(tables, source), skip_invalid)
    note_layout(tables, layouts, quiet)
    finish_counters(counters, None)
    if parsed_pairs and parsed_rows:
        _check_unique([p.id for p in pairs], str(source))
    if not pairs:
        raise UserError(f"{source}: no valid pairs")
    return pairs


def _repair(parsed: list[tuple], name: str, problems: list[Problem]) -> list[PairRow]:
    groups: dict[str, list[tuple[str, Row]]] = {}
    loose = 0
    for where, row, _ in parsed:
        if row.pair_id is None:
            loose += 1
            continue
        groups.setdefault(row.pair_id, []).append((where, row))
    if loose and not groups:
        raise UserError(
            f"{name}: unpaired rows without pair ids cannot be used as pairs",
            hint="VRPO needs paired data (prompt/chosen/rejected); train.objective elbo_kto takes unpaired rows",
        )
    if loose:
        console.warn(f"{name}: {loose:,} rows have no pair_id and are left out of the pairs")
    pairs = []
    for pid, members in groups.items():
        good = [r for _, r in members if r.label]
        bad = [r for _, r in members if not r.label]
        where = members[0][0]
        if len(good) != 1 or len(bad) != 1:
            problems.append(Problem(where, f"pair_id '{pid}' has {len(good)} desirable and {len(bad)} undesirable rows (need 1 and 1)"))
            continue
        if not same_messages(good[0].prompt, bad[0].prompt):
            problems.append(Problem(where, f"pair_id '{pid}': the two rows have different prompts"))
            continue
        pairs.append(PairRow(pid, good[0].prompt, good[0].completion, bad[0].completion))
    return pairs


def load_prompts(
    source: str | Path,
    split: Optional[str] = None,
    limit: Optional[int] = None,
    *,
    skip_invalid: bool = False,
    quiet: bool = False,
) -> list[PromptRow]:
    """Distinct prompts of any layout, or of a ``.txt`` file with one prompt per line.

    Ids: a ``prompt_id`` column; else a pair's id (paired data, converted rows'
    ``pair_id``); else the row's ``id`` when no prompt repeats; else a hash of
    the prompt. Unpaired rows sharing a prompt give that prompt once. ``limit``
    keeps the first N prompts in file order.
    """
    tables = read_tables(source, split, allow_txt=True)
    if tables[0].role is not None:
        pairs = _pairs_from_pair_files(tables, skip_invalid, quiet)
        return _limit([PromptRow(p.id, p.prompt) for p in pairs], limit)
    problems: list[Problem] = []
    out: list[PromptRow] = []
    layouts = []
    for t in tables:
        lay = "prompts" if t.name.endswith((".txt", ".txt.gz")) else table_layout(t, "auto")
        layouts.append(lay)
        out.extend(_prompts_of_table(t, lay, problems))
    report_problems(problems, source_name(tables, source), skip_invalid)
    note_layout(tables, layouts, quiet)
    # Distinct ids: identical prompts collapse, a reused id for another prompt is a problem.
    seen: dict[str, PromptRow] = {}
    unique = []
    clashes = []
    for p in out:
        if p.id in seen:
            if not same_messages(seen[p.id].messages, p.messages):
                clashes.append(p.id)
            continue
        seen[p.id] = p
        unique.append(p)
    if clashes:
        raise UserError(f"{source_name(tables, source)}: id '{clashes[0]}' is used for different prompts ({len(clashes)} ids)")
    if not unique:
        raise UserError(f"{source}: no prompts")
    return _limit(unique, limit)


def _limit(rows: list, limit: Optional[int]) -> list:
    return rows if limit is None else rows[:limit]


def _prompts_of_table(t: Table, lay: str, problems: list[Problem]) -> list[PromptRow]:
    counters: dict = {}
    if lay == "paired":
        # Pairs sharing a prompt give it once (load_prompts drops same-id, same-prompt repeats).
        return [PromptRow(rid or p.id or prompt_hash(p.prompt), p.prompt) for _, p, rid in parse_paired(t, problems)]
    if lay == "unpaired":
        parsed = parse_unpaired(t, False, problems, counters)
        pids = {}
        for rec in t.records:
            if rec.data is not None and "prompt_id" in rec.data:
                try:
                    pids[rec.where] = explicit_id(rec.data["prompt_id"])
                except BadValue:
                    pass
        keys = [json.dumps(r.prompt, sort_keys=True) for _, r, _ in parsed]
        repeats = len(set(keys)) < len(keys)
        out = []
        for (where, row, rid), _k in zip(parsed, keys):
            pid = pids.get(where) or row.pair_id or (rid if not repeats else None) or prompt_hash(row.prompt)
            out.append(PromptRow(pid, row.prompt))
        return out
    out = []
    for rec in t.records:
        if rec.problem:
            problems.append(Problem(rec.where, rec.problem))
            continue
        d = rec.data
        try:
            if "prompt" in d:
                msgs, _ = as_messages(d["prompt"], "prompt", t.textual)
            elif "messages" in d:
                msgs, _ = as_messages(d["messages"], "messages", t.textual)
                while msgs and msgs[-1]["role"] == "assistant":
                    msgs = msgs[:-1]
                if not msgs:
                    raise BadValue("messages: no user turn before the assistant reply")
            else:
                raise BadValue("missing column 'prompt'")
            check_prompt_turn(msgs)
            pid = explicit_id(d.get("prompt_id")) or explicit_id(d.get("id")) or prompt_hash(msgs)
            out.append(PromptRow(pid, msgs))
        except BadValue as e:
            problems.append(Problem(rec.where, str(e)))
    return out




# --------------------------------------------------------------------------- the recipe's data section
def rows_from_section(section, split: Literal["train", "test"] = "train", *, quiet: bool = False) -> list[Row]:
    """The unpaired training rows a recipe's ``data`` section describes.

    Reads ``train`` (or ``test``) with ``format`` and ``label``, keeps the first
    ``limit`` rows, then applies ``desirable_ratio`` / ``undesirable_ratio`` with
    ``seed`` (:func:`subsample`).
    """
    source = section.train if split == "train" else section.test
    if source is None:
        raise UserError(f"data.{split} is not set", hint=f"set data.{split} in the recipe or with --set data.{split}=PATH")
    rows = load_unpaired(
        source,
        split=section.train_split if split == "train" else section.test_split,
        format=section.format,
        label=section.label,
        quiet=quiet,
    )
    if section.limit is not None:
        rows = rows[: section.limit]
    if section.desirable_ratio < 1 or section.undesirable_ratio < 1:
        before = class_counts(rows)
        rows = subsample(rows, section.desirable_ratio, section.undesirable_ratio, section.seed)
        after = class_counts(rows)
        if not quiet:
            console.info(
                f"subsampled (seed {section.seed}): desirable {before[0]:,} -> {after[0]:,}, "
                f"undesirable {before[1]:,} -> {after[1]:,}"
            )
    return rows



