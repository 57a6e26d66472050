"""``dllm-align convert``: preference data in any supported layout -> validated unpaired JSONL / Parquet.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dllm_align.cli.app import command


class FormatChoice(str, Enum):
    auto = "auto"
    unpaired = "unpaired"
    paired = "paired"


class LabelChoice(str, Enum):
    true = "true"
    false = "false"


InputArg = Annotated[
    str,
    typer.Argument(
        help="A .jsonl/.json/.parquet/.csv file, a folder (save_to_disk, chosen.* + rejected.*, split files) or a hub dataset id.",
        show_default=False,
    ),
]
FormatOpt = Annotated[FormatChoice, typer.Option("--format", help="Row layout; 'auto' detects it from the columns.")]
SplitOpt = Annotated[Optional[str], typer.Option("--split", help="Split of a hub dataset or saved dataset (e.g. train_prefs).")]
LabelOpt = Annotated[
    Optional[LabelChoice],
    typer.Option("--label", help="Class of rows without a 'label' column (a file of only desirable or only undesirable rows)."),
]
SkipOpt = Annotated[bool, typer.Option("--skip-invalid", help="Skip invalid rows (each is listed) instead of stopping.", metavar="")]


DEFAULT_NAME = "unpaired.jsonl"  # the file convert writes in its run folder


def label_value(label: Optional[LabelChoice]) -> Optional[bool]:
    return None if label is None else label is LabelChoice.true


@command("convert")
def convert(
    input: InputArg,
    output_dir: Annotated[
        Optional[Path], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder; the rows go to DIR/unpaired.jsonl.", show_default=False)
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", help="The output file instead: .jsonl, or .parquet.", show_default=False)
    ] = None,
    format: FormatOpt = FormatChoice.auto,
    split: SplitOpt = None,
    label: LabelOpt = None,
    skip_invalid: SkipOpt = False,
    desirable_ratio: Annotated[
        float, typer.Option("--desirable-ratio", min=0.0, max=1.0, help="Keep this fraction of the desirable rows.")
    ] = 1.0,
    undesirable_ratio: Annotated[
        float, typer.Option("--undesirable-ratio", min=0.0, max=1.0, help="Keep this fraction of the undesirable rows.")
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Which rows a ratio keeps is a pure function of seed and row id.")] = 0,
    balance_weights: Annotated[
        bool,
        typer.Option(
            "--balance-weights",
            help="Also write OUT.weights.json with lambda_desirable * n_desirable = lambda_undesirable * n_undesirable "
            "(larger class weight 1), for data.weights_file.",
        metavar="",
        ),
    ] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Keep only the first N rows (before ratios).")] = None,
) -> None:
    """Convert preference data to validated unpaired (KTO) rows.

    Pairs become two rows: chosen -> label true, rejected -> label false, same
    prompt, ids ID:chosen / ID:rejected sharing pair_id ID. Unpaired rows are
    normalised (prompt as chat messages, completion as text) and validated.
    Any invalid row stops the conversion (exit 2, nothing written) unless
    --skip-invalid.

    Examples:

      dllm-align convert HuggingFaceH4/ultrafeedback_binarized --split train_prefs -o runs/ufb

      dllm-align convert kto.jsonl --output kto-d10.jsonl --desirable-ratio 0.1 --balance-weights
    """
    from dllm_align.data.convert import convert as run
    from dllm_align.core.errors import UserError

    if output_dir is not None and output_dir.suffix in (".jsonl", ".parquet", ".json"):
        raise UserError(
            f"-o {output_dir}: -o names the run folder (in every command), not the output file",
            hint=f"write the file with --output {output_dir}",
        )
    if output is None:
        if output_dir is None:
            raise UserError("say where to write: -o DIR (writes DIR/unpaired.jsonl) or --output FILE")
        output = output_dir / DEFAULT_NAME

    run(
        input,
        output,
        split=split,
        format=format.value,
        label=label_value(label),
        skip_invalid=skip_invalid,
        desirable_ratio=desirable_ratio,
        undesirable_ratio=undesirable_ratio,
        seed=seed,
        balance=balance_weights,
        limit=limit,
    )
