"""Length anchors and instruction difficulty for the LC-AWR (``judge --length-anchors``, ``--difficulty-from``).

AlpacaEval pins the length slope of its length-controlled win rate with "gamed" baselines: the
baseline's own answers made verbose and concise by the judge's model family, judged against the
baseline. A rewrite keeps the baseline's quality and changes its length, so its verdicts measure what
length alone does to this judge (:func:`dllm_align.judge.stats.lc_estimate`, ``anchors``). Rewrites are
cached in ``OUT/anchors/rewrites.jsonl`` (keyed by model, style, prompt, answer and request settings) and
judged against B like any pair (``OUT/anchors/<style>/``, with its own cache), so a rerun asks nothing
twice. The instruction-difficulty term is a second model's per-prompt outcome against the same B.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from dllm_align.core.console import info, warn
from dllm_align.core.errors import UserError
from dllm_align.core.io import JsonlAppender, note_input, recover_jsonl
from dllm_align.judge import stats
from dllm_align.judge.client import ChatClient, JudgementFailed, read_api_key, run_pool
from dllm_align.judge.inputs import Pair

REWRITE_STYLES = {
    "verbose": ("Rewrite the answer below to be much longer and more detailed: expand every point, add "
                "explanation and examples, but add no new claims and keep every fact as it is."),
    "concise": ("Rewrite the answer below to be as short as possible: keep its content and every fact, drop "
                "everything else."),
}


def rewrite_for_length(client: ChatClient, model: str, prompts: Sequence[str], answers: Sequence[str], style: str,
                       params: Mapping[str, Any], concurrency: int = 8) -> list[Optional[str]]:
    """The answers rewritten in ``style`` ("verbose" or "concise") by ``model``, one per prompt, in order;
    ``None`` where the request failed or the reply was empty (that prompt then has no anchor row)."""
    if style not in REWRITE_STYLES:
        raise UserError(f"length anchors: unknown style {style!r}", hint=f"one of {', '.join(REWRITE_STYLES)}")
    if len(prompts) != len(answers):
        raise ValueError("one answer per prompt")

    out: list[Optional[str]] = [None] * len(answers)

    def one(i: int) -> str:
        content = (f"{REWRITE_STYLES[style]} Reply with the rewritten answer only.\n\n"
                   f"[Question]\n{prompts[i]}\n\n[Answer]\n{answers[i]}")
        return client.complete(model, content, params).text.strip()

    for i, got in run_pool(list(range(len(answers))), one, concurrency, client.stop):
        if isinstance(got, JudgementFailed):
            continue  # kept failing: no anchor row for this prompt
        if isinstance(got, BaseException):
            raise got
        out[i] = got or None
    return out


def rewrite_key(model: str, style: str, prompt: str, answer: str, params: Mapping[str, Any]) -> str:
    fields = {"model": model, "style": style, "instruction": REWRITE_STYLES[style], "prompt": prompt, "answer": answer, "params": params}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def length_anchors(pairs: list[Pair], out: Path, s: dict, environ, judges: list[str], *, judge_pairs, params: dict,
                   answer_length) -> dict[str, list]:
    """The length anchors of every judge: B's answers rewritten verbose and concise (cached in
    ``OUT/anchors/rewrites.jsonl``, keyed like judgements), each rewrite judged against B in both orders
    (``OUT/anchors/<style>/``, with its own cache). Returns ``{judge: [(outcomes, lengths) per style]}``,
    one entry per pair, None where a rewrite or its verdict is missing. ``judge_pairs``, ``params`` and
    ``answer_length`` are :mod:`dllm_align.judge.run`'s, passed in (that module calls this one)."""
    model = s["length_anchors_model"] or next(j for j in judges if not j.startswith("rule:"))
    folder = out / "anchors"
    folder.mkdir(parents=True, exist_ok=True)
    cache_path = folder / "rewrites.jsonl"
    cache = {r["key"]: r for r in recover_jsonl(cache_path)
             if isinstance(r.get("text"), str) and isinstance(r.get("key"), str)}
    texts: dict[str, list[Optional[str]]] = {}
    client = None
    try:
        for style in REWRITE_STYLES:
            keys = [rewrite_key(model, style, p.prompt, p.b, params) for p in pairs]
            todo = [i for i, k in enumerate(keys) if k not in cache]
            if todo:
                if client is None:
                    client = ChatClient(s["base_url"], read_api_key(s["api_key_env"], environ), api_key_env=s["api_key_env"] or "(none)",
                                        timeout=s["timeout"], max_retries=s["max_retries"], retry_base_delay=s["retry_base_delay"],
                                        retry_max_delay=s["retry_max_delay"], retry_after_max=s["retry_after_max"],
                                        concurrency=s["concurrency"], allow_plain_http=s["allow_plain_http"], env_proxy=s["env_proxy"])
                info(f"length anchors: rewriting {len(todo)} of B's answers {style} with {model} ({len(pairs) - len(todo)} cached)")
                got = rewrite_for_length(client, model, [pairs[i].prompt for i in todo], [pairs[i].b for i in todo], style, params,
                                         s["concurrency"])
                app = JsonlAppender(cache_path)
                try:
                    for i, t in zip(todo, got):
                        if t:
                            row = {"key": keys[i], "id": pairs[i].id, "style": style, "model": model, "text": client.scrub(t)}
                            app.write(row)
                            cache[keys[i]] = row
                finally:
                    app.close()
            texts[style] = [cache[k]["text"] if k in cache else None for k in keys]
    finally:
        if client is not None:
            client.close()
    sub_settings = {**s, "length_anchors": False, "difficulty_from": None, "difficulty_table": None}
    anchors: dict[str, list] = {j: [] for j in judges}
    for style, rewritten in texts.items():
        sub = [Pair(p.id, p.prompt, t, p.b, p.reference) for p, t in zip(pairs, rewritten) if t]
        missing = len(pairs) - len(sub)
        if missing:
            warn(f"length anchors: {missing} of B's answers have no {style} rewrite (the request kept failing or the reply was empty)")
        by_id: dict[str, dict] = {}
        if sub:
            res = judge_pairs(sub, folder / style, sub_settings, environ=environ, labels=(f"B rewritten {style}", "B"))
            by_id = {r["id"]: r["judges"] for r in res.outcomes}
        for j in judges:
            outs, lens = [], []
            for p, t in zip(pairs, rewritten):
                name = (by_id.get(p.id) or {}).get(j, {}).get("outcome") if t else None
                outs.append(stats.OUTCOME_CODES[name] if name else None)
                lens.append(answer_length(t) if t else None)
            anchors[j].append((outs, lens))
    return anchors


