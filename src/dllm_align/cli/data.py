"""``dllm-align data``: look at preference data before training (``stats``, ``check``).

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import Group, app, command
from dllm_align.cli.convert import FormatChoice, FormatOpt, InputArg, LabelOpt, SkipOpt, SplitOpt, label_value

group = typer.Typer(cls=Group, help="Inspect preference data: validation, class counts, token lengths, padding cost.", no_args_is_help=True)
app.add_typer(group, name="data")



def _fmt_int(n: int) -> str:
    return f"{n:,}"


def stats_table(s: dict, model: str) -> str:
    """The human-readable ``data stats`` report."""
    lines = [
        f"rows              {s['rows']:,}  (desirable {s['desirable']:,}, undesirable {s['undesirable']:,}; "
        f"{s['pairs']:,} pairs, {s['distinct_prompts']:,} distinct prompts)",
        "",
        f"token lengths ({model}, before truncation; completion includes the end-of-turn token)",
        f"{'':<12}{'min':>8}{'p50':>8}{'p90':>8}{'p95':>8}{'p99':>8}{'max':>8}{'mean':>10}",
    ]
    for part in ("prompt", "completion", "total"):
        q = s["tokens"][part]
        lines.append(
            f"{part:<12}" + "".join(f"{q[k]:>8,}" for k in ("min", "p50", "p90", "p95", "p99", "max")) + f"{q['mean']:>10,.1f}"
        )
    mpl = s["max_prompt_length"]
    lines += [
        "",
        f"max_length {s['max_length']:,}" + (f", max_prompt_length {mpl:,}" if mpl else "") + f", truncation {s['truncation']}: "
        f"{s['over_max_length']:,} rows too long; {s['prompt_cut']:,} prompts cut, {s['completion_cut']:,} completions cut, "
        f"{s['dropped']:,} rows dropped (prompt alone too long)",
    ]
    c = s["tokens_fed"]
    if c:
        real = c["real"]
        g = s["global_batch_size"]
        grouping = f"global batch {g}" if g != s["batch_size"] else f"batch {g}"
        lines += [
            "",
            f"tokens fed per epoch ({s['rows_kept']:,} rows, {s['batch_size']} rows per forward pass)",
            f"{'padding':<42}{'tokens':>14}{'padding':>10}{'x real':>8}",
        ]
        for key, name in (
            ("real", "no padding at all (lower bound)"),
            ("paper", f"paper: EOS to {s['max_length']:,}"),
            ("none_grouped", f"none, length-grouped ({grouping})"),
            ("none_random", "none, random batches"),
            ("packed_random", "packed (8 noisy copies), random batches"),
        ):
            if key not in c:
                continue
            fed = c[key]
            waste = 1 - real / fed if fed else 0.0
            lines.append(f"{name:<42}{fed:>14,}{waste:>9.1%}{fed / real:>8.2f}")
    return "\n".join(lines)


@command("stats", group=group)
def stats(
    input: InputArg,
    model: Annotated[str, typer.Option("--model", "-m", help="Whose tokenizer counts the tokens: hub id, folder or builtin:tiny.")] = "builtin:tiny",
    max_length: Annotated[int, typer.Option("--max-length", min=8, help="data.max_length to measure against (paper: 4096).")] = 4096,
    max_prompt_length: Annotated[Optional[int], typer.Option("--max-prompt-length", min=1, help="data.max_prompt_length.")] = None,
    truncation: Annotated[str, typer.Option("--truncation", help="data.truncation: completion or prompt_left.")] = "completion",
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Rows per forward pass (padding: none pads to its longest row).")] = 8,
    global_batch_size: Annotated[
        Optional[int], typer.Option("--global-batch-size", min=1, help="Rows per optimiser step, the unit of length grouping (default: --batch-size).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Batch-plan seed.")] = 0,
    format: FormatOpt = FormatChoice.auto,
    split: SplitOpt = None,
    label: LabelOpt = None,
    skip_invalid: SkipOpt = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.", metavar="")] = False,
) -> None:
    """Class counts, token lengths, and the tokens each padding choice would feed the model.

    'paper' padding feeds rows x max_length; 'none' pads each batch to its
    longest row, much less when rows of similar length are grouped. See the
    cost before you train.

    Examples:

      dllm-align data stats trl-lib/kto-mix-14k --split test

      dllm-align data stats ufb.jsonl --model GSAI-ML/LLaDA-8B-Instruct --max-length 4096 --json
    """
    import json

    from dllm_align.core.console import result
    from dllm_align.data.stats import dataset_stats
    from dllm_align.data.load import load_unpaired
    from dllm_align.core.errors import UserError
    from dllm_align.models.load import load_tokenizer, resolve_model_path
    from dllm_align.config.schema import DataSection

    if truncation not in ("completion", "prompt_left"):
        raise UserError(f"--truncation must be 'completion' or 'prompt_left', got '{truncation}'")
    if global_batch_size is not None and global_batch_size % batch_size:
        raise UserError(f"--global-batch-size ({global_batch_size}) must be a multiple of --batch-size ({batch_size})")
    section = DataSection(max_length=max_length, max_prompt_length=max_prompt_length, truncation=truncation)
    rows = load_unpaired(input, split=split, format=format.value, label=label_value(label), skip_invalid=skip_invalid)
    tok = load_tokenizer(resolve_model_path(model))
    s = dataset_stats(rows, tok, section, batch_size, global_batch_size, seed)
    s["model"] = model
    s["source"] = input
    result(json.dumps(s, indent=2) if json_out else stats_table(s, model))


@command("check", group=group)
def check(
    input: InputArg,
    format: FormatOpt = FormatChoice.auto,
    split: SplitOpt = None,
    label: LabelOpt = None,
) -> None:
    """Validate preference data: every bad row is listed with its file and line (exit 2 if any).

    Example: dllm-align data check ultrafeedback.jsonl
    """
    from dllm_align.core.console import result
    from dllm_align.data.imbalance import class_counts
    from dllm_align.data.load import load_unpaired

    rows = load_unpaired(input, split=split, format=format.value, label=label_value(label))
    n_d, n_u = class_counts(rows)
    result(f"{input}: {len(rows):,} valid rows ({n_d:,} desirable, {n_u:,} undesirable)")
