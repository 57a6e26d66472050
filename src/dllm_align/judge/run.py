"""Pairwise judging of two sets of generations: docs/design.md#judging, paper Appendix C.

For every prompt, the completion of model A (the tuned model) and of model B
(the base model) are shown to a judge twice, A first and B first. The verdicts
become per-prompt outcomes, adjusted win rates with bootstrap intervals, their
length-controlled twins, and with two judges a majority vote and Cohen's kappa
(:mod:`dllm_align.judge.stats`, :mod:`dllm_align.judge.report`).

Judges:

* any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, SGLang, ...),
  through the ``openai`` SDK (:mod:`dllm_align.judge.client`: only --base-url,
  bounded concurrency, deadlines, retries), live or with ``--batch`` through
  the Batch API (:mod:`dllm_align.judge.batch`);
* ``rule:NAME`` judges for tasks whose preference is computable, from a small
  registry (:func:`register_rule`, :func:`register_scorer`), or
  ``rule:package.module:function`` for a function of the user's own.

Every finished API judgement is appended to ``DIR/cache.jsonl`` under a hash of
everything that determines the request (:mod:`dllm_align.judge.cache`), so a
rerun, a resumed run or a batch never sends a request twice. Rule judgements
are cheap and always recomputed (a cached rule verdict would go stale when the
rule's code changes).

Failed judgements (a request that kept failing, or a verdict that could not be
parsed after ``max_parse_retries`` further tries) are *excluded*: a prompt
counts for a judge only when both of its orders were judged, each judge's
``n`` is reported, and the majority vote and kappa use the prompts both judges
finished. Counting failures as ties would pull every AWR towards 50% without
saying so. Failures are not cached, so running the same command again retries
them.

The API key is read from the environment variable named by ``api_key_env`` and
sent only in the ``Authorization`` header to the configured base URL. It is
scrubbed from every message and stored reply; it is never written under DIR.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from dllm_align.config.schema import JudgeSection
from dllm_align.core.console import info, progress, progress_enabled, warn
from dllm_align.core.errors import DllmAlignError, RunFailure, UserError
from dllm_align.core.io import DirLock, atomic_write_json, atomic_write_text
from dllm_align.core.usercode import call_named, load_function
from dllm_align.judge import stats
from dllm_align.judge.anchors import difficulty_from, difficulty_table, length_anchors
from dllm_align.judge.batch import BatchRunner, pending_batches
from dllm_align.judge.cache import CacheWriter, Task, add_usage, judgement_key, load_cache
# The transport, the cache, the batch flow and the report live in their own modules; the names the library's
# judging API had here stay importable from here (hence the noqa F401).
from dllm_align.judge.client import (  # noqa: F401
    Cancelled, ChatClient, FatalApiError, JudgementFailed, Reply, Scrubber, ServerAskedToWait, read_api_key, run_pool,
)
from dllm_align.judge.inputs import (  # noqa: F401
    DEFAULT_TEMPLATE,
    ORDERS,
    PLACEHOLDERS,
    GenRow,
    Pair,
    check_template,
    completion_text,
    load_template,
    match_rows,
    parse_verdict,
    prompt_text,
    read_generations,
    render,
)
from dllm_align.judge.report import (  # noqa: F401
    length_report, print_table, results_markdown, strict_results, summarize_outcomes, table_rows, usage_lines, usage_report,
)

# =========================================================================== rule judges
RuleFn = Callable[[str, str, str, Optional[str]], str]
_RULES: dict[str, RuleFn] = {}
_RULE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
# Built-in rules that live with their task, registered on first use (so importing this module stays
# light, and the task's module needs to know nothing of judging): name -> (module, function).
_BUILTIN_RULES = {"sort": ("dllm_align.data.toy", "rule_verdict")}


def _check_rule_name(name: str, replace: bool) -> None:
    if not _RULE_NAME_RE.match(name):
        raise ValueError(f"rule name {name!r}: use lowercase letters, digits, '-', '_' or '.'")
    if name in _RULES and not replace:
        raise ValueError(f"a rule named {name!r} is already registered (pass replace=True)")


def register_rule(name: str, fn: Callable[[str, str, str], str] | None = None, *, replace: bool = False):
    """Register a pairwise rule judge, usable as ``--judge rule:NAME``.

    ``fn(prompt, answer_a, answer_b)`` returns ``"A"`` if the answer shown first
    is better, ``"B"`` if the second is, ``"C"`` for a tie. It is called for both
    orders, like an LLM judge. Usable as a decorator: ``@register_rule("name")``.
    """

    def deco(f: Callable[[str, str, str], str]):
        _check_rule_name(name, replace)
        _RULES[name] = lambda p, a, b, ref: f(p, a, b)
        return f

    return deco(fn) if fn is not None else deco


def register_scorer(name: str, fn: Callable[[str, str, Optional[str]], float] | None = None, *, replace: bool = False):
    """Register a scoring rule judge, usable as ``--judge rule:NAME``.

    ``fn(prompt, answer, reference)`` returns a number, higher is better;
    ``reference`` is the row's optional ``reference`` field (``None`` if absent).
    The verdict prefers the higher score; equal scores are a tie.
    """

    def deco(f: Callable[[str, str, Optional[str]], float]):
        _check_rule_name(name, replace)

        def rule(p: str, a: str, b: str, ref: Optional[str]) -> str:
            sa, sb = f(p, a, ref), f(p, b, ref)
            return "A" if sa > sb else "B" if sb > sa else "C"

        _RULES[name] = rule
        return f

    return deco(fn) if fn is not None else deco


def rule_names() -> list[str]:
    _load_rule_modules()
    return sorted(_RULES)


def _load_rule_modules() -> None:
    for name, (mod, fn) in _BUILTIN_RULES.items():
        if name not in _RULES:
            register_rule(name, getattr(importlib.import_module(mod), fn))


def user_function(spec: str, label: str) -> tuple[Callable, str]:
    """The function ``package.module:function`` names, announced on stderr: the one place dllm-align runs code
    that a flag or a recipe names (rule judges here, verifiers in :mod:`dllm_align.online.verifiers`); what is
    contained of it (printing, exiting, hanging) is :mod:`dllm_align.core.usercode`."""
    return load_function(spec, label)


def get_rule(name: str) -> RuleFn:
    """The rule for ``NAME`` (without the ``rule:`` prefix): a registered name, or
    ``package.module:function`` naming a pairwise function ``(prompt, answer_a, answer_b) -> "A"|"B"|"C"``."""
    if ":" in name:
        f, attr = user_function(name, f"rule:{name}")

        try:  # a judging rule takes (prompt, answer_a, answer_b); anything else is refused before it runs
            inspect.signature(f).bind("", "", "")
        except TypeError:
            raise UserError(
                f"rule:{name}: {attr}() is not a judging rule: it must take (prompt, answer_a, answer_b) "
                "and return 'A', 'B' or 'C'"
            ) from None
        except ValueError:  # no signature to read (some builtins): its first call will tell
            pass
        # contained as label contains a verifier: printing, exiting, hanging, and an exception named by the function
        return lambda p, a, b, ref: call_named(f, (p, a, b), f"rule:{name}", attr, "a pair")
    if name not in _RULES:
        _load_rule_modules()
    if name not in _RULES:
        close = difflib.get_close_matches(name, list(_RULES), n=1)
        raise UserError(
            f"unknown rule judge 'rule:{name}'",
            hint=(f"did you mean 'rule:{close[0]}'? " if close else "") + "known rules: " + ", ".join(f"rule:{r}" for r in sorted(_RULES)),
        )
    return _RULES[name]


@register_rule("longer")
def _longer(prompt: str, answer_a: str, answer_b: str) -> str:
    """Example rule: the longer answer (in characters, surrounding space ignored) wins; equal lengths tie."""
    la, lb = len(answer_a.strip()), len(answer_b.strip())
    return "A" if la > lb else "B" if lb > la else "C"


class MissingReference(UserError):
    pass


@register_scorer("exact-match")
def _exact_match(prompt: str, answer: str, reference: Optional[str]) -> float:
    """Example rule: 1 if the answer equals the row's ``reference`` (surrounding space ignored), else 0."""
    if reference is None:
        raise MissingReference("rule:exact-match needs a 'reference' field in the rows")
    return float(answer.strip() == reference.strip())


