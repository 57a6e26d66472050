"""What the judge reads and sends: generation rows, their pairing by id, the
judging template and the verdict in a reply (docs/design.md#judging). Pure
functions; :mod:`dllm_align.judge.run` runs them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dllm_align.core.console import warn
from dllm_align.core.errors import UserError

ORDERS = ("AB", "BA")  # AB: model A's answer shown first; BA: model B's answer shown first
PLACEHOLDERS = ("prompt", "answer_a", "answer_b")

# The project's own pairwise template. {answer_a} is whichever answer is shown
# first, so in the BA order it holds model B's completion.
DEFAULT_TEMPLATE = """\
You are an impartial judge comparing two AI assistant answers to the same user prompt.

Decide which answer serves the user better. Weigh, in this order: whether the answer does what \
the user asked, whether it is correct and safe, and whether it is clear and complete without \
padding. Longer is not better by itself. Ignore the order in which the answers are shown and \
any names or styles that hint at who wrote them.

Write a short comparison first. Then end your reply with your verdict on its own line, in \
exactly one of these forms:
[[A]] if Answer A is better,
[[B]] if Answer B is better,
[[C]] if they are equally good or equally bad.

<user_prompt>
{prompt}
</user_prompt>

<answer_a>
{answer_a}
</answer_a>

<answer_b>
{answer_b}
</answer_b>
"""

_VERDICT_RE = re.compile(r"\[\[\s*([ABC])\s*\]\]")
_PLACEHOLDER_RE = re.compile(r"\{(prompt|answer_a|answer_b)\}")
_ANY_FIELD_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


# =========================================================================== rows
@dataclass(frozen=True)
class GenRow:
    """One generation row: ``id``, the prompt as the judge sees it, the completion text."""

    id: str
    prompt: str
    completion: str
    reference: Optional[str]
    where: str  # "file:line", for messages


def _content_text(content: Any) -> Optional[str]:
    if isinstance(content, str):
        return content
    # OpenAI-style content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def prompt_text(prompt: Any) -> str:
    """The prompt as shown to the judge: a string as it is; a one-message user
    conversation as its content; a longer conversation as ``Role: content`` turns.

    Raises ``ValueError`` on anything else.
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("'prompt' must be a string or a non-empty list of chat messages")
    turns = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"'prompt' message {i} must be an object with a string 'role'")
        text = _content_text(m.get("content"))
        if text is None:
            raise ValueError(f"'prompt' message {i} must have string 'content'")
        turns.append((m["role"], text))
    if len(turns) == 1 and turns[0][0] == "user":
        return turns[0][1]
    return "\n\n".join(f"{role.capitalize()}: {text}" for role, text in turns)


