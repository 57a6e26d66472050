"""The recipe schema: one pydantic section per stage of the pipeline (model, data, reference, train, generate,
judge, ablate, evaluate) with types, ranges and cross-field rules; unknown keys are refused.

Key names follow the paper's vocabulary (beta, n_mc, lambda_desirable, ...).

Size: about 610 lines, kept whole: it is the one description of the recipe file, and the recipe's
cross-section rules read every section; split, the format would be spread over several modules.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Optional

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)

from dllm_align.config import components as registry
from dllm_align.core.usercode import spec_problem


class Section(BaseModel):
    # allow_inf_nan=False: `beta: .inf` or `lr: .nan` are valid YAML floats but never valid settings.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class KeyedError(ValueError):
    """A problem with one key below the section that raises it (``key`` relative to the section, dotted): the
    recipe's error lines name ``<section>.<key>`` (``config.recipe.format_errors``)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class ComposedSection(Section):
    """A section that holds the own settings of the components whose kind lives in it (``train.<objective>``,
    ``generate.<backend>``, ...; ``dllm_align.config.components``). A key that is neither a field nor a
    registered component of the section is refused as an unknown key; a component's settings are validated by
    its own model; the selected component's ignored keys must keep their defaults."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)
    SECTION: ClassVar[str] = ""

    @model_validator(mode="after")
    def _components(self):
        extra = self.__pydantic_extra__ or {}
        by_name = {c.name: c for c in registry.section_components(self.SECTION)}
        for key in list(extra):
            comp = by_name.get(key)
            if comp is not None and comp.traits.get("flat"):
                keys = ", ".join(f"{self.SECTION}.{k}" for k in comp.settings.model_fields)
                raise KeyedError(str(key), f"the settings of the {comp.kind} {comp.name!r} are written without its name: {keys}")
            if comp is None:
                known = list(type(self).model_fields) + list(by_name)
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                raise KeyedError(str(key), "unknown key" + (f" (did you mean '{self.SECTION}.{close[0]}'?)" if close else ""))
            value = extra[key]
            if isinstance(value, BaseModel):
                value = value.model_dump()
            try:
                extra[key] = comp.settings.model_validate({} if value is None else value)
            except ValidationError as e:
                err = e.errors()[0]
                sub = ".".join(str(x) for x in err["loc"])
                msg = str(err["msg"]).removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = "unknown key"
                raise KeyedError(f"{key}.{sub}" if sub else str(key), msg) from None
        for kind in registry.KINDS.values():
            if kind.section != self.SECTION or kind.selector is None:
                continue
            name = getattr(self, kind.selector)
            comp = registry.find(kind.name, name) if isinstance(name, str) else None
            if comp is not None:
                problems = ignored_problems(self, comp)
                if problems:
                    raise KeyedError(problems[0][0], problems[0][1])
            # "auto" names no rule yet: the family's is checked once the model is read (rule_problems)
            if isinstance(name, str) and name != "auto" and not kind.selected_at_run:
                problems = unused_settings_problems(self, kind.name, comp.name if comp is not None else name.partition(":")[0])
                if problems:
                    raise KeyedError(problems[0][0], problems[0][1])
        return self

    def own_settings(self, name: str) -> BaseModel:
        """The settings of component ``name`` of this section (its defaults when the recipe sets none)."""
        extra = self.__pydantic_extra__ or {}
        if name in extra:
            return extra[name]
        for comp in registry.section_components(self.SECTION):
            if comp.name == name and comp.traits.get("flat"):
                return comp.settings.model_validate({k: getattr(self, k) for k in comp.settings.model_fields})
            if comp.name == name:
                return comp.settings()
        raise KeyError(f"{self.SECTION}.{name}: no component of this section is named {name!r}")


def component_problems(recipe: "Recipe", comp: "registry.Component") -> list[str]:
    """One line per problem of ``recipe`` for component ``comp``: the keys of its section it ignores but the
    recipe set, and its own checks. For the components the checkpoint decides (a family; the likelihood, the
    family's unless reference.likelihood picks another it accepts), which the sections cannot check when the recipe
    is read; the run asks once it knows."""
    section = getattr(recipe, registry.KINDS[comp.kind].section)
    lines = [f"{registry.KINDS[comp.kind].section}.{key}: {msg}" for key, msg in ignored_problems(section, comp)]
    return lines + (list(comp.check(recipe)) if comp.check is not None else [])


def ignored_problems(section: BaseModel, comp: "registry.Component") -> list[tuple[str, str]]:
    """(key, message) for each key of ``section`` that ``comp`` ignores but the recipe set away from its default."""
    out = []
    for key in comp.ignores:
        field = type(section).model_fields[key]
        default = field.get_default(call_default_factory=True)
        if getattr(section, key) != default:
            out.append((key, f"not a setting of the {comp.kind} {comp.name!r} (it has no use for it; "
                             f"leave it at {default!r})"))
    return out


def unused_settings_problems(section: BaseModel, kind: str, selected: str, where: Optional[str] = None) -> list[tuple[str, str]]:
    """(key, message) for each component of ``kind`` other than ``selected`` whose own settings the recipe sets away
    from their defaults: nothing reads them (the selector, or the flag ``where``, names another component), so they
    would be ignored."""
    where = where or f"{registry.KINDS[kind].section}.{registry.KINDS[kind].selector}"
    out = []
    for key, value in (section.__pydantic_extra__ or {}).items():
        comp = registry.find(kind, key)
        if comp is None or comp.name == selected or not isinstance(value, BaseModel) or value == comp.settings():
            continue
        out.append((key, f"the settings of the {kind} {key!r}, which is not used here ({where} is {selected!r}); "
                         "leave them out"))
    return out


def _known_backend(name: str) -> str:
    """``generate.backend`` by name, from the declarations alone (nothing is imported to check it)."""
    if registry.find("backend", name) is None:
        raise ValueError(registry.unknown_message("backend", name, key="generate.backend").partition(": ")[2])
    return name


BackendName = Annotated[str, AfterValidator(_known_backend)]


# --------------------------------------------------------------------------- model
class ModelSection(ComposedSection):
    SECTION: ClassVar[str] = "model"
    name_or_path: str = Field(
        "builtin:tiny",
        description="Hub id, local folder, or 'builtin:tiny' (the built-in tiny model, no network needed).",
    )
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    tokenizer: Optional[str] = Field(None, description="Tokenizer path or hub id if not the model's own.")
    trust_remote_code: bool = Field(
        False, description="Run the model repository's own code. Off by default; LLaDA does not need it."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype: auto = bfloat16 on GPU, float32 on CPU."
    )
    mask_token_id: Optional[int] = Field(None, ge=0, description="Override the mask token id read from the model.")
    published_code: Optional[str] = Field(
        None, description="Folder holding the family's published modeling files (configuration_*.py, modeling_*.py), "
        "copied into the exported final/ when the model's own folder has none (a built-in model); without them "
        "final/ names no auto_map (docs/serving.md).")
    gradient_checkpointing: bool = False
    attn_implementation: Optional[Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]] = None

    @field_validator("published_code")
    @classmethod
    def _published_code_is_a_folder(cls, v: Optional[str]) -> Optional[str]:
        # checked when the recipe is read, not after a run's training, when the export would otherwise drop auto_map
        if v is not None and not Path(v).expanduser().is_dir():
            raise ValueError(f"{v!r} is not a folder (it should hold the family's published modeling files)")
        return v


# --------------------------------------------------------------------------- data
class DataSection(Section):
    train: Optional[str] = Field(None, description="Training data: local file/folder or hub dataset id.")
    train_split: str = "train"
    test: Optional[str] = Field(None, description="Evaluation prompts: local file/folder or hub dataset id.")
    test_split: str = "test"
    format: Literal["auto", "unpaired", "paired"] = Field(
        "auto", description="Layout of the rows: detected from the columns, or forced (see `dllm-align convert`)."
    )
    label: Optional[bool] = Field(
        None, description="Class of rows that have no 'label' column (a file of only desirable or only undesirable rows)."
    )
    max_length: int = Field(4096, ge=8, le=1 << 20, description="Cap on prompt + completion tokens (and at most the model's positions).")
    max_prompt_length: Optional[int] = Field(None, ge=1, description="Cap on prompt tokens (left-truncated).")
    truncation: Literal["completion", "prompt_left"] = Field(
        "completion", description="What gives way when a row is too long: the completion's tail or the prompt's head."
    )
    padding: Literal["paper", "none", "packed"] = Field(
        "packed",
        description="'paper': right-pad with EOS to max_length (visible, never scored; the paper's code); 'none': no tail, "
        "attention-masked batches padded to their longest row; 'packed': no tail, and the noisy sequences of a forward packed "
        "into as few max_length rows as fit, with block-diagonal attention (the values of 'none', without the padding).",
    )
    group_by_length: bool = Field(
        False,
        description="Bucket rows of similar length into one global batch (an opt-in departure from the paper, which samples "
        "mini-batches uniformly: the baseline is a batch statistic, so grouping changes the method).",
    )
    end_of_turn: Literal["scored", "none"] = Field(
        "scored",
        description="'scored': append the chat template's end-of-turn token to every completion and mask and score it "
        "like a completion token (the model learns to stop); 'none': score only the completion's own tokens (the paper's code).",
    )
    block_scoring: Literal["published", "completion_only"] = Field(
        "published",
        description="Block-diffusion models only (SDAR, LLaDA2.0, DiffusionGemma): 'published': each completion is followed "
        "by the chat template's end-of-turn tail and filler up to a whole number of blocks, all masked (noised) and scored, as "
        "the published trainers score and as the samplers decode (end_of_turn is then moot): pad-token filler to whole blocks "
        "of the sequence for SDAR's and dllm's block trainers, EOS to a whole number of canvases of the completion for "
        "DiffusionGemma (TRL's example, never past max_length); 'completion_only': the completion (and end_of_turn) only, "
        "the last block or canvas left partial. Ignored for whole-sequence models.",
    )
    desirable_ratio: float = Field(
        1.0, gt=0, le=1, description="Keep this fraction of the desirable rows (class-imbalance study; chosen by seed and row id)."
    )
    undesirable_ratio: float = Field(1.0, gt=0, le=1, description="Keep this fraction of the undesirable rows.")
    weights_file: Optional[str] = Field(
        None,
        description="JSON with lambda_desirable / lambda_undesirable, as written by `convert --balance-weights` (OUT.weights.json).",
    )
    seed: int = Field(0, description="Seed of the class subsampling and of the batch order.")
    limit: Optional[int] = Field(None, ge=1, description="Use only the first N rows, before the ratios (smoke tests).")


# --------------------------------------------------------------------------- reference
class _ReferenceDraws(ComposedSection):
    SECTION: ClassVar[str] = "reference"
    mode: Literal["cached", "online"] = Field(
        "cached", description="'cached': read precomputed reference ELBOs; 'online': keep the reference model resident."
    )
    model: Optional[str] = Field(None, description="Reference model; default: model.name_or_path.")
    cache: Optional[str] = Field(None, description="Cache folder; default: <output_dir>/ref_cache.")
    n_mc: int = Field(8, ge=1, le=1024, description="Monte Carlo draws K per example (paper: 8 / 4).")
    seed: int = Field(0, description="Mask seed; the masks are a pure function of (seed, example id, draw).")
    estimator: Literal["l", "t"] = Field("l", description="'l': exactly l masked, weight L/l (paper); 't': Bernoulli(t), weight 1/t.")
    stratified: bool = Field(False, description="Evenly spaced l across the K draws with one random offset.")
    likelihood: Optional[str] = Field(
        None, description="The likelihood the ELBOs use, by declared name (null: the model family's); another only "
        "where the family accepts it: LLaDA2.1 takes 'hybrid', the masked-plus-replaced bound (its settings: "
        "reference.hybrid.<key>; docs/design.md#a-bound-for-masked-and-replaced-tokens).")

    @field_validator("likelihood")
    @classmethod
    def _known_likelihood(cls, v: Optional[str]) -> Optional[str]:
        # by the declarations alone, before any model is read (whether the family takes it is asked once it is known)
        if v is not None and registry.find("likelihood", v) is None:
            raise ValueError(registry.unknown_message("likelihood", v, key="reference.likelihood").partition(": ")[2])
        return v

    def settings_of_others(self, chosen: str) -> list[str]:
        """The likelihoods other than ``chosen`` (the run's) whose own settings the recipe sets
        (``reference.<name>.<key>``): they would do nothing."""
        return [str(name) for name in self.__pydantic_extra__ or {}
                if name != chosen and registry.find("likelihood", str(name)) is not None]

    def likelihood_record(self) -> dict:
        """What the reference cache's fingerprint records of a likelihood the recipe picks: its name and its own
        settings (nothing when the family's is used, so that those caches keep their fingerprints)."""
        if self.likelihood is None:
            return {}
        return {"likelihood": self.likelihood, "likelihood_settings": self.own_settings(self.likelihood).model_dump()}


# The uniform-noise likelihood's settings keep their flat spellings (reference.time_power, ...): fields of this
# section made from the likelihood's own settings model, where they are described once.
_ReferenceFlat = create_model("_ReferenceFlat", __base__=_ReferenceDraws, __module__=__name__,
                              **registry.flat_fields("reference", "dllm_align.objective.components"))


class ReferenceSection(_ReferenceFlat):
    batch_size: int = Field(4, ge=1, description="Examples per forward pass in precompute.")
    draws_per_forward: Optional[int] = Field(
        None, ge=1, description="How many of an example's K draws go in one forward call (default: all)."
    )
    shard_size: int = Field(
        512, ge=1, description="Examples per cache shard: the unit of work per process and of resuming an interrupted precompute."
    )


# --------------------------------------------------------------------------- train
class LoraSection(Section):
    enabled: bool = False
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="LoRA dropout (0 by default, as in the paper). With gradient accumulation the baseline's no-grad pass "
        "and the gradient pass draw the same dropout masks (seeded per step and micro-batch).",
    )
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    merge_on_export: bool = Field(
        True,
        description="final/ holds the merged model (plain transformers loads it); false: a PEFT adapter folder "
        "(adapter_model.safetensors + adapter_config.json) for PeftModel.from_pretrained on the base model.",
    )
    merged_dtype: Literal["trained", "bfloat16", "float16", "float32"] = Field(
        "trained",
        description="dtype of final/'s merged model (merge_on_export): trained = the policy's weights as trained "
        "(model.dtype; fp32 under auto); bfloat16 = the published checkpoints' dtype, in bf16 safetensors shards "
        "(the merge is computed in fp32 and rounded once). Checkpoints are unaffected.",
    )


class TrainSection(ComposedSection):
    SECTION: ClassVar[str] = "train"
    objective: str = Field(
        "elbo_kto",
        description="The training objective by its declared name: elbo_kto (the paper), sft (masked-diffusion SFT), "
        "vrpo (LLaDA 1.5's paired objective); dllm_align.objective.components declares them, a plugin module more "
        "(docs: CONTRIBUTING.md, Adding a component).",
    )
    beta: float = Field(0.1, gt=0, description="KTO temperature (paper: 0.1 kto-mix-14k, 0.2 UltraFeedback).")
    baseline: Literal["global_mean", "none", "kl"] = Field(
        "global_mean",
        description="Reference point: stop-gradient mean margin over the optimiser-step batch (the paper), 0, or 'kl': "
        "KTO's z0, the policy-vs-reference margin on mismatched (prompt, another row's completion) pairs of the step "
        "batch, clamped at 0 (one extra no-grad policy pass per step).",
    )
    lambda_desirable: float = Field(1.0, gt=0)
    lambda_undesirable: float = Field(1.0, gt=0)
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Clip the global gradient norm to this (null: no clipping).")
    epochs: float = Field(1.0, gt=0)
    max_steps: Optional[int] = Field(None, ge=1, description="Stop after this many optimiser steps.")
    batch_size: int = Field(
        1, ge=1, description="Examples (pairs for vrpo) per process per micro-batch. Global batch = batch_size x grad_accum x processes."
    )
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimiser step.")
    global_batch_size: Optional[int] = Field(
        None,
        ge=1,
        description="Units per optimiser step across all processes (paper: 8). When set, grad_accum is derived from it "
        "at launch (global / (batch_size x processes)), so one recipe gives the same update on 1 or 8 GPUs.",
    )
    rows_per_forward: Optional[int] = Field(
        None, ge=1, description="Cap on noisy rows (examples x draws) per forward call of the policy (default: the whole micro-batch)."
    )
    sft_rows: Literal["all", "desirable"] = Field(
        "all", description="objective sft: train on every row, or on desirable rows only."
    )
    margin_watch_window: int = Field(
        25,
        ge=1,
        description="Steps per window of the warning that the desirable rows' mean margin keeps falling "
        "(docs/design.md#class-weights).",
    )
    n_mc: Optional[int] = Field(None, ge=1, description="Draws used in training; default reference.n_mc (must be <= it).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description="Forward compute: bf16 autocast over fp32 master weights, or no (fp32); auto = bf16 on CUDA, no on CPU.",
    )
    fsdp_gather: Literal["fp32", "bf16_layers"] = Field(
        "fp32",
        description="FSDP2 only, with bf16 autocast: how decoder layers are all-gathered. fp32 (default); bf16_layers "
        "gathers each decoder layer's weights in bf16 (norms kept fp32 as their own units; embeddings, final norm and "
        "head fp32), the same forward values at ~half the gather traffic, for 2 more small all-gathers per layer.",
    )
    seed: int = 0
    process_group_timeout_minutes: float = Field(
        60.0, gt=0, le=7 * 24 * 60,  # a week at most: beyond any checkpoint write, and within what timedelta holds
        description="How long a process waits for the others in a collective (NCCL/gloo) before the run fails. "
        "torch's NCCL default is 10; rank 0 alone gathers, writes and hashes a checkpoint (an 8B model: minutes).",
    )
    save_every: Optional[int] = Field(None, ge=1, description="Checkpoint every N steps (default: end only).")
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(1, ge=1)
    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    lora: LoraSection = Field(default_factory=LoraSection)

    @field_validator("objective")
    @classmethod
    def _declared_objective(cls, v: str) -> str:
        # checked against the declarations only (no objective is imported, so `recipes check` stays torch-free)
        if registry.find("objective", v) is None:
            raise ValueError(registry.unknown_message("objective", v).removeprefix("train.objective: "))
        return v

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        # YAML 1.1 reads a bare `no` (in a file or in --set) as false: that spelling means "no".
        return "no" if v is False else v


# --------------------------------------------------------------------------- generate
# Fast mode (`generate --fast`, and `label` / `online` sampling when the recipe decodes exactly): the dual
# key/value cache and Fast-dLLM's default confidence threshold.
FAST_CACHE = "dual"
FAST_THRESHOLD = 0.9


class GenerateSection(ComposedSection):
    """Decoding: the backend, the rule (LLaDA's block sampler, Dream's, block diffusion's) and its settings; read by
    `generate`, `label` / `online` and `evaluate`'s generation tasks (modules in dllm_align.generate).

    The samplers read these settings themselves (``dllm_align.generate.settings.SamplerSettings`` derives from this
    class), so every check of a setting is here."""

    SECTION: ClassVar[str] = "generate"

    backend: BackendName = Field(
        "in_process", description="Who decodes: in_process (the model loaded in this process, the samplers of dllm_align.generate); "
        "other names are generation backends registered in dllm_align.generate.backend."
    )
    sampler: str = Field(
        "auto", description="Decoding rule of the in-process backend, by its registered name: the model family's own "
        "(auto), llada (LLaDA's block sampler), dream (Dream's diffusion_generate), block (block diffusion's: SDAR, "
        "block by block with a KV cache), diffusion_gemma (DiffusionGemma's own generate: gen_length and steps are "
        "read, its temperature schedule is the published one), or a rule registered as a component."
    )

    gen_length: int = Field(512, ge=1, description="Tokens generated per prompt (paper: 512).")
    block_length: int = Field(32, ge=1, description="Semi-autoregressive block length; divides gen_length (paper: 32).")
    steps: int = Field(512, ge=1, description="Denoising steps in all; a multiple of the number of blocks (paper: 512).")
    remasking: Literal["low_confidence", "random"] = Field(
        "low_confidence", description="LLaDA rule: which candidates a step commits, the most probable ones or random ones "
        "(the block rule commits by confidence, statically or above generate.threshold; not recorded for it)."
    )
    temperature: float = Field(0.0, ge=0, le=10, description="0: argmax (paper); > 0: Gumbel-max sampling with float64 noise (at most 10: "
                               "far past it the float64 noise raised to the temperature under- or overflows). "
                               "DiffusionGemma's rule reads none (its own schedule over random canvases: tokens depend on the seed); "
                               "only 0 is accepted there.")
    cfg: float = Field(0.0, ge=0, description="Classifier-free guidance scale (0: off).")
    batch_size: int = Field(8, ge=1, description="Prompts per forward pass (length-grouped, left-padded).")
    seed: int = Field(0, description="Seed for temperature / random remasking; each prompt hashes it with its id.")
    cache: Literal["none", "prefix", "dual"] = Field(
        "none", description="Fast mode: reuse keys/values within a block (prefix: left of it; dual: both sides). 'none' is exact."
    )
    threshold: Optional[float] = Field(
        None, gt=0, le=1, description="Fast mode: commit every candidate above this confidence (at least one per step); replaces the step schedule."
    )
    split: Literal["train", "test"] = Field("test", description="Which prompts `generate` reads: data.test or data.train.")
    limit: Optional[int] = Field(None, ge=1, description="Only the first N prompts.")
    # Dream's rule (sampler: dream, or auto with a Dream model); defaults are the published ones.
    alg: Literal["origin", "maskgit_plus", "topk_margin", "entropy"] = Field(
        "origin", description="Dream rule: which masked positions a step commits (origin: random; else by confidence)."
    )
    alg_temp: float = Field(0.0, ge=0, description="Dream rule: > 0 draws the committed positions from softmax(confidence / alg_temp).")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="Dream and block rules: nucleus filtering of the candidates "
                                   "(Dream: applies at temperature 0 too; block: of the draw at temperature > 0, unused at 0).")
    top_k: Optional[int] = Field(None, ge=1, description="Dream and block rules: top-k filtering of the candidates "
                                 "(Dream: applies at temperature 0 too; block: of the draw at temperature > 0, unused at 0).")
    eps: float = Field(1e-3, gt=0, lt=1, description="Dream rule: the last timestep of linspace(1, eps, steps + 1).")

    @field_validator("sampler")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        if v != "auto" and registry.find("rule", v) is None:
            known = registry.names("rule")
            close = difflib.get_close_matches(v, known, n=1)
            raise ValueError(f"no decoding rule named {v!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                             + "; known: " + ", ".join(["auto"] + known))
        return v

    @model_validator(mode="after")
    def _rule(self) -> "GenerateSection":
        # "auto": the rule is the model family's, checked once the model is read (generate.rules.settings_for)
        if self.sampler != "auto":
            problems = rule_problems(self, self.sampler)
            if problems:
                raise KeyedError(*problems[0])
        return self


def rule_problems(generate: GenerateSection, rule: str) -> list[tuple[str, str]]:
    """(key below ``generate``, message) for each setting of ``generate`` that decoding rule ``rule`` refuses:
    the keys it ignores set away from their defaults, then its own check. The one place both the recipe (a rule
    named in it) and ``generate.rules.settings_for`` (``sampler: auto`` resolved to the family's rule) ask."""
    comp = registry.get("rule", rule, key="generate.sampler")
    problems = ignored_problems(generate, comp) + unused_settings_problems(generate, "rule", rule)
    return problems + (list(comp.check(generate)) if comp.check is not None else [])


def noise_problem(rule: str, family: str, likelihood: str) -> Optional[str]:
    """Why decoding rule ``rule`` cannot decode a ``family`` model trained with ``likelihood`` (its declaration's
    ``decodes`` names the noise processes it decodes), or None. Asked by ``generate`` once the model is loaded and
    by ``recipes check`` where the model can be read here."""
    decodes = registry.get("rule", rule, key="generate.sampler").traits.get("decodes")
    if decodes is None or likelihood in decodes:
        return None
    return (f"{rule}: {family} models use the {likelihood} likelihood; the {rule} rule decodes "
            f"{' or '.join(decodes)} diffusion")


# --------------------------------------------------------------------------- judge
class JudgeSection(Section):
    """Pairwise judging (`dllm-align judge`; docs/design.md#judging)."""

    judges: list[str] = Field(
        default_factory=lambda: ["gpt-4o-mini"],
        min_length=1,
        max_length=2,
        description="One or two judges: model names served at base_url, or 'rule:NAME' for rule judges "
        "(two judges add the majority vote and Cohen's kappa).",
    )
    base_url: str = Field("https://api.openai.com/v1", description="OpenAI-compatible endpoint (vLLM, SGLang, ...); the only host contacted.")
    api_key_env: str = Field(
        "OPENAI_API_KEY", description="Name of the environment variable holding the API key ('' for a server without authentication)."
    )
    template: Optional[str] = Field(
        None, description="Judging prompt file with {prompt}, {answer_a}, {answer_b} placeholders (default: the built-in template)."
    )
    concurrency: int = Field(8, ge=1, le=256, description="Requests in flight at once.")
    timeout: float = Field(60.0, gt=0, description="Seconds to wait on a connection or a response before retrying.")
    max_retries: int = Field(6, ge=0, description="Retries of one request on 429, 5xx, timeouts and dropped connections.")
    retry_base_delay: float = Field(
        1.0, ge=0, description="First backoff delay in seconds; doubles on each retry, with jitter (a Retry-After from the server wins)."
    )
    retry_max_delay: float = Field(60.0, ge=0, description="Cap on one backoff delay in seconds.")
    retry_after_max: float = Field(
        60.0, ge=0, le=86400, description="Longest wait a server's Retry-After may impose before one retry, in seconds (a server asking for longer is not asked again in the run: it exits 1 saying when to resume)."
    )
    max_parse_retries: int = Field(
        1, ge=0, description="Further requests when a reply holds no [[A]]/[[B]]/[[C]] verdict (each one shows the judge its reply and asks for the verdict alone); then the judgement counts as unjudgeable."
    )
    bootstrap: int = Field(5000, ge=100, description="Bootstrap resamples of prompts for the 90% intervals (paper: 5,000).")
    seed: int = Field(0, description="Seed of the bootstrap resamples.")
    temperature: Optional[float] = Field(0.0, ge=0, description="Judge sampling temperature (null: not sent, for reasoning models).")
    max_tokens: int = Field(1024, ge=1, description="Cap on the judge's reply length (sent as max_tokens).")
    max_completion_tokens: Optional[int] = Field(
        None, ge=1, description="Send this cap as max_completion_tokens instead of max_tokens (reasoning models reject max_tokens)."
    )
    allow_plain_http: bool = Field(False, description="Allow sending the key over plain http:// to a host that is not loopback.")
    env_proxy: bool = Field(False, description="Use the proxy named by HTTP(S)_PROXY for base_url (off: the environment is ignored).")
    batch: bool = Field(False, description="Use the Batch API (upload, create, poll, download) instead of live requests.")
    batch_poll_interval: float = Field(15.0, gt=0, description="First wait between two polls of a batch, in seconds (grows 1.5x).")
    batch_poll_max: float = Field(300.0, gt=0, description="Longest wait between two polls of a batch, in seconds.")
    batch_failed: Literal["live", "batch"] = Field(
        "live", description="Requests that failed inside a batch are retried live, or in new batches (up to batch_rounds)."
    )
    batch_rounds: int = Field(3, ge=1, description="With batch_failed: batch, the most batches one request is put into in a run.")
    prices: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="USD per million prompt and completion tokens, per judge name or '*' for all; adds a cost to results.json.",
    )
    batch_price_factor: float = Field(0.5, ge=0, le=1, description="Price of batch tokens relative to live ones (OpenAI: half).")
    length_threshold: float = Field(
        0.1, ge=0, description="Mark the AWR when the two sides' mean answer lengths differ by more than this fraction."
    )
    length_anchors: bool = Field(
        False, description="LC-AWR length anchors (AlpacaEval's): B's answers rewritten verbose and concise by "
        "length_anchors_model, each judged against B, enter the LC fit at weight 0.1 (rewrites and verdicts cached)."
    )
    length_anchors_model: Optional[str] = Field(
        None, description="The model that rewrites B's answers for the length anchors (default: the first API judge)."
    )
    difficulty_from: Optional[str] = Field(
        None, description="A second model's judge results against the same B (its outcomes.jsonl or run folder): "
        "its per-prompt outcomes are the LC fit's instruction-difficulty term."
    )
    difficulty_table: Optional[str] = Field(
        None, description="A published per-instruction difficulty table (AlpacaEval's, for its 805 prompts; a CSV "
        "with instruction or instruction_sha256 and difficulty): the LC fit's difficulty term when every judged "
        "prompt is in it (matched by text), recorded in results.json."
    )

    @model_validator(mode="after")
    def _distinct(self) -> "JudgeSection":
        if len(set(self.judges)) != len(self.judges):
            raise ValueError(f"judges: the same judge is listed twice ({self.judges[0]})")
        bad = [k for k, (p_in, p_out) in self.prices.items() if not (0 <= p_in < float("inf") and 0 <= p_out < float("inf"))]
        if bad:
            raise ValueError(f"prices: {bad[0]}: prices are finite numbers >= 0 (USD per million tokens)")
        if self.difficulty_from and self.difficulty_table:
            raise ValueError("difficulty_table: one difficulty term at a time (difficulty_from is set too)")
        return self


# --------------------------------------------------------------------------- ablate
class AblateSection(Section):
    """Sweeps of ``dllm-align ablate`` (the paper's Table 3 and Figure 1)."""

    betas: list[float] = Field(default_factory=lambda: [0.1, 0.2], description="ablate baseline: beta values (grid with lrs).")
    lrs: list[float] = Field(default_factory=lambda: [1e-6, 5e-6], description="ablate baseline: learning rates (grid with betas).")
    pairs: Optional[list[tuple[float, float]]] = Field(
        None, description="ablate baseline: explicit (beta, lr) settings instead of the betas x lrs grid (Table 3 uses three)."
    )
    baselines: list[Literal["global_mean", "none", "kl"]] = Field(
        default_factory=lambda: ["none", "global_mean", "kl"], description="ablate baseline: the reference points compared."
    )
    ratios: list[float] = Field(
        default_factory=lambda: [0.1, 0.5, 1.0], description="ablate imbalance: fractions of the subsampled class kept."
    )
    subsample: Literal["desirable", "undesirable", "both"] = Field(
        "both", description="ablate imbalance: which class is subsampled ('both': one sweep for each, as in Figure 1)."
    )
    balance_weights: bool = Field(True, description="ablate imbalance: set lambda_D * n_D = lambda_U * n_U (the paper's setting).")

    @model_validator(mode="after")
    def _ranges(self) -> "AblateSection":
        bad = [r for r in self.ratios if not 0 < r <= 1]
        if bad:
            raise ValueError(f"ratios must be in (0, 1], got {bad}")
        if any(b <= 0 for b in self.betas) or any(lr <= 0 for lr in self.lrs):
            raise ValueError("betas and lrs must be positive")
        return self


# --------------------------------------------------------------------------- evaluate
class EvalTask(Section):
    """Per-task settings of ``dllm-align evaluate`` (paper Appendix C, Table eval-config).

    Unset keys fall back to the ``generate`` section (decoding) and to the
    harness task's own defaults (shots)."""

    task: Optional[str] = Field(
        None, description="lm-evaluation-harness task or group name; default: this entry's key."
    )
    gen_length: Optional[int] = Field(None, ge=1, description="Tokens generated (default: generate.gen_length).")
    block_length: Optional[int] = Field(None, ge=1, description="Semi-autoregressive block (default: generate.block_length).")
    steps: Optional[int] = Field(None, ge=1, description="Sampler steps over the whole span (default: generate.steps).")
    num_fewshot: Optional[int] = Field(None, ge=0, description="Few-shot examples (default: the task's own).")
    limit: Optional[int] = Field(None, ge=1, description="Evaluate only the first N documents (smoke runs).")
    metric: Optional[str] = Field(
        None,
        description="Metric shown in the comparison table, as the harness names it, e.g. 'exact_match,flexible-extract' (default: the task's first).",
    )
    apply_chat_template: Optional[bool] = Field(None, description="Override evaluate.apply_chat_template for this task.")


class EvaluateSection(Section):
    tasks: dict[str, EvalTask] = Field(
        default_factory=dict, description="Tasks to run, keyed by the name shown in the table (see EvalTask)."
    )
    mc_num: int = Field(32, ge=1, description="Monte Carlo draws of the ELBO for each loglikelihood request.")
    mc_seed: int = Field(0, description="Mask seed of those draws; masks are a pure function of (seed, request text).")
    stratified: bool = Field(
        True, description="Evenly spaced l across the draws of a request (LLaDA's evaluation does this)."
    )
    greedy_check: bool = Field(
        False,
        description="Compute is_greedy for loglikelihood requests by decoding the continuation one token per step (L extra forwards); off: reported False.",
    )
    batch_size: int = Field(8, ge=1, description="Noisy sequences per forward (loglikelihood) / prompts per batch (generation).")
    max_length: Optional[int] = Field(
        None, ge=8, description="Cap on prompt + continuation tokens; the prompt's head gives way (default: the model's context size)."
    )
    packing: bool = Field(
        True,
        description="Pack each forward's noisy sequences into rows of max_length with block-diagonal attention "
        "(the same ELBO values as padded rows up to float rounding, no compute on padding).",
    )
    apply_chat_template: bool = Field(False, description="Wrap prompts in the model's chat template (instruct models).")
    fewshot_as_multiturn: bool = Field(True, description="With the chat template: few-shot examples as separate turns.")
    system_instruction: Optional[str] = Field(None, description="System message put before every prompt.")
    include_path: Optional[str] = Field(None, description="Folder of extra task YAMLs (besides the bundled ones).")
    limit: Optional[int] = Field(None, ge=1, description="Documents per task for every task (smoke runs); a task's own limit wins.")
    bootstrap_iters: int = Field(100000, ge=0, description="Bootstrap resamples for stderr of non-mean metrics (0: none).")
    log_samples: bool = Field(True, description="Write every document's prompt, response and score (samples_<task>.jsonl).")
    allow_code_execution: bool = Field(
        False, description="Let code tasks (HumanEval) run model-written code on this machine."
    )
    compare: Optional[str] = Field(None, description="A second checkpoint evaluated the same way and put side by side.")

    @field_validator("tasks", mode="before")
    @classmethod
    def _bare_keys(cls, v):
        # `gsm8k:` with nothing under it means "all defaults".
        if isinstance(v, dict):
            return {k: ({} if t is None else t) for k, t in v.items()}
        return v


# --------------------------------------------------------------------------- online
def verifier_forms() -> list[str]:
    """How each verifier is written in a spec (``sort``, ``regex:PATTERN``, ...), a user's function last."""
    return [c.name + (f":{c.traits['argument']}" if "argument" in c.traits else "")
            for c in registry.components("verifier").values()] + ["package.module:function"]


def split_verifier(spec: str) -> tuple[Optional["registry.Component"], Optional[str]]:
    """The registered verifier a spec selects and its argument (the text after ':'); (None, None) for a
    ``package.module:function`` spec or an unknown name. A verifier that takes no argument is selected by its
    bare name only (``name:x`` stays a user's module ``name``)."""
    name, sep, arg = spec.partition(":")
    comp = registry.find("verifier", name)
    if comp is None or (sep and "argument" not in comp.traits):
        return None, None
    return comp, (arg if sep else None)


def verifier_problem(spec) -> Optional[str]:
    """What is wrong with a verifier spec (``online.rule``, ``--rule``) as written, or None; nothing heavy is
    imported (``dllm_align.online.verifiers`` then loads the verifier, a user's function with its arity checked)."""
    if not isinstance(spec, str) or not spec.strip():
        return "name a verifier: " + ", ".join(verifier_forms())
    comp, arg = split_verifier(spec)
    if comp is not None:
        takes = comp.traits.get("argument")
        if takes is not None and arg is None:
            return f"the verifier {comp.name!r} needs its argument: {comp.name}:{takes}"
        check = comp.traits.get("check_argument")
        return check(arg) if check is not None and arg is not None else None
    if ":" in spec:
        return spec_problem(spec)
    close = difflib.get_close_matches(spec, registry.names("verifier"), n=1)
    return (f"unknown verifier {spec!r}" + (f" (did you mean {close[0]!r}?)" if close else "") + "; known: "
            + ", ".join(verifier_forms()))


class OnlineSection(ComposedSection):
    """Online ELBO-KTO (``dllm-align online``; ``demo`` runs it when a recipe has this section)."""

    SECTION: ClassVar[str] = "online"

    rounds: int = Field(2, ge=1, le=100, description="Rounds of label -> reference -> ELBO-KTO.")
    rule: str = Field("sort", description="The verifier: a registered one by name (sort, math_answer, regex:PATTERN, "
                      "judge:MODEL, ...; its own settings under online.<name>) or package.module:function.")
    n: int = Field(4, ge=1, le=1024, description="Samples per prompt and round.")
    limit: Optional[int] = Field(None, ge=1, description="Only the first N prompts of data.train.")
    reference: Literal["initial", "previous"] = Field("initial", description="Each round's reference: the initial model or the policy entering the round.")
    keep_uniform: bool = Field(True, description="Keep prompts whose samples are all desirable or all undesirable.")
    greedy: bool = Field(True, description="Also label each prompt's greedy decode (the recipe's decoding, as generate and the held-out greedy share decode) every round and train on it with the samples.")
    temperature: Optional[float] = Field(None, ge=0, le=10, description="Sampling temperature (default: generate.temperature, or 1.0 when that is greedy; 0 only with n = 1).")
    heldout: Optional[str] = Field(None, description="Held-out prompts file for the per-round evaluation (default: data.test).")
    heldout_limit: Optional[int] = Field(None, ge=1, description="Only the first N held-out prompts.")
    heldout_n: int = Field(4, ge=1, le=1024, description="Samples per held-out prompt for the sampled held-out share (greedy: one).")
    unsure_judge: Optional[str] = Field(
        None, min_length=1, description="A judge model (served at judge.base_url; absolute mode, as --rule judge:MODEL) "
        "that the verifier's unsure samples are sent to for a yes/no verdict; unset: they are left out of training "
        "and counted.")
    keep: Literal["guard", "last", "best"] = Field(
        "guard", description="The run's final model. guard: the last round's, except that a round whose held-out greedy "
        "share falls below the previous model's 90% interval is rolled back (the previous model is kept) and the loop "
        "stops there; last: the last round's, whatever it scored; best: the round with the highest held-out greedy share.")

    @field_validator("rule")
    @classmethod
    def _rule(cls, v):
        problem = verifier_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _verifier_ignores(self) -> "OnlineSection":
        # the section's own check finds the selected component by the whole spec; a verifier is named before ':'
        comp, _ = split_verifier(self.rule)
        problems = ignored_problems(self, comp) if comp is not None else []
        if problems:
            raise KeyedError(*problems[0])
        return self


# --------------------------------------------------------------------------- recipe
class Recipe(Section):
    name: str = "unnamed"
    description: str = ""
    output_dir: str = Field("runs/unnamed", description="Where a run writes (overridden by --output-dir).")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    reference: ReferenceSection = Field(default_factory=ReferenceSection)
    train: TrainSection = Field(default_factory=TrainSection)
    generate: GenerateSection = Field(default_factory=GenerateSection)
    judge: JudgeSection = Field(default_factory=JudgeSection)
    ablate: AblateSection = Field(default_factory=AblateSection)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)
    online: Optional[OnlineSection] = None

    @model_validator(mode="after")
    def _consistency(self) -> "Recipe":
        problems = []
        if self.train.n_mc is not None and self.train.n_mc > self.reference.n_mc:
            problems.append(
                f"train.n_mc ({self.train.n_mc}) exceeds reference.n_mc ({self.reference.n_mc}): the cache holds only that many draws"
            )
        if self.train.global_batch_size is not None and self.train.grad_accum != 1:
            problems.append("train.global_batch_size and train.grad_accum are both set; set one (grad_accum is derived from the other)")
        if self.train.global_batch_size is not None and self.train.global_batch_size % self.train.batch_size:
            problems.append(
                f"train.global_batch_size ({self.train.global_batch_size}) is not a multiple of train.batch_size ({self.train.batch_size})"
            )
        if self.reference.stratified and self.train.n_mc is not None and self.train.n_mc != self.reference.n_mc:
            problems.append(
                f"train.n_mc ({self.train.n_mc}) must equal reference.n_mc ({self.reference.n_mc}) when reference.stratified "
                "is on: a prefix of stratified draws covers only the low strata"
            )
        for kind in registry.KINDS.values():
            # the selected components' checks against the rest of the recipe (their ignored keys: their section's)
            section = getattr(self, kind.section)
            if kind.selector is None or section is None or kind.check_on != "recipe":
                continue  # a section-checked kind (a decoding rule) ran its check in its section's validator
            comp = registry.find(kind.name, getattr(section, kind.selector))
            if comp is not None and comp.check is not None:
                problems.extend(comp.check(self))
        if ((self.model.attn_implementation or "").startswith("flash") and self.train.mixed_precision == "no"
                and self.model.dtype not in ("bfloat16", "float16")):
            # flash-attn kernels take only bf16 / fp16 inputs: an fp32 forward stops inside the kernel on CUDA
            problems.append(
                f"model.attn_implementation {self.model.attn_implementation} needs bf16 or fp16 compute, but "
                "train.mixed_precision is 'no' (fp32): set train.mixed_precision: bf16, or use sdpa"
            )
        for key, t in self.evaluate.tasks.items():
            g = t.gen_length or self.generate.gen_length
            b = t.block_length or self.generate.block_length
            s = t.steps or self.generate.steps
            if self.generate.sampler != "auto":
                # a named rule checks the task's decoding as its own (a rule without blocks has no block check)
                task = self.generate.model_copy(update={"gen_length": g, "block_length": b, "steps": s})
                problems += [f"evaluate.tasks.{key}: {k}: {m}" for k, m in rule_problems(task, self.generate.sampler)[:1]]
            elif g % b:
                problems.append(f"evaluate.tasks.{key}: gen_length ({g}) must be a multiple of block_length ({b})")
            elif s % (g // b):
                problems.append(f"evaluate.tasks.{key}: steps ({s}) must be a multiple of the number of blocks ({g // b})")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def train_n_mc(self) -> int:
        return self.train.n_mc or self.reference.n_mc


for _section in (ModelSection, ReferenceSection, TrainSection, GenerateSection, OnlineSection):
    registry.note_section_fields(_section.SECTION, _section.model_fields)