# =========================================================================== the run
__all__ = [
    "ChatClient", "Scrubber", "Task", "judge_files", "judge_pairs", "judgement_key", "load_cache", "parse_verdict",
    "print_table", "read_api_key", "register_rule", "register_scorer", "results_markdown", "summarize_outcomes",
    "table_rows", "Reply", "Cancelled", "FatalApiError", "JudgementFailed",
]


def _shown(pair: Pair, order: str) -> tuple[str, str]:
    return (pair.a, pair.b) if order == "AB" else (pair.b, pair.a)


@dataclass
class JudgeRunResult:
    results: dict
    outcomes: list[dict]
    failed: int
    output: Path


def _settings_dict(settings) -> dict:
    if isinstance(settings, JudgeSection):
        return settings.model_dump()
    return JudgeSection.model_validate(dict(settings)).model_dump()


def request_params(s: Mapping[str, Any]) -> dict:
    """Sampling parameters sent with every judging request. Reasoning models reject
    ``max_tokens`` (and any ``temperature`` but their default): with
    ``max_completion_tokens`` set, that replaces ``max_tokens``, and a ``None``
    temperature is not sent at all."""
    p: dict[str, Any] = {}
    if s["temperature"] is not None:
        p["temperature"] = s["temperature"]
    if s["max_completion_tokens"] is not None:
        p["max_completion_tokens"] = s["max_completion_tokens"]
    else:
        p["max_tokens"] = s["max_tokens"]
    return p