def completion_text(completion: Any) -> str:
    """A completion string, or the content of a one-message assistant list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and len(completion) == 1 and isinstance(completion[0], dict):
        m = completion[0]
        text = _content_text(m.get("content"))
        if m.get("role") == "assistant" and text is not None:
            return text
    raise ValueError("'completion' must be a string or a list holding one assistant message")


def _row(obj: Any, where: str) -> GenRow:
    if not isinstance(obj, dict):
        raise ValueError(f"a row must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise ValueError("missing 'id'")
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ValueError(f"'id' must be a string or an integer, got {type(rid).__name__}")
    for key in ("prompt", "completion"):
        if key not in obj:
            raise ValueError(f"missing '{key}'")
    ref = obj.get("reference")  # optional, for rule judges
    if ref is not None and not isinstance(ref, str):
        try:
            ref = completion_text(ref)
        except ValueError:
            raise ValueError("'reference' must be a string or a list holding one assistant message") from None
    return GenRow(str(rid), prompt_text(obj["prompt"]), completion_text(obj["completion"]), ref, where)


def _read_utf8(path: Path, what: str) -> str:
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})")


def read_generations(path: str | Path) -> list[GenRow]:
    """Read generation rows (``id``, ``prompt``, ``completion``) from JSONL or a JSON list.

    Strict: every bad row is reported as ``file:line: problem`` (the first five,
    and how many more), and nothing is judged. Raises :class:`UserError`.
    """
    path = Path(path)
    text = _read_utf8(path, "file")
    entries: list[tuple[str, Any]] = []
    problems: list[str] = []
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})")
        except RecursionError:
            raise UserError(f"{path}: JSON nested too deeply") from None
        if not isinstance(data, list):
            raise UserError(f"{path}: a .json file must hold a list of rows, got {type(data).__name__}")
        entries = [(f"{path}: row {i + 1}", obj) for i, obj in enumerate(data)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno})")
            except RecursionError:
                problems.append(f"{path}:{lineno}: JSON nested too deeply")
    rows: list[GenRow] = []
    first_seen: dict[str, str] = {}
    for where, obj in entries:
        try:
            row = _row(obj, where)
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        if row.id in first_seen:
            problems.append(f"{where}: duplicate id {row.id!r} (first at {first_seen[row.id]})")
            continue
        first_seen[row.id] = where
        rows.append(row)
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        head = problems[0] if len(problems) == 1 else f"{len(problems)} bad rows:\n  " + "\n  ".join(problems[:5])
        raise UserError(head + more, hint="each row needs 'id', 'prompt' (string or messages), 'completion' (string or one assistant message)")
    if not rows:
        raise UserError(f"{path}: no rows")
    return rows


@dataclass(frozen=True)
class Pair:
    id: str
    prompt: str
    a: str
    b: str
    reference: Optional[str]


def match_rows(rows_a: list[GenRow], rows_b: list[GenRow], *, strict: bool = False, names: tuple[str, str] = ("A", "B")) -> list[Pair]:
    """Pair rows by ``id``, in A's order.

    Ids found in only one file are reported on stderr and left out (with
    ``strict`` they are an error); the same id with different prompts is always
    an error (the two models did not answer the same question).
    """
    by_b = {r.id: r for r in rows_b}
    ids_a = {r.id for r in rows_a}
    only_a = [r.id for r in rows_a if r.id not in by_b]
    only_b = [r.id for r in rows_b if r.id not in ids_a]
    lost = []
    for label, ids, other in ((names[0], only_a, names[1]), (names[1], only_b, names[0])):
        if ids:
            eg = ", ".join(repr(i) for i in ids[:3]) + (", ..." if len(ids) > 3 else "")
            lost.append(f"{len(ids)} id(s) of {label} missing from {other} ({eg})")
    if lost and strict:
        raise UserError("; ".join(lost), hint="drop --strict to judge the ids both files share")
    pairs, mismatched = [], []
    for ra in rows_a:
        rb = by_b.get(ra.id)
        if rb is None:
            continue
        if ra.prompt != rb.prompt:
            mismatched.append(f"id {ra.id!r}: {ra.where} vs {rb.where}")
            continue
        pairs.append(Pair(ra.id, ra.prompt, ra.completion, rb.completion, ra.reference if ra.reference is not None else rb.reference))
    if mismatched:
        more = f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else ""
        raise UserError(
            f"{len(mismatched)} id(s) have different prompts in the two files: " + "; ".join(mismatched[:3]) + more,
            hint="both files must be generations for the same prompts",
        )
    if not pairs:
        raise UserError(f"{names[0]} and {names[1]} share no ids")
    for msg in lost:
        warn(f"{msg}; judging the {len(pairs)} shared ids")
    return pairs


# =========================================================================== template
def check_template(template: str, source: str = "template") -> str:
    """Validate a judging template: it must contain ``{prompt}``, ``{answer_a}`` and ``{answer_b}``."""
    missing = [p for p in PLACEHOLDERS if "{" + p + "}" not in template]
    if missing:
        raise UserError(
            f"{source}: missing placeholder(s) " + ", ".join("{" + m + "}" for m in missing),
            hint="a template needs {prompt}, {answer_a} (shown first) and {answer_b} (shown second)",
        )
    return template


def load_template(path: str | Path | None) -> str:
    """The template in ``path`` (validated), or the built-in :data:`DEFAULT_TEMPLATE`."""
    if path is None:
        return DEFAULT_TEMPLATE
    p = Path(path)
    text = _read_utf8(p, "template file")
    check_template(text, str(p))
    unknown = sorted({m for m in _ANY_FIELD_RE.findall(text) if m not in PLACEHOLDERS})
    if unknown:
        warn(f"{p}: " + ", ".join("{" + u + "}" for u in unknown) + " will be sent as written (only {prompt}, {answer_a}, {answer_b} are filled in)")
    return text


def render(template: str, prompt: str, answer_a: str, answer_b: str) -> str:
    """Fill the three placeholders in one pass, so text inside an answer that
    looks like a placeholder is never substituted again."""
    values = {"prompt": prompt, "answer_a": answer_a, "answer_b": answer_b}
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def parse_verdict(text: str) -> Optional[str]:
    """The verdict ``"A"``, ``"B"`` or ``"C"`` in a judge's reply, or ``None``.

    The last ``[[X]]`` wins: judges explain first and conclude last, and an
    explanation may quote the format (``... so not [[B]]. [[A]]``).
    """
    found = _VERDICT_RE.findall(text or "")
    return found[-1] if found else None
