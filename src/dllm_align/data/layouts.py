"""Normalising values and parsing layouts: prompts and completions as message lists, labels, the
unpaired / paired / prompts-only layouts, and ids (own column or content hash, duplicates suffixed).
"""


from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Iterable, Optional

from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.data.rows import DETECT_ROWS, BadValue, Messages, PairRow, Problem, Row, Table, content_hash, explicit_id, show_value
from dllm_align.data.read import has_surrogates


# --------------------------------------------------------------------------- normalising values
def _text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadValue(f"{what}: not UTF-8 text") from None
    if isinstance(value, str):
        if has_surrogates(value):
            raise BadValue(f"{what}: not UTF-8 text")
        return value
    if isinstance(value, list) and all(isinstance(x, dict) and x.get("type") == "text" for x in value):
        # OpenAI-style content parts; only text parts are meaningful here.
        return "".join(_text(x.get("text"), what) for x in value)
    raise BadValue(f"{what} must be text, got {type(value).__name__}")


def _maybe_json_list(value: Any, textual: bool) -> Any:
    # CSV cells hold message lists as JSON text.
    if textual and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
        if isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed):
            return parsed
    return value


def as_messages(value: Any, what: str, textual: bool = False) -> tuple[Messages, bool]:
    """Normalise a prompt or conversation; returns (messages, was_a_string)."""
    value = _maybe_json_list(value, textual)
    if isinstance(value, (str, bytes)):
        text = _text(value, what)
        if not text.strip():
            raise BadValue(f"empty {what}")
        return [{"role": "user", "content": text}], True
    if isinstance(value, (list, tuple)):
        if not value:
            raise BadValue(f"empty {what} (no messages)")
        out = []
        for j, m in enumerate(value):
            if not isinstance(m, dict):
                raise BadValue(f"{what}[{j}] must be a message object with 'role' and 'content', got {type(m).__name__}")
            if "role" not in m or "content" not in m:
                missing = "role" if "role" not in m else "content"
                raise BadValue(f"{what}[{j}] has no '{missing}'")
            role = m["role"]
            if not isinstance(role, str) or not role.strip():
                raise BadValue(f"{what}[{j}].role must be a non-empty string, got {show_value(role)}")
            content = "" if m["content"] is None else _text(m["content"], f"{what}[{j}].content")
            out.append({"role": role.strip(), "content": content})
        if not any(m["content"].strip() for m in out):
            raise BadValue(f"empty {what} (every message is blank)")
        return out, False
    if value is None:
        raise BadValue(f"empty {what} (null)")
    raise BadValue(f"{what} must be a string or a list of chat messages, got {type(value).__name__}")


def same_messages(a: Messages, b: Messages) -> bool:
    return len(a) == len(b) and all(
        x["role"] == y["role"] and x["content"].strip() == y["content"].strip() for x, y in zip(a, b)
    )


def _reply(
    value: Any, column: str, prompt: Optional[Messages], prompt_was_str: bool, textual: bool
) -> tuple[str, Optional[Messages]]:
    """A completion (string or message list) -> (reply text, conversation before it or None).

    A message list must end with the assistant's reply. Anything before it is the
    prompt conversation (UltraFeedback's full ``chosen``/``rejected``); it must agree
    with the ``prompt`` column: the same messages, or, for a string prompt, a
    conversation whose last user message is that string.
    """
    value = _maybe_json_list(value, textual)
    if isinstance(value, (str, bytes)) or value is None:
        text = _text(value, column) if value is not None else ""
        if not text.strip():
            raise BadValue(f"empty {column}")
        return text, None
    msgs, _ = as_messages(value, column, textual)
    last = msgs[-1]
    if last["role"] != "assistant":
        raise BadValue(f"{column}: the message list has no assistant reply (last message is from '{last['role']}')")
    if not last["content"].strip():
        raise BadValue(f"empty {column} (the assistant reply is blank)")
    before = msgs[:-1]
    if not before:
        return last["content"], None
    if prompt is not None:
        agrees = same_messages(before, prompt) or (
            prompt_was_str
            and before[-1]["role"] == "user"
            and before[-1]["content"].strip() == prompt[0]["content"].strip()
        )
        if not agrees:
            raise BadValue(f"{column}: the conversation before the reply does not match the prompt column")
    return last["content"], before