def difficulty_from(source: str, pairs: list[Pair], judges: list[str]) -> dict[str, list]:
    """The instruction-difficulty term: a second model's outcome against the same B per prompt (by id), from
    its judge run's ``outcomes.jsonl`` (or the run folder); None where that run has none (a tie in the fit)."""
    path = Path(source)
    if path.is_dir():
        path = path / "outcomes.jsonl"
    if not path.is_file():
        raise UserError(f"--difficulty-from {source}: no such file (a judge run's outcomes.jsonl or its folder)")
    note_input(path, "input")
    rows: dict[str, dict] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):
            r = None
        judged = r.get("judges") if isinstance(r, dict) else None
        if not isinstance(r, dict) or not isinstance(r.get("id"), (str, int)) or not isinstance(judged or {}, dict) \
                or not all(isinstance(v, dict) and isinstance(v.get("outcome"), (str, type(None)))
                           for v in (judged or {}).values()):
            raise UserError(f"{path}:{n}: not an outcomes row (an object with id and judges: "
                            "{judge: {outcome: a name}}), as judge writes them")
        rows[str(r["id"])] = judged or {}
    out = {}
    for j in judges:
        vals = []
        for p in pairs:
            name = ((rows.get(p.id) or {}).get(j) or {}).get("outcome")
            if name and name not in stats.OUTCOME_CODES:
                raise UserError(f"{path}: id {p.id!r}: outcome {name[:40]!r} of judge {j} is not one judge writes "
                                f"({', '.join(stats.OUTCOME_CODES)})")
            vals.append(stats.OUTCOME_CODES.get(name) if name else None)
        if all(v is None for v in vals):
            raise UserError(f"{path}: no outcome of judge {j} for these prompts",
                            hint="judge the second model against the same B, on the same prompts, with the same judge")
        out[j] = vals
    return out


def difficulty_table(source: str, pairs: list[Pair]) -> tuple[Optional[list[float]], dict]:
    """A published per-instruction difficulty table (AlpacaEval's, for its 805 prompts), matched by the
    prompt's text: a CSV with a ``difficulty`` column and an ``instruction`` or ``instruction_sha256`` column
    (:func:`dllm_align.judge.stats.instruction_key`). Returns the per-pair values, or None when some prompt is
    not in the table (the term is then left out), and the provenance recorded in results.json."""
    path = Path(source)
    if not path.is_file():
        raise UserError(f"--difficulty-table {source}: no such file (a CSV: instruction or instruction_sha256, difficulty)")
    note_input(path, "input")
    raw = path.read_bytes()
    table: dict[str, float] = {}
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = set(reader.fieldnames or ())
        if "difficulty" not in cols or not cols & {"instruction", "instruction_sha256"}:
            raise UserError(f"{path}: a difficulty table has the columns difficulty and instruction (or instruction_sha256)")
        for n, r in enumerate(reader, 2):
            key = r["instruction_sha256"] if "instruction_sha256" in cols else stats.instruction_key(r["instruction"])
            try:
                table[key] = float(r["difficulty"])
            except ValueError:
                raise UserError(f"{path}:{n}: difficulty {r['difficulty']!r} is not a number") from None
    values, matched = stats.difficulty_lookup([p.prompt for p in pairs], table)
    note = {"source": "table", "path": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "instructions": len(table),
            "matched": matched, "prompts": len(pairs), "used": values is not None}
    if values is None:
        warn(f"--difficulty-table {path}: {matched} of {len(pairs)} prompts are in the table; the LC fit goes "
             "without the difficulty term (it is used only when every prompt is)")
    else:
        info(f"LC-AWR: instruction difficulty from {path} ({matched} prompts matched)")
    return (None if values is None else [float(v) for v in values]), note
