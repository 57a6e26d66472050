"""``dllm-align judge``: pairwise judging of two generation files (docs/design.md#judging).

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dllm_align.cli.app import command, given, schema_default

def _shown(key: str) -> str:
    return schema_default(f"judge.{key}")


def _parse_prices(values: list[str]) -> dict:
    """``--price [JUDGE=]IN,OUT`` (USD per million prompt / completion tokens) -> {judge or '*': (IN, OUT)}."""
    from dllm_align.core.errors import UserError

    prices = {}
    for v in values:
        judge, _, nums = v.rpartition("=") if "=" in v else ("*", "", v)
        parts = nums.split(",")
        try:
            if len(parts) != 2:
                raise ValueError
            prices[judge or "*"] = (float(parts[0]), float(parts[1]))
        except ValueError:
            raise UserError(f"--price {v!r}: expected [JUDGE=]IN,OUT in USD per million prompt and completion tokens, e.g. 0.15,0.60")
    return prices


@command("judge")
def judge(
    a: Annotated[Path, typer.Argument(metavar="A.jsonl", help="Generations of model A (the tuned model): JSONL or JSON rows with id, prompt, completion.")],
    b: Annotated[Path, typer.Argument(metavar="B.jsonl", help="Generations of model B (the base model), same ids and prompts.")],
    output: Annotated[
        Optional[Path],
        typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder for the results, outcomes and cache. Default: <A's folder>/judge_<B's folder>_<B's name>."),
    ] = None,
    judges: Annotated[
        Optional[list[str]],
        typer.Option("--judge", "-j", metavar="MODEL", show_default=_shown("judges"), help="Judge model at --base-url, or rule:NAME. Give it twice for two judges (majority vote, kappa)."),
    ] = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Recipe whose `judge` section gives the defaults.")] = None,
    base_url: Annotated[Optional[str], typer.Option(show_default=_shown("base_url"), help="OpenAI-compatible endpoint; the only host contacted.")] = None,
    api_key_env: Annotated[
        Optional[str], typer.Option(show_default=_shown("api_key_env"), help="Environment variable holding the API key ('' for a server without authentication).")
    ] = None,
    template: Annotated[
        Optional[Path],
        typer.Option(show_default="the built-in pairwise prompt", help="Judging prompt file with {prompt}, {answer_a}, {answer_b} placeholders."),
    ] = None,
    concurrency: Annotated[Optional[int], typer.Option(show_default=_shown("concurrency"), help="Requests in flight at once.")] = None,
    timeout: Annotated[Optional[float], typer.Option(show_default=_shown("timeout"), help="Seconds before a request counts as timed out and is retried.")] = None,
    max_retries: Annotated[Optional[int], typer.Option(show_default=_shown("max_retries"), help="Retries of one request (429, 5xx, timeouts, dropped connections).")] = None,
    retry_delay: Annotated[Optional[float], typer.Option(show_default=_shown("retry_base_delay"), help="First backoff delay in seconds (doubles each retry, with jitter).")] = None,
    retry_after_max: Annotated[Optional[float], typer.Option(show_default=_shown("retry_after_max"), help="Longest wait in seconds a server's Retry-After may impose (longer asks are capped, with a warning).")] = None,
    max_parse_retries: Annotated[Optional[int], typer.Option(show_default=_shown("max_parse_retries"), help="Re-asks for the verdict alone when a reply has none; then the judgement is unjudgeable.")] = None,
    bootstrap: Annotated[Optional[int], typer.Option(show_default=_shown("bootstrap"), help="Bootstrap resamples for the 90% intervals (paper: 5000).")] = None,
    seed: Annotated[Optional[int], typer.Option(show_default=_shown("seed"), help="Bootstrap seed.")] = None,
    temperature: Annotated[Optional[float], typer.Option(show_default=_shown("temperature"), help="Judge sampling temperature.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(show_default=_shown("max_tokens"), help="Cap on the judge's reply length.")] = None,
    max_completion_tokens: Annotated[
        Optional[int], typer.Option(help="Send the cap as max_completion_tokens instead of max_tokens (reasoning models).")
    ] = None,
    no_temperature: Annotated[bool, typer.Option("--no-temperature", help="Send no temperature (reasoning models accept only their default).", metavar="")] = False,
    batch: Annotated[bool, typer.Option("--batch", help="Use the Batch API (about half the price; results within 24 h). Rerun the same command to continue.", metavar="")] = False,
    batch_poll: Annotated[Optional[float], typer.Option(show_default=_shown("batch_poll_interval"), help="First wait between polls of a batch, seconds (grows to 300).")] = None,
    batch_failed: Annotated[Optional[str], typer.Option(show_default=_shown("batch_failed"), help="Retry requests that failed in a batch 'live' or in a new 'batch'.")] = None,
    price: Annotated[
        Optional[list[str]], typer.Option("--price", metavar="PRICE", help="[JUDGE=]IN,OUT: USD per million prompt and completion tokens, for a cost in results.json.")
    ] = None,
    length_threshold: Annotated[Optional[float], typer.Option(show_default=_shown("length_threshold"), help="Mark the AWR when mean answer lengths differ by more than this fraction.")] = None,
    allow_plain_http: Annotated[bool, typer.Option("--allow-plain-http", help="Allow the key over plain http:// to a host that is not loopback.", metavar="")] = False,
    env_proxy: Annotated[bool, typer.Option("--env-proxy", help="Use the proxy named by HTTP(S)_PROXY (ignored otherwise).", metavar="")] = False,
    length_anchors: Annotated[bool, typer.Option("--length-anchors", help="LC-AWR length anchors: B's answers rewritten verbose and concise by the judge model (or --anchors-model), each judged against B, enter the LC fit at weight 0.1; rewrites and verdicts are cached in DIR/anchors.", metavar="")] = False,
    anchors_model: Annotated[Optional[str], typer.Option("--anchors-model", metavar="MODEL", show_default=_shown("length_anchors_model"), help="The model that rewrites B's answers for --length-anchors (default: the first API judge).")] = None,
    difficulty_from: Annotated[Optional[Path], typer.Option("--difficulty-from", metavar="RESULTS", help="A second model's judge run against the same B (its folder or outcomes.jsonl): its per-prompt outcomes enter the LC fit as instruction difficulty.")] = None,
    difficulty_table: Annotated[Optional[Path], typer.Option("--difficulty-table", metavar="CSV", help="A published per-instruction difficulty table (AlpacaEval's for its 805 prompts; columns instruction or instruction_sha256, difficulty): the LC fit's difficulty term when every prompt is in it, matched by text.")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse to run when an id is in only one of the files.", metavar="")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print results.json to stdout instead of the table.", metavar="")] = False,
) -> None:
    """Pairwise LLM or rule judging of A vs B: adjusted win rate and its length-controlled twin, 90% CIs, majority vote, kappa.

    Every prompt is judged with A's answer first and with B's first; A wins only if
    both orders prefer it. Two judges add the majority vote and Cohen's kappa.
    LC-AWR is the AWR predicted at zero length difference between the answers; it is withheld, with
    the reason, when the data cannot tell length from quality, or when, with neither anchors nor a
    difficulty term, it moves the AWR by more than 5 points. --length-anchors pins the length slope
    with B's own answers made verbose and concise (as AlpacaEval does); --difficulty-from adds the
    instruction-difficulty term from a second model's results, --difficulty-table from a published table.

    Finished judgements are cached in the output folder: rerunning the same command
    resumes without repeating a request, and retries the ones that failed; with
    --batch it continues its batch from the stage it reached. Exit code 1
    when some judgements still failed (results are written without them).

    Example: dllm-align judge runs/kto/gen.jsonl runs/base/gen.jsonl --judge gpt-4o-mini --judge gpt-4.1-mini -o runs/kto/judge
    """
    from dllm_align.config.recipe import load_recipe, write_run_info
    from dllm_align.core.io import note_input
    from dllm_align.judge.run import judge_files

    flags = _recipe_flags(
        judges=judges, base_url=base_url, api_key_env=api_key_env, template=template, concurrency=concurrency,
        timeout=timeout, max_retries=max_retries, retry_delay=retry_delay, retry_after_max=retry_after_max,
        max_parse_retries=max_parse_retries, bootstrap=bootstrap, seed=seed, temperature=temperature,
        max_tokens=max_tokens, max_completion_tokens=max_completion_tokens, no_temperature=no_temperature,
        batch=batch, batch_poll=batch_poll, batch_failed=batch_failed, price=price, length_threshold=length_threshold,
        allow_plain_http=allow_plain_http, env_proxy=env_proxy, length_anchors=length_anchors,
        anchors_model=anchors_model, difficulty_from=difficulty_from, difficulty_table=difficulty_table,
    )
    rec = load_recipe(recipe, flags=flags)
    settings = rec.judge

    if output is None:
        output = a.parent / f"judge_{b.parent.name or 'b'}_{b.stem}"
    for f in (a, b, template):  # never written over (io.check_not_input)
        if f is not None:
            note_input(f, "input")
    run = judge_files(a, b, output, settings, strict=strict)
    write_run_info(rec, output, "judge")
    _report(run, output, json_out)


def _recipe_flags(*, judges, base_url, api_key_env, template, concurrency, timeout, max_retries, retry_delay,
                  retry_after_max, max_parse_retries, bootstrap, seed, temperature, max_tokens, max_completion_tokens,
                  no_temperature, batch, batch_poll, batch_failed, price, length_threshold, allow_plain_http, env_proxy,
                  length_anchors, anchors_model, difficulty_from, difficulty_table=None) -> dict:
    """The recipe keys the given flags set (``given`` drops the ones left out)."""
    flags = given({
        "judge.judges": ("--judge", judges or None),
        "judge.base_url": ("--base-url", base_url),
        "judge.api_key_env": ("--api-key-env", api_key_env),
        "judge.template": ("--template", str(template) if template is not None else None),
        "judge.concurrency": ("--concurrency", concurrency),
        "judge.timeout": ("--timeout", timeout),
        "judge.max_retries": ("--max-retries", max_retries),
        "judge.retry_base_delay": ("--retry-delay", retry_delay),
        "judge.retry_after_max": ("--retry-after-max", retry_after_max),
        "judge.max_parse_retries": ("--max-parse-retries", max_parse_retries),
        "judge.bootstrap": ("--bootstrap", bootstrap),
        "judge.seed": ("--seed", seed),
        "judge.temperature": ("--temperature", temperature),
        "judge.max_tokens": ("--max-tokens", max_tokens),
        "judge.max_completion_tokens": ("--max-completion-tokens", max_completion_tokens),
        "judge.batch": ("--batch", True if batch else None),
        "judge.batch_poll_interval": ("--batch-poll", batch_poll),
        "judge.batch_failed": ("--batch-failed", batch_failed),
        "judge.prices": ("--price", _parse_prices(price) if price else None),
        "judge.length_threshold": ("--length-threshold", length_threshold),
        "judge.allow_plain_http": ("--allow-plain-http", True if allow_plain_http else None),
        "judge.env_proxy": ("--env-proxy", True if env_proxy else None),
        "judge.length_anchors": ("--length-anchors", True if length_anchors else None),
        "judge.length_anchors_model": ("--anchors-model", anchors_model),
        "judge.difficulty_from": ("--difficulty-from", str(difficulty_from) if difficulty_from is not None else None),
        "judge.difficulty_table": ("--difficulty-table", str(difficulty_table) if difficulty_table is not None else None),
    })
    if no_temperature:
        flags["judge.temperature"] = ("--no-temperature", None)  # sent as no temperature at all
    return flags


def _report(run, output: Path, json_out: bool) -> None:
    """The results on stdout (the table, or results.json with --json); exit 1 when some judgements failed."""
    import json

    from dllm_align.core.console import info, result
    from dllm_align.core.errors import RunFailure
    from dllm_align.judge.run import print_table

    if json_out:
        result(json.dumps(run.results, indent=2, ensure_ascii=False))
    else:
        print_table(run.results)
    info(f"Wrote {output / 'results.json'}, results.md and outcomes.jsonl")
    if run.failed:
        unjudgeable = run.results.get("unjudgeable_judgements", 0)
        raise RunFailure(
            f"{run.failed} judgement(s) failed"
            + (f" ({unjudgeable} unjudgeable: no verdict even when asked for it alone)" if unjudgeable else "")
            + "; their prompts are left out of the affected judge's numbers (see n)",
            hint="run the same command again to retry only those",
        )