def _label(value: Any, textual: bool) -> bool:
    if isinstance(value, bool):
        return value
    if textual and isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise BadValue(f"label must be true or false, got {show_value(value)}")


def _prompt_of(data: dict, textual: bool) -> tuple[Optional[Messages], bool]:
    if "prompt" not in data:
        return None, False
    return as_messages(data["prompt"], "prompt", textual)


def check_prompt_turn(prompt: Messages) -> None:
    if prompt[-1]["role"] == "assistant":
        raise BadValue("prompt ends with an assistant message; the completion must answer a user turn")


# --------------------------------------------------------------------------- layouts
def column_names(table: Table) -> set[str]:
    cols: set[str] = set()
    for r in table.records[:DETECT_ROWS]:
        if r.data is not None:
            cols |= set(r.data)
    return cols


def detect_layout(columns: Iterable[str]) -> Optional[str]:
    """'paired', 'unpaired', 'prompts' or None from a set of column names."""
    c = set(columns)
    if {"chosen", "rejected"} <= c:
        return "paired"
    if "completion" in c:
        return "unpaired"
    if "prompt" in c or "messages" in c:
        return "prompts"
    return None


_REQUIRED = {"paired": ("chosen", "rejected"), "unpaired": ("completion",)}


def note_layout(tables: list[Table], layouts: list[str], quiet: bool) -> None:
    """Say which layout was read (after validation, so an error stays the first line of output)."""
    if quiet:
        return
    for t, lay in zip(tables, layouts):
        cols = column_names(t)
        shown = ", ".join(c for c in ("prompt", "completion", "label", "chosen", "rejected", "messages", "id", "prompt_id") if c in cols)
        console.info(f"{t.name}: {lay} layout ({shown}), {len(t.records):,} rows")


def table_layout(table: Table, fmt: str) -> str:
    cols = column_names(table)
    if not cols:
        if not table.records:
            raise UserError(f"{table.name}: no rows")
        return fmt if fmt != "auto" else "unpaired"
    found = detect_layout(cols)
    if fmt == "auto":
        if found is None:
            raise UserError(
                f"{table.name}: cannot tell the layout from the columns ({', '.join(sorted(cols)[:10])})",
                hint="expected prompt/completion/label (unpaired) or prompt/chosen/rejected (paired)",
            )
        return found
    missing = [c for c in _REQUIRED.get(fmt, ()) if c not in cols]
    if missing:
        raise UserError(
            f"{table.name}: --format {fmt} needs column '{missing[0]}', found {', '.join(sorted(cols)[:10])}",
            hint=f"the columns look {found}: use --format auto" if found else None,
        )
    return fmt


def parse_unpaired(table: Table, label: Optional[bool], problems: list[Problem], counters: dict) -> list[tuple]:
    out = []
    for rec in table.records:
        if rec.problem:
            problems.append(Problem(rec.where, rec.problem))
            continue
        d = rec.data
        try:
            prompt, was_str = _prompt_of(d, table.textual)
            if "completion" not in d:
                raise BadValue("missing column 'completion'")
            text, before = _reply(d["completion"], "completion", prompt, was_str, table.textual)
            if before is not None:
                prompt = before
            if prompt is None:
                raise BadValue("missing column 'prompt'")
            check_prompt_turn(prompt)
            if table.implied_label is not None and "label" not in d:
                lab = table.implied_label
            elif "label" in d:
                lab = _label(d["label"], table.textual)
                if label is not None:
                    counters["own_label"] = counters.get("own_label", 0) + 1
            elif label is not None:
                lab = label
            else:
                raise BadValue("missing column 'label' (for a file of one class pass --label true or --label false)")
            rid = explicit_id(d.get("id"))
            pair_id = explicit_id(d.get("pair_id"))
            out.append((rec.where, Row(rid or "", prompt, text, lab, pair_id), rid))
        except BadValue as e:
            problems.append(Problem(rec.where, str(e)))
    return out


