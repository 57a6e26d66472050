"""``dllm-align generate``: completions for a prompt set with the model family's decoding rule
(docs/design.md#generation).

Thin: resolve the recipe (each flag sets its ``generate.*`` key and is validated by the
schema with the recipe), and hand it to the generator of ``generate.backend``
(:mod:`dllm_align.generate.backend`).
The resumable, multi-process output logic lives in :func:`dllm_align.generate.run.run_generate`.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command, given, schema_default as d
from dllm_align.config.schema import FAST_CACHE, FAST_THRESHOLD


@command("generate")
def generate(
    recipe: RecipeArg,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder (default: the recipe's output_dir); the generations go to DIR/gen.<split>.jsonl.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", help="The JSONL file instead (default: <run folder>/gen.<split>.jsonl). Rerunning resumes it.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint folder or hub id (overrides model.name_or_path).")] = None,
    split: Annotated[Optional[str], typer.Option("--split", show_default=d("generate.split"), help="Which prompts of the recipe: 'test' (data.test) or 'train' (data.train).")] = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Prompt file/folder/hub dataset instead of the recipe's data (.txt: one prompt a line).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Only the first N prompts.")] = None,
    set_: SetOpt = None,
    gen_length: Annotated[Optional[int], typer.Option("--gen-length", show_default=d("generate.gen_length"), help="Tokens to generate (paper: 512).")] = None,
    block_length: Annotated[Optional[int], typer.Option("--block-length", show_default=d("generate.block_length"), help="Semi-autoregressive block length (paper: 32).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", show_default=d("generate.steps"), help="Total denoising steps (paper: 512).")] = None,
    remasking: Annotated[Optional[str], typer.Option("--remasking", show_default=d("generate.remasking"), help="low_confidence (paper) or random.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", show_default=d("generate.temperature"), help="0 = greedy (paper). DiffusionGemma: only 0, its published schedule (tokens depend on the seed).")] = None,
    cfg: Annotated[Optional[float], typer.Option("--cfg", show_default=d("generate.cfg"), help="Classifier-free guidance scale (0 = off, paper).")] = None,
    fast: Annotated[bool, typer.Option("--fast", help=f"Fast decoding: a key/value cache ({FAST_CACHE}; prefix for the block rule) and confidence threshold {FAST_THRESHOLD} (unless set otherwise).", metavar="")] = False,
    cache: Annotated[Optional[str], typer.Option("--cache", show_default=d("generate.cache"), help="Key/value reuse within a block: none, prefix or dual.")] = None,
    threshold: Annotated[Optional[float], typer.Option("--threshold", help="Commit every candidate above this confidence (fast mode).")] = None,
    sampler: Annotated[Optional[str], typer.Option("--sampler", show_default=d("generate.sampler"), help="The decoding rule: auto (the model family's), or a registered rule: llada, dream, block, diffusion_gemma, ...")] = None,
    alg: Annotated[Optional[str], typer.Option("--alg", show_default=d("generate.alg"), help="Dream rule: origin, maskgit_plus, topk_margin or entropy.")] = None,
    alg_temp: Annotated[Optional[float], typer.Option("--alg-temp", show_default=d("generate.alg_temp"), help="Dream rule: > 0 draws the committed positions.")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Dream rule: nucleus filtering of the candidates (at every temperature). Block rule: of the draw at temperature > 0.")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Dream rule: top-k filtering of the candidates (at every temperature). Block rule: of the draw at temperature > 0.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", show_default=d("generate.batch_size"), help="Prompts per forward pass.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", show_default=d("generate.seed"), help="Seed for temperature / random remasking (per prompt: hashed with its id).")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available; under accelerate/torchrun, the process's device).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the output afresh instead of resuming it.", metavar="")] = False,
    allow_long: Annotated[bool, typer.Option("--allow-long", help="Generate even when prompt + gen_length exceeds the model's positions.", metavar="")] = False,
) -> None:
    """Generate completions for a recipe's prompts, resumably, on one or many devices.

    Output rows: id, prompt (messages), completion (text before the first
    end-of-turn), finish_reason, num_tokens and the settings; the settings also
    go to OUT.settings.json. A rerun skips ids already written; a file made with
    other settings is refused. Under `accelerate launch` / `torchrun` the prompts
    are split across processes and the file is the same as a one-process run.

    Example: dllm-align generate kto_mix_14k -o runs/kto --model runs/kto/final --output runs/kto/gen.aligned.jsonl

    Example: accelerate launch -m dllm_align generate kto_mix_14k --fast --limit 200

    Example: dllm-align generate dream_kto_mix_14k --alg entropy --temperature 0.2 --top-p 0.95
    """
    import os

    from dllm_align.core.console import result
    from dllm_align.config.recipe import load_recipe
    from dllm_align.generate.rules import auto_rule
    from dllm_align.generate.run import run_generate

    from dllm_align.core.errors import UserError

    if output_dir is not None and Path(output_dir).suffix in (".jsonl", ".json"):
        raise UserError(
            f"-o {output_dir}: -o names the run folder (in every command), not the output file",
            hint=f"write the file with --output {output_dir}",
        )
    flags = {f"generate.{k}": ("--" + k.replace("_", "-"), v) for k, v in {
        "gen_length": gen_length, "block_length": block_length, "steps": steps, "remasking": remasking,
        "temperature": temperature, "cfg": cfg, "cache": cache, "threshold": threshold, "sampler": sampler, "alg": alg,
        "alg_temp": alg_temp, "top_p": top_p, "top_k": top_k, "batch_size": batch_size, "seed": seed, "split": split,
        "limit": limit,
    }.items()}
    flags["model.name_or_path"] = ("--model", model)
    flags = given(flags)
    rec = load_recipe(recipe, set_, output_dir, flags=flags, auto_rule=auto_rule)
    if fast:
        extra = {}
        from dllm_align.generate.rules import resolved_rule, rule_fast_cache, rule_reads

        rule = resolved_rule(rec.model, rec.generate.sampler)
        if cache is None and rec.generate.cache == "none":
            extra["generate.cache"] = ("--fast", rule_fast_cache(rule))
        if threshold is None and rec.generate.threshold is None and rule_reads(rule, "threshold"):
            extra["generate.threshold"] = ("--fast", FAST_THRESHOLD)
        if extra:
            rec = load_recipe(recipe, set_, output_dir, flags={**flags, **extra}, auto_rule=auto_rule)
    out = run_generate(rec, output=output, prompts=prompts, device=device, overwrite=overwrite, allow_long=allow_long)
    if int(os.environ.get("RANK", "0")) == 0:
        result(str(out))  # the output path on stdout, once