def answer_length(text: str) -> int:
    """Length of an answer for length control: characters, surrounding space ignored."""
    return len(text.strip())


def judge_pairs(
    pairs: list[Pair],
    output: str | Path,
    settings,
    *,
    environ: Mapping[str, str] | None = None,
    labels: tuple[str, str] = ("A", "B"),
) -> JudgeRunResult:
    """Judge every pair in both orders with every judge of ``settings`` (a
    :class:`dllm_align.config.recipe.JudgeSection`), and write ``results.json``,
    ``results.md`` and ``outcomes.jsonl`` into ``output``.

    Returns the results; ``failed`` > 0 means some judgements are missing (their
    prompts are excluded for that judge, see the module docstring).
    """
    s = _settings_dict(settings)
    judges, template, rules, api_judges = _judges_of(s)
    difficulty, difficulty_note = None, None
    if s["difficulty_from"]:
        difficulty = difficulty_from(s["difficulty_from"], pairs, judges)
    elif s["difficulty_table"]:
        values, difficulty_note = difficulty_table(s["difficulty_table"], pairs)
        difficulty = None if values is None else {j: values for j in judges}
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} exists and is not a folder")
    stop = threading.Event()
    client = _api_client(s, environ, stop) if api_judges else None
    # verdicts[(judge, pair index, order)] = "A" | "B" | "C"; errors[...] = message
    verdicts = _rule_verdicts(rules, pairs)
    errors: dict[tuple[str, int, str], str] = {}

    out.mkdir(parents=True, exist_ok=True)
    params = request_params(s)
    token_param = "max_completion_tokens" if s["max_completion_tokens"] is not None else "max_tokens"
    # One judge run per output folder at a time (two would interleave cache lines and repeat requests).
    with DirLock(out, f"another `dllm-align judge` run is writing to {out}"):
        cache_path = out / "cache.jsonl"
        cache = load_cache(cache_path)
        slots, tasks = _requests(pairs, api_judges, template, s, params, token_param, cache)
        used_keys = set(slots)
        if api_judges:
            done = len(used_keys) - len(tasks)
            how = "as a batch" if s["batch"] else f"concurrency {s['concurrency']}"
            info(f"Judging {len(pairs)} prompts x 2 orders with {', '.join(api_judges)}: {len(used_keys)} distinct judgements, "
                 f"{done} in {cache_path.name}, {len(tasks)} to request ({how})")
        _fetch(tasks, client, s, params, out, cache_path, cache, slots, errors, stop)
        for k, where in slots.items():
            if k in cache:
                for slot in where:
                    verdicts[slot] = cache[k]["verdict"]

        per_judge, outcome_rows, len_a, len_b = _outcomes(pairs, judges, verdicts, errors)
        failed = sum(1 for k in tasks if k not in cache)  # distinct API judgements still missing
        results: dict[str, Any] = {"n": len(pairs), "a": labels[0], "b": labels[1]}
        anchors = None
        if s["length_anchors"]:
            anchors = length_anchors(pairs, out, s, environ, judges, judge_pairs=judge_pairs, params=params, answer_length=answer_length)
        results.update(summarize_outcomes(per_judge, lengths=(len_a, len_b), bootstrap=s["bootstrap"], seed=s["seed"],
                                          anchors=anchors, difficulty=difficulty,
                                          published_difficulty=difficulty_note is not None))
        if difficulty_note is not None:
            results["lc_difficulty"] = difficulty_note
        results["lengths"] = length_report(len_a, len_b, s["length_threshold"])
        if len(judges) == 2:
            j1, j2 = judges
            for i, row in enumerate(outcome_rows):
                a, b = per_judge[j1][i], per_judge[j2][i]
                row["majority_vote"] = stats.OUTCOME_NAMES[int(stats.majority_vote([a], [b])[0])] if a is not None and b is not None else None
        results["failed_judgements"] = failed
        # of which the judge answered but never with a verdict (after the re-ask)
        results["unjudgeable_judgements"] = sum(
            1 for k, where in slots.items() if k not in cache and any(errors.get(w, "").startswith(UNJUDGEABLE) for w in where))
        used_rows = [cache[k] for k in sorted(used_keys & set(cache))]
        if used_rows:
            results["usage"] = usage_report(used_rows, s["prices"], s["batch_price_factor"])
            for line in usage_lines(results):
                info(line)
        results["settings"] = _recorded_settings(s, template, token_param, api_judges)
        results = strict_results(results)
        # results.json last: it is the run's "done" record, so a full disk can leave the per-prompt
        # outcomes without the results, never results that point at outcomes that are not there.
        atomic_write_text(out / "outcomes.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in outcome_rows))
        atomic_write_text(out / "results.md", results_markdown(results))
        atomic_write_json(out / "results.json", results)
    return JudgeRunResult(results, outcome_rows, failed, out)


def _judges_of(s: dict) -> tuple[list[str], str, dict[str, RuleFn], list[str]]:
    """The judges (refused unless one or two, distinct), the template, the rule judges by name and the API ones."""
    judges: list[str] = list(s["judges"])
    if not 1 <= len(judges) <= 2:
        raise UserError(f"give one or two judges, got {len(judges)}", hint="majority vote and Cohen's kappa are defined for two judges")
    if len(set(judges)) != len(judges):
        raise UserError(f"the same judge is given twice: {judges[0]}")
    template = load_template(s["template"])
    rules = {j: get_rule(j[len("rule:"):]) for j in judges if j.startswith("rule:")}
    api_judges = [j for j in judges if j not in rules]
    if s["length_anchors"] and not (s["length_anchors_model"] or api_judges):
        raise UserError("--length-anchors: no model to rewrite B's answers (the judges are all rules)",
                        hint="name one with --anchors-model MODEL (judge.length_anchors_model)")
    return judges, template, rules, api_judges


def _api_client(s: dict, environ: Mapping[str, str] | None, stop: threading.Event) -> ChatClient:
    key = read_api_key(s["api_key_env"], environ)
    return ChatClient(
        s["base_url"], key, api_key_env=s["api_key_env"] or "(none)", timeout=s["timeout"], max_retries=s["max_retries"],
        retry_base_delay=s["retry_base_delay"], retry_max_delay=s["retry_max_delay"],
        retry_after_max=s["retry_after_max"], concurrency=s["concurrency"],
        allow_plain_http=s["allow_plain_http"], env_proxy=s["env_proxy"], stop=stop,
    )


def _rule_verdicts(rules: dict[str, RuleFn], pairs: list[Pair]) -> dict[tuple[str, int, str], str]:
    """The rule judges' verdicts, both orders of every pair; a verdict other than A, B or C stops the run."""
    verdicts: dict[tuple[str, int, str], str] = {}
    for j, rule in rules.items():
        for i, p in enumerate(pairs):
            for order in ORDERS:
                first, second = _shown(p, order)
                try:
                    v = rule(p.prompt, first, second, p.reference)
                except DllmAlignError as e:
                    raise type(e)(f"{e.message} (id {p.id!r})", e.hint) from None
                if v not in ("A", "B", "C"):
                    raise RunFailure(f"{j} returned {v!r} for id {p.id!r}; a rule must return 'A', 'B' or 'C'")
                verdicts[(j, i, order)] = v
    return verdicts


def _requests(pairs: list[Pair], api_judges: list[str], template: str, s: dict, params: dict, token_param: str,
              cache: dict) -> tuple[dict[str, list[tuple[str, int, str]]], dict[str, Task]]:
    """Every API judgement the run uses (key -> the (judge, i, order) slots it answers) and those not cached yet."""
    slots: dict[str, list[tuple[str, int, str]]] = {}
    tasks: dict[str, Task] = {}
    for j in api_judges:
        for i, p in enumerate(pairs):
            for order in ORDERS:
                first, second = _shown(p, order)
                k = judgement_key(j, template, p.prompt, first, second, s["temperature"], params[token_param], token_param)
                slots.setdefault(k, []).append((j, i, order))
                if k not in cache and k not in tasks:
                    tasks[k] = Task(k, j, order, p.id, render(template, p.prompt, first, second))
    return slots, tasks


def _fetch(tasks: dict[str, Task], client: Optional[ChatClient], s: dict, params: dict, out: Path, cache_path: Path,
           cache: dict, slots, errors, stop: threading.Event) -> None:
    """Ask for ``tasks`` (answers go into ``cache`` and its file) and close the client; an error that stopped the
    run is raised here, saying how many judgements a rerun finds cached."""
    used_keys = set(slots)
    fatal: Optional[FatalApiError] = None
    with CacheWriter(cache_path, cache) as writer:
        try:
            if tasks:
                fatal = _obtain(tasks, client, s, params, out, writer, slots, errors, stop, len(used_keys) - len(tasks))
        except BaseException:
            if client is not None:
                client.abort()  # Ctrl-C or a bug: do not wait for requests in flight
            raise
        finally:
            if client is not None:
                client.close()
    if isinstance(fatal, ServerAskedToWait):
        have = sum(1 for k in used_keys if k in cache)
        raise RunFailure(str(fatal), hint=f"{have} of {len(used_keys)} judgements are in {cache_path}; the rerun asks only "
                         "for the others (or raise --retry-after-max, at most 86400 s, to wait as long as the server asks)")
    if fatal is not None:
        raise (UserError(str(fatal)) if fatal.user_error else RunFailure(str(fatal)))


def _outcomes(pairs: list[Pair], judges: list[str], verdicts: dict, errors: dict
              ) -> tuple[dict[str, list[Optional[int]]], list[dict], list[int], list[int]]:
    """Each judge's outcome per pair (None unless both orders were judged), the rows of outcomes.jsonl, and the
    answers' lengths."""
    per_judge: dict[str, list[Optional[int]]] = {}
    outcome_rows = []
    len_a = [answer_length(p.a) for p in pairs]
    len_b = [answer_length(p.b) for p in pairs]
    for i, p in enumerate(pairs):
        row: dict[str, Any] = {"id": p.id, "length_a": len_a[i], "length_b": len_b[i], "judges": {}}
        for j in judges:
            vab, vba = verdicts.get((j, i, "AB")), verdicts.get((j, i, "BA"))
            o = stats.pair_outcome(vab, vba) if vab is not None and vba is not None else None
            per_judge.setdefault(j, []).append(o)
            entry: dict[str, Any] = {"AB": vab, "BA": vba, "outcome": stats.OUTCOME_NAMES[o] if o is not None else None}
            errs = [errors[(j, i, od)] for od in ORDERS if (j, i, od) in errors]
            if errs:
                entry["error"] = "; ".join(errs)
            row["judges"][j] = entry
        outcome_rows.append(row)
    return per_judge, outcome_rows, len_a, len_b


def _recorded_settings(s: dict, template: str, token_param: str, api_judges: list[str]) -> dict[str, Any]:
    """results.json's record of how the judgements were made."""
    return {
        "base_url": s["base_url"] if api_judges else None,
        "template": s["template"] or "built-in",
        "template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "temperature": s["temperature"],
        "max_tokens": s["max_tokens"] if token_param == "max_tokens" else None,
        "max_completion_tokens": s["max_completion_tokens"],
        "mode": ("batch" if s["batch"] else "live") if api_judges else "rules",
        "bootstrap_resamples": s["bootstrap"],
        "seed": s["seed"],
        "ci_level": 0.9,
        "length_control": "logistic GLM of the outcome on tanh(standardised length difference) (+ instruction "
                          "difficulty, + length anchors at weight 0.1 when given), A-longer and B-longer prompts "
                          "weighted equally; LC-AWR = prediction at zero difference, withheld when the slope is not identified "
                          "or, with neither anchors nor a difficulty term, when the length correction exceeds 5 points",
        "length_anchors": (s["length_anchors_model"] or api_judges[0]) if s["length_anchors"] else None,
        "difficulty_from": s["difficulty_from"],
        "difficulty_table": s["difficulty_table"],
        "length_unit": "characters",
        "failures": "excluded: a prompt counts for a judge only when both orders were judged",
    }


def _obtain(tasks: dict[str, Task], client: ChatClient, s: dict, params: dict, out: Path, writer, slots, errors,
            stop: threading.Event, already: int) -> Optional[FatalApiError]:
    """Get the judgements of ``tasks`` live or through the Batch API (failed batch
    requests are retried live, or in new batches with ``batch_failed: batch``).
    Returns a fatal error if one stopped the run."""
    if not s["batch"]:
        busy = {name: n for name, keys in pending_batches(out).items() if (n := len(set(keys) & set(tasks)))}
        if busy:  # asking live would send requests a batch on the server is answering
            name, n = next(iter(busy.items()))
            raise UserError(f"{n} of these judgements are in {name}, a batch an earlier --batch run of {out} left on the server",
                            hint=f"run the same command with --batch to collect it; or move {out / 'batch_state.json'} away to abandon it")
        return _run_live(list(tasks.values()), client, s, params, writer, slots, errors, stop, already)

    runner = BatchRunner(client, out, params, writer, parse_verdict, poll_interval=s["batch_poll_interval"],
                         poll_max=s["batch_poll_max"], stop=stop)
    rounds = s["batch_rounds"] if s["batch_failed"] == "batch" else 1
    try:
        why = runner.run(tasks, rounds)
    except FatalApiError as e:
        return e
    except JudgementFailed as e:
        raise RunFailure(client.scrub(f"the batch could not go on: {e}"),
                         hint="run the same command again: it continues each batch from the stage it reached")
    live = [k for k in why if k not in runner.settled and k not in runner.conflicted]  # a conflict is decided by batches
    if live and s["batch_failed"] == "live":
        info(f"Retrying {len(live)} judgement(s) that failed in the batch live")
        fatal = _run_live([tasks[k] for k in live], client, s, params, writer, slots, errors, stop, len(tasks) - len(live) + already)
        why = {k: m for k, m in why.items() if k not in live}
        if fatal is not None:
            return fatal
    for k, msg in why.items():
        for slot in slots[k]:
            errors[slot] = msg
    return None


# How a judgement that never gave a verdict is marked, and the question that re-asks for one.
UNJUDGEABLE = "unjudgeable"
VERDICT_FOLLOW_UP = ("Your reply above gives no final verdict. Answer with exactly one of [[A]] (the first answer is "
                     "better), [[B]] (the second is better) or [[C]] (a tie), and nothing else.")


def _run_live(tasks: list[Task], client: ChatClient, s: dict, params: dict, writer, slots, errors, stop: threading.Event,
              already: int) -> Optional[FatalApiError]:
    """Run the API judgements on a bounded pool of daemon threads; the main thread
    appends each finished one to the cache, so lines never interleave."""
    max_parse = s["max_parse_retries"]

    def work(t: Task) -> tuple[str, Reply, int, dict]:
        replies: list[str] = []
        usage: dict = {}
        history: tuple = ()
        cut = False
        for _ in range(max_parse + 1):
            reply = client.complete(t.judge, t.content, params, history)
            add_usage(usage, reply.usage)  # every try is paid for
            v = parse_verdict(reply.text)
            if v is not None:
                return v, reply, len(replies) + 1, usage
            replies.append(reply.text)
            cut = cut or reply.finish_reason == "length"
            # Re-ask differently: the same request would most likely get the same reply (a paid call for
            # nothing); show the judge its reply and ask for the verdict alone.
            history = ({"role": "assistant", "content": reply.text}, {"role": "user", "content": VERDICT_FOLLOW_UP})
        snippet = " ".join(replies[-1].split())[-120:] if replies else ""
        raise JudgementFailed(f"{UNJUDGEABLE}: no [[A]]/[[B]]/[[C]] verdict in {len(replies)} replies"
                              + (" (a reply was cut off at the token cap, finish_reason 'length': raise --max-tokens)" if cut else "")
                              + f" (last ends: {snippet!r})")

    total = already + len(tasks)
    requests_before = client.stats.requests
    fatal = None
    n_failed = 0
    t0 = last_log = time.monotonic()
    done_now = 0
    with progress("judging", total, unit="judgements") as bar:
        bar.advance(already)
        for t, res in run_pool(tasks, work, s["concurrency"], stop):
            if isinstance(res, Cancelled):
                continue
            if isinstance(res, JudgementFailed):
                n_failed += 1
                msg = client.scrub(str(res))
                for slot in slots[t.key]:
                    errors[slot] = msg
                if n_failed <= 3:  # show why; the rest are in outcomes.jsonl
                    warn(f"judgement failed ({t.judge}, id {t.id!r}, order {t.order}): {msg}"
                         + ("; further failures are counted, not shown" if n_failed == 3 else ""))
            elif isinstance(res, ServerAskedToWait):
                # No new request starts (the client holds them all), but the ones in flight are not cut:
                # their verdicts are cached as they arrive; the tasks not sent are left for the rerun.
                if fatal is None:
                    fatal = res
                continue
            elif isinstance(res, FatalApiError):
                if fatal is None:
                    fatal = res
                stop.set()
                continue
            elif isinstance(res, BaseException):  # a bug: stop, but never echo a secret
                stop.set()
                raise RunFailure(client.scrub(f"judging id {t.id!r} failed unexpectedly: {type(res).__name__}: {res}"))
            else:
                verdict, reply, tries, usage = res
                writer.add({"key": t.key, "judge": t.judge, "id": t.id, "order": t.order, "verdict": verdict,
                            "reply": reply.text, "usage": usage, "tries": tries, "mode": "live"})
                for slot in slots[t.key]:
                    errors.pop(slot, None)
            done_now += 1
            retried = sum(client.stats.retries.values())
            bar.advance(1, status=f"failed {n_failed}, retried {retried}")
            now = time.monotonic()
            if not progress_enabled() and now - last_log > 30:
                last_log = now
                info(f"judged {already + done_now}/{total} ({done_now / (now - t0):.2f} judgements/s), failed {n_failed}, retried {retried}")
    elapsed = time.monotonic() - t0
    retries = client.stats.retries
    info(
        f"{done_now} judgement(s) in {elapsed:.1f} s ({done_now / elapsed if elapsed > 0 else 0:.2f}/s), "
        f"{client.stats.requests - requests_before} request(s)"
        + (", retries: " + ", ".join(f"{k} x{v}" for k, v in sorted(retries.items())) if retries else "")
    )
    return fatal


# =========================================================================== files in, results out
def judge_files(a_path: str | Path, b_path: str | Path, output: str | Path, settings, *, strict: bool = False,
                environ: Mapping[str, str] | None = None) -> JudgeRunResult:
    """Read two generation files, match rows by id, and judge them (:func:`judge_pairs`)."""
    rows_a, rows_b = read_generations(a_path), read_generations(b_path)
    pairs = match_rows(rows_a, rows_b, strict=strict, names=(str(a_path), str(b_path)))
    return judge_pairs(pairs, output, settings, environ=environ, labels=(str(a_path), str(b_path)))