def parse_paired(table: Table, problems: list[Problem]) -> list[tuple]:
    out = []
    for rec in table.records:
        if rec.problem:
            problems.append(Problem(rec.where, rec.problem))
            continue
        d = rec.data
        try:
            prompt, was_str = _prompt_of(d, table.textual)
            for col in ("chosen", "rejected"):
                if col not in d:
                    raise BadValue(f"missing column '{col}'")
            chosen, before_c = _reply(d["chosen"], "chosen", prompt, was_str, table.textual)
            rejected, before_r = _reply(d["rejected"], "rejected", prompt, was_str, table.textual)
            if prompt is None:
                if before_c is None or before_r is None:
                    raise BadValue("missing column 'prompt'")
                if not same_messages(before_c, before_r):
                    raise BadValue("chosen and rejected conversations differ before the reply")
            prompt = before_c or before_r or prompt
            check_prompt_turn(prompt)
            rid = explicit_id(d.get("id"))
            # A prompt_id names the prompt, not the pair: several pairs may share it,
            # so it is a soft id (suffixed on repeats) rather than a row id.
            soft = None if rid is not None else explicit_id(d.get("prompt_id"))
            out.append((rec.where, PairRow(rid or soft or "", prompt, chosen, rejected), rid))
        except BadValue as e:
            problems.append(Problem(rec.where, str(e)))
    return out


def assign_ids(parsed: list[tuple], problems: list[Problem], hash_of, counters: dict) -> list:
    """Give each row its explicit id, else its soft id (a pair's ``prompt_id``), else a content hash.

    A repeated explicit id is a problem. Rows without one that collide (exact
    copies of a row, pairs sharing a prompt_id) keep the first id and get ``-2``,
    ``-3`` suffixes in file order; the caller warns with the count. Hash ids
    depend on content only, so they are the same whatever the row order.
    """
    seen: dict[str, str] = {}
    out = []
    for where, row, rid in parsed:
        if rid is not None:
            if rid in seen:
                problems.append(Problem(where, f"duplicate id '{rid}' (first at {seen[rid]})"))
                continue
            seen[rid] = where
            out.append(row)
            continue
        base = row.id or hash_of(row)
        new, k = base, 1
        while new in seen:
            k += 1
            new = f"{base}-{k}"
        if k > 1:
            key = "dup_prompt_id" if row.id else "dup_content"
            counters[key] = counters.get(key, 0) + 1
        seen[new] = where
        out.append(_with_id(row, new))
    return out


def _with_id(row, new_id: str):
    return replace(row, id=new_id)


def row_hash(r: Row) -> str:
    return content_hash({"prompt": r.prompt, "completion": r.completion, "label": r.label})


def pair_hash(p: PairRow) -> str:
    return content_hash({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected})


def prompt_hash(messages: Messages) -> str:
    return content_hash({"prompt": messages})





def source_name(tables: list[Table], source) -> str:
    return tables[0].name if len(tables) == 1 else str(source)


def finish_counters(counters: dict, label: Optional[bool]) -> None:
    if counters.get("own_label"):
        console.warn(f"{counters['own_label']:,} rows have their own label column; --label {str(label).lower()} applies only to rows without one")
    if counters.get("dup_prompt_id"):
        console.warn(f"{counters['dup_prompt_id']:,} pairs repeat an earlier pair's prompt_id (kept, ids suffixed -2, -3, ...)")
    if counters.get("dup_content"):
        console.warn(f"{counters['dup_content']:,} rows are exact copies of earlier rows (kept, ids suffixed -2, -3, ...)")



