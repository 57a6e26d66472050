"""The one training loop: ELBO-KTO, masked-diffusion SFT and paired VRPO (SPEC.md sections 4 and 6).

The three objectives differ only in the loss and in the unit of the batch
(an example, or a (chosen, rejected) pair for VRPO); everything else - data
order, the Monte Carlo ELBO with masks shared with the reference, gradient
accumulation, checkpoints, logging - is this one loop, run under
``accelerate`` (1 CPU process, DDP on 8 GPUs, or FSDP).

The optimiser step's batch and the baseline (SPEC.md section 4)
    A step consumes one *global batch* of ``G = batch_size x grad_accum x
    processes`` units, planned from (seed, epoch) alone
    (:func:`dllm_align.data.batching.plan_batches`), so the plan does not depend on
    how the work is split. ELBO-KTO's baseline b is the mean margin over the
    whole global batch. With one micro-batch per process the margins are
    all-gathered between the forward and the backward. With gradient
    accumulation every margin of the step is needed before the first backward,
    so a no-grad pass over this process's micro-batches (same masks: they are a
    pure function of the example id) computes them first; then the gradient
    pass uses that b. Each process's loss is divided by G / processes, because
    DDP (and FSDP) average gradients over processes: the result is the
    gradient of (1/G) sum_i lambda_i (1 - sigmoid(beta s_i (r_i - b))) for any
    split of the G units over processes and micro-batches.

Learning-rate schedule
    Linear warm-up over ``ceil(warmup_ratio x total)`` steps, reaching the peak
    at the last warm-up step (the first step does not waste itself on lr 0),
    then cosine decay towards 0 (or linear / constant).

Checkpoints
    ``checkpoints/step-N/`` holds the model in ``save_pretrained`` layout
    (safetensors, config, tokenizer; LoRA merged, plus the adapter itself), the
    optimiser state (plain tensors, read back with ``weights_only=True``), the
    RNG state (safetensors), ``trainer_state.json`` (step, data position,
    metrics history needed to continue) and ``checksums.json`` (size and
    sha256 of every other file). It is written to a temporary folder, fsynced
    and renamed into place, so a folder named ``step-N`` is always complete.
    ``--resume`` verifies every checksum of the newest one before loading
    anything (a truncated or modified file is refused by name), then
    continues; the data order, the masks and the learning rate are functions
    of the step, so the resumed run follows the uninterrupted one exactly.
    ``final/`` is written the same way; an export killed after it was complete
    but before the rename is finished by the next ``--resume``.

Test hooks (:mod:`dllm_align.core.faults`)
    ``DLLM_ALIGN_FAULT=kill_after_step:N``, ``kill_in_checkpoint:N`` or
    ``kill_in_final`` makes the main process SIGKILL itself after optimiser
    step N, halfway through writing checkpoint N, or with ``final/`` written
    but not yet renamed into place (used by the resume tests).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from dllm_align.training import checkpoint
from dllm_align.training.checkpoint import (
    FINAL, METRICS, TMP_FINAL, _clear_previous, prepare_output,
)
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.data.examples import kl_examples, load_training_examples, make_collate, make_units, step_count



# --------------------------------------------------------------------------- schedule
def lr_at(step: int, total: int, peak: float, warmup_ratio: float, kind: str) -> float:
    """Learning rate of optimiser step ``step`` (0-based) out of ``total`` (module docstring)."""
    warm = math.ceil(warmup_ratio * total) if warmup_ratio > 0 else 0
    if step < warm:
        return peak * (step + 1) / warm
    if kind == "constant":
        return peak
    progress = (step - warm) / max(1, total - warm)
    if kind == "linear":
        return peak * max(0.0, 1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- the policy as a module
class PolicyScorer(torch.nn.Module):
    """The policy wrapped so that DDP / FSDP see every forward: log p at the scored positions only.

    The ELBO code calls :meth:`MaskPredictor.target_logprobs`, which runs the
    network body and the output head separately; going through this module's
    ``forward`` keeps the distributed wrappers (and accelerate's autocast) in
    the loop.
    """

    def __init__(self, mp):
        super().__init__()
        self.model = mp.model
        self.__dict__["_mp"] = mp  # not a submodule: it only holds references

    def forward(self, input_ids, attention_mask, rows, cols, targets, packed=None):
        return self._mp.target_logprobs(input_ids, attention_mask, rows, cols, targets, packed=packed)


class _ViaModule:
    """Duck-typed MaskPredictor for ``elbo_draws`` that routes through a (wrapped) PolicyScorer."""

    def __init__(self, module, mask_token_id: int):
        self.module = module
        self.mask_token_id = mask_token_id

    def target_logprobs(self, input_ids, attention_mask, rows, cols, targets, packed=None):
        return self.module(input_ids, attention_mask, rows, cols, targets, packed)


# --------------------------------------------------------------------------- margin watch
@dataclass
class MarginWatch:
    """Warn when the desirable class's mean margin keeps falling (SPEC.md section 4 caution).

    The per-step desirable margins are averaged over windows of ``window``
    steps; three consecutive falling windows ending below zero trigger one
    warning (again only after a new fall of three windows).
    """

    window: int
    current: list = field(default_factory=list)
    means: list = field(default_factory=list)
    warned_at: int = -1

    def add(self, step: int, desirable_margin: Optional[float]) -> Optional[str]:
        if desirable_margin is None or not math.isfinite(desirable_margin):
            return None
        self.current.append(desirable_margin)
        if len(self.current) < self.window:
            return None
        self.means.append(float(np.mean(self.current)))
        self.current = []
        m = self.means
        if len(m) >= 4 and m[-1] < m[-2] < m[-3] < m[-4] and m[-1] < 0 and len(m) - self.warned_at >= 3:
            self.warned_at = len(m)
            return (
                f"step {step}: the desirable rows' mean margin has fallen for 3 windows of {self.window} steps "
                f"({m[-4]:+.3g} -> {m[-1]:+.3g}); both classes may be pushed down (likelihood displacement). "
                "Consider a lower train.lr or a smaller train.lambda_undesirable."
            )
        return None

    def state(self) -> dict:
        return {"window": self.window, "current": self.current, "means": self.means, "warned_at": self.warned_at}

    @classmethod
    def from_state(cls, d: dict, window: int) -> "MarginWatch":
        if d.get("window") != window:
            return cls(window)
        return cls(window, list(d["current"]), list(d["means"]), int(d["warned_at"]))


# --------------------------------------------------------------------------- run setup
@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    examples: int
    last_metrics: dict

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else float("nan")


def _fault(kind: str, step: Optional[int] = None) -> None:
    from dllm_align.core import faults

    faults.at(kind, step)


def make_accelerator(recipe):
    from accelerate import Accelerator
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    from dllm_align.core.console import warn

    from dllm_align.models.precision import resolve_mixed_precision

    cuda = torch.cuda.is_available()
    mp = resolve_mixed_precision(recipe.train.mixed_precision, "cuda" if cuda else "cpu")
    trackers = []
    for t in recipe.train.trackers:
        ok = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[t]()
        if ok:
            trackers.append(t)
        else:
            warn(f"train.trackers: {t} is not installed; not logging to it (pip install {t})")
    from dllm_align.models.precision import accelerator_kwargs

    return Accelerator(
        cpu=not cuda,
        mixed_precision=mp,
        kwargs_handlers=accelerator_kwargs(recipe),
        log_with=trackers or None,
        project_dir=recipe.output_dir,
    )


def grad_accum_for(t, world: int) -> int:
    """Micro-batches per step: train.grad_accum, or derived from train.global_batch_size and the process count."""
    if t.global_batch_size is None:
        return t.grad_accum
    per = t.batch_size * world
    if t.global_batch_size % per:
        raise UserError(
            f"train.global_batch_size {t.global_batch_size} is not a multiple of train.batch_size {t.batch_size} "
            f"x {world} process(es)",
            hint="change the process count or train.batch_size so that they divide the global batch",
        )
    return t.global_batch_size // per


def fsdp_wrap_family_layer(plugin, model) -> None:
    """Make FSDP wrap the model family's decoder layer.

    The shipped accelerate config names ``LlamaDecoderLayer`` (LLaDA's native body);
    a Dream (Qwen2) or LLaDA-MoE (Qwen3-MoE) body has other layer classes, and
    accelerate would stop on a class it cannot find. A config that names classes
    the model has is left as it is.
    """
    from dllm_align.models.families.base import Family

    cls = Family.decoder_layer_class(model)
    if cls is None:
        return
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    present = {type(m).__name__ for m in model.modules()}
    if not names or any(n not in present for n in names):
        plugin.transformer_cls_names_to_wrap = [cls.__name__]


def _is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v if v is not None else "null"
        else:
            out[key] = json.dumps(v)
    return out


def class_weights(recipe) -> tuple[float, float]:
    if recipe.data.weights_file:
        from dllm_align.core.console import info
        from dllm_align.data.imbalance import read_weights_file

        ld, lu = read_weights_file(recipe.data.weights_file)
        info(f"class weights from {recipe.data.weights_file}: lambda_D {ld:g}, lambda_U {lu:g}")
        return ld, lu
    return recipe.train.lambda_desirable, recipe.train.lambda_undesirable


def build_optimizer(named_parameters, t, *, fused_ok: bool = True) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (``train`` section t); no weight decay on biases and norms.

    The fused kernel (one pass over each tensor, torch >= 2.4 on CPU and CUDA) is used
    when every parameter is a plain floating tensor on such a device and fp16 loss
    scaling is off; it gives the same update as the per-tensor loop up to float
    rounding, ~10x faster on CPU (where the loop's step is a visible part of a small
    model's training step). FSDP's sharded parameters keep the default implementation.
    """
    decay, no_decay = [], []
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        (no_decay if (name.endswith("bias") or "norm" in name.lower()) else decay).append(p)
    params = decay + no_decay
    fused = (
        fused_ok
        and t.mixed_precision != "fp16"
        and bool(params)
        and all(type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    )
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        fused=fused or None,
    )


@contextlib.contextmanager
def _seeded_rng(key: tuple, device):
    import hashlib

    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def clip_global_grad_norm(params: list, max_norm: float, *, sharded: bool, device) -> float:
    """Clip by the norm of the whole gradient, the same on every rank; returns that norm.

    Under FSDP each rank holds a disjoint shard of every gradient (FSDP1 views
    on the flat shard, FSDP2 DTensor shards): the squared norms are summed over
    the ranks, so every rank gets the true global norm, clips by the same
    factor and sees the same non-finite value (a NaN or inf anywhere reaches
    all ranks through the sum). The per-shard fallback accelerate uses when
    not given every parameter (LoRA: only the adapters train) clipped each rank
    by its own shard's norm (issue 13, defect 3). Under DDP and on one process
    the gradients are whole and identical on every rank.
    """
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():
            sq += g.detach().double().pow(2).sum().to(device)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if dist and sharded:
        torch.distributed.all_reduce(sq, op=torch.distributed.ReduceOp.SUM)
    elif dist:
        # Whole gradients are equal on every rank after DDP's all-reduce; the decision to stop
        # is still made together (one flag), so no rank can raise while another waits.
        bad = torch.tensor(0.0 if torch.isfinite(sq) else 1.0, device=device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item():
            sq = torch.full_like(sq, float("nan"))
    norm = float(sq.sqrt())
    if math.isfinite(norm) and math.isfinite(max_norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.detach().mul_(coef)
    return norm


# --------------------------------------------------------------------------- the loop
class _Run:
    """State of one training run; :func:`train` is its readable driver."""

    def __init__(self, recipe, accelerator, resume_from: Optional[Path], examples: Optional[list]):
        from dllm_align.core.console import info
        from dllm_align.objective.elbo import DrawConfig
        from dllm_align.models.load import load_from_section
        from dllm_align.models.precision import precision_for

        self.recipe = recipe
        self.acc = accelerator
        self.t = recipe.train
        self.out = Path(recipe.output_dir)
        self.main = accelerator.is_main_process
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.fsdp = _is_fsdp(accelerator)
        self.resume_from = resume_from

        # -- the policy (fp32 master weights unless the recipe pins a dtype; autocast does bf16 on GPU)
        section = recipe.model
        if section.dtype == "auto":
            section = section.model_copy(update={"dtype": "float32"})
        if self.fsdp and accelerator.state.fsdp_plugin.activation_checkpointing:
            section = section.model_copy(update={"gradient_checkpointing": False})  # FSDP does it
        load_dev = "cpu" if self.fsdp else accelerator.device
        lora = self.t.lora
        src = str(resume_from) if (resume_from is not None and not lora.enabled) else None
        self.mp = load_from_section(section, load_dev, name_or_path=src)
        # One precision for the policy and the reference (dllm_align.models.precision): the
        # policy's forward computes under it whatever wraps the module (DDP, FSDP).
        self.precision = precision_for(recipe, accelerator.device)
        self.mp.set_precision(self.precision)
        self.tokenizer = self.mp.tokenizer
        if lora.enabled:
            self._apply_lora(resume_from)
        self.mp.model.train()

        # -- data
        if examples is None:
            examples = load_training_examples(recipe, self.tokenizer, quiet=not self.main)
        self.examples = examples
        self.units = make_units(examples, self.t.objective, self.t.sft_rows)
        self.rows_per_unit = 2 if self.t.objective == "vrpo" else 1
        self.collate = make_collate(recipe, self.tokenizer)
        self.pack_length = recipe.data.max_length if recipe.data.padding == "packed" else None
        self.accum = grad_accum_for(self.t, self.world)
        self.G = self.t.batch_size * self.accum * self.world
        if len(self.units) < self.G:
            what = "pairs" if self.t.objective == "vrpo" else "rows"
            raise UserError(
                f"the training set has {len(self.units)} {what}, fewer than one global batch "
                f"(train.batch_size {self.t.batch_size} x grad_accum {self.accum} x {self.world} process(es) = {self.G})"
            )
        self.lengths = [sum(ex.length for ex in u) for u in self.units]
        self.steps_per_epoch, self.total = step_count(self.t, len(self.units), self.G)
        self.kl = self.t.objective == "elbo_kto" and self.t.baseline == "kl"
        if self.kl and self.G < 2:
            raise UserError("train.baseline kl needs a global batch of at least 2 rows (each prompt is paired with another row's completion)")
        self.dropped_per_epoch = len(self.units) - self.steps_per_epoch * self.G
        self._plans: dict[int, list[list[int]]] = {}
        self.lambda_d, self.lambda_u = class_weights(recipe)
        if self.t.objective == "elbo_kto" and self.main:
            from dllm_align.data.imbalance import check_weight_ratio

            n_d = sum(1 for u in self.units if u[0].label)
            # Weights the recipe sets on purpose (the demo's lambda_U = 0.3) are reported, not warned about.
            chosen = bool({"lambda_desirable", "lambda_undesirable"} & self.t.model_fields_set) or bool(recipe.data.weights_file)
            check_weight_ratio(n_d, len(self.units) - n_d, self.lambda_d, self.lambda_u, chosen=chosen)

        # -- draws: the policy uses the reference's masks (draws 0..K'-1 of the K-draw set)
        self.cfg = DrawConfig.from_reference(recipe.reference)
        self.k = recipe.train_n_mc()
        self.draws = list(range(self.k))

        # -- reference
        self.cache = None
        self.ref_mp = None
        if self.t.objective != "sft":
            self._setup_reference()

        # -- distributed wrapping, optimiser
        if self.fsdp:
            from dllm_align.models.precision import fsdp_mixed_precision

            # accelerate's default casts parameters and buffers (the rotary frequencies) to
            # bf16 and reduces gradients in bf16; ours keeps fp32 and lets autocast do bf16.
            plugin = accelerator.state.fsdp_plugin
            plugin.mixed_precision_policy = fsdp_mixed_precision(getattr(plugin, "fsdp_version", 1))
            fsdp_wrap_family_layer(plugin, self.mp.model)
        scorer = PolicyScorer(self.mp)
        if getattr(accelerator, "is_fsdp2", False):
            # FSDP2 swaps the parameters for sharded DTensors: the optimiser is built on the
            # originals and handed over with the model, which accelerate then remaps.
            opt = build_optimizer(scorer.named_parameters(), self.t, fused_ok=False)
            self.module, self.optimizer = accelerator.prepare(scorer, opt)
        else:
            self.module = accelerator.prepare(scorer)
            opt = build_optimizer(self.module.named_parameters(), self.t, fused_ok=not self.fsdp)
            self.optimizer = accelerator.prepare(opt)
        self.policy = _ViaModule(self.module, self.mp.mask_token_id)
        self.params = [p for p in self.module.parameters() if p.requires_grad]

        # -- state to continue
        self.step = 0
        self.margin_watch = MarginWatch(self.t.margin_watch_window)
        self.examples_seen = 0
        self.tokens_seen = 0
        self.elapsed = 0.0
        if resume_from is not None:
            self._load_state(resume_from)
        if self.main:
            n_params = sum(p.numel() for p in self.params)
            info(
                f"train: objective {self.t.objective}, {len(self.units):,} {'pairs' if self.rows_per_unit == 2 else 'rows'}, "
                f"global batch {self.G} ({self.world} process(es) x {self.accum} micro-batch(es) x {self.t.batch_size}), "
                f"{self.total} step(s), K={self.k} draws, {n_params:,} trainable parameters, "
                f"mixed precision {accelerator.mixed_precision}"
            )
            if self.t.objective != "sft":  # the step line's abbreviations, said once
                info(
                    "train: step lines show r+ / r- = mean reward margin (policy ELBO minus reference ELBO, nats) of "
                    "the desirable / undesirable rows, b = the step's mean-margin baseline, sat = share of rows with a "
                    "saturated sigmoid (no gradient)"
                )
            if self.dropped_per_epoch:
                info(f"train: {self.dropped_per_epoch} row(s) per epoch do not fill a global batch and are left out of that epoch")
            if accelerator.device.type == "cpu" and self.t.mixed_precision == "auto":
                info("train: bf16 autocast is off (no CUDA device: CPU bf16 is slow and changes the numbers)")

    # ---------------------------------------------------------------- setup helpers
    def _apply_lora(self, resume_from: Optional[Path]) -> None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UserError("train.lora.enabled needs the peft package", hint="pip install 'dllm-align[lora]'") from None
        lora = self.t.lora
        cfg = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none"
        )
        try:
            get_peft_model(self.mp.model, cfg)  # injects the adapter layers into mp.model in place
        except ValueError as e:
            raise UserError(f"train.lora.target_modules: {str(e).splitlines()[0][:200]}") from None
        if resume_from is not None:
            from safetensors.torch import load_file

            adapter = load_file(str(resume_from / "adapter.safetensors"))
            named = dict(self.mp.model.named_parameters())
            extra = sorted(set(adapter) - set(named))
            if extra:
                raise UserError(
                    f"cannot resume from {resume_from}: its LoRA adapter has weights this run's model lacks ({extra[0]})",
                    hint="resume with the recipe's original train.lora settings and model",
                )
            for k, v in adapter.items():
                if named[k].shape != v.shape:
                    raise UserError(
                        f"cannot resume from {resume_from}: LoRA weight {k} is {tuple(v.shape)} there but {tuple(named[k].shape)} now "
                        "(train.lora.r or the model changed)"
                    )
                named[k].data.copy_(v)

    def _setup_reference(self) -> None:
        from dllm_align.training import reference as ref
        from dllm_align.core.console import info

        r = self.recipe.reference
        if r.mode == "online":
            self.ref_mp = ref.load_reference(self.recipe, self.acc.device)
            if self.main:
                info(f"train: reference computed online ({ref.reference_name(self.recipe)}, resident)")
            return
        folder = ref.cache_dir(self.recipe)
        cache = ref.ReferenceCache.open(folder)
        fp = ref.fingerprint(
            self.recipe,
            tokenizer=self.tokenizer,
            mask_token_id=self.mp.mask_token_id,
            device=self.acc.device,
            examples=self.examples,
            known_files=cache.weight_files(),
        )
        used = [ex for u in self.units for ex in u]
        if self.kl:
            from dllm_align.data.examples import planned_batches

            pairs = {}
            for batch in planned_batches(self.recipe, self.lengths, self.G, self.total):
                for ex in kl_examples([self.units[i][0] for i in batch], self.recipe.data.max_length):
                    pairs.setdefault(ex.id, ex)
            missing = next((i for i in pairs if i not in cache._digests), None)
            if missing is not None:
                raise UserError(
                    f"reference cache {folder} holds no reference ELBOs for the kl baseline's mismatched pairs "
                    f"(e.g. '{missing}'; the cache was made with train.baseline {cache.manifest['fingerprint'].get('baseline')!r})",
                    hint="run `dllm-align precompute-ref` with this recipe: train.baseline kl and the same "
                    "train.global_batch_size, train.seed, data.group_by_length and step count",
                )
            used += list(pairs.values())
        cache.check(fp, used, self.k)
        self.cache = cache
        if self.main:
            info(f"train: reference from cache {folder} (K={cache.K}, using {self.k})")

    # ---------------------------------------------------------------- data order
    def plan(self, epoch: int) -> list[list[int]]:
        from dllm_align.data.batching import plan_batches

        if epoch not in self._plans:
            self._plans = {
                epoch: plan_batches(
                    self.lengths, self.G, self.t.seed, epoch, self.recipe.data.group_by_length, drop_last=True
                )
            }
        return self._plans[epoch]

    def micro_batches(self, step: int) -> list[list[tuple]]:
        """This process's micro-batches of global step ``step`` (lists of units)."""
        from dllm_align.data.batching import shard

        epoch, j = divmod(step, self.steps_per_epoch)
        batch = self.plan(epoch)[j]
        mine = shard(batch, self.rank, self.world, self.t.batch_size)
        assert len(mine) == self.accum, (len(mine), self.accum)
        return [[self.units[i] for i in m] for m in mine]

    def kl_micro_batches(self, step: int) -> list[list]:
        """This process's mismatched pairs of step ``step`` (``train.baseline: kl``): pair i goes where row i goes."""
        from dllm_align.data.batching import shard

        epoch, j = divmod(step, self.steps_per_epoch)
        batch = self.plan(epoch)[j]
        pairs = kl_examples([self.units[i][0] for i in batch], self.recipe.data.max_length)
        return [[pairs[p] for p in m] for m in shard(list(range(len(batch))), self.rank, self.world, self.t.batch_size)]

    @torch.no_grad()
    def kl_baseline(self, kl_micro: list[list]) -> torch.Tensor:
        """z0 of the step (:func:`dllm_align.objective.losses.kl_reference_point`): every process's pairs, every micro-batch."""
        from dllm_align.objective.losses import kl_reference_point

        total = torch.zeros(2, dtype=torch.float64, device=self.acc.device)
        for exs in kl_micro:
            b = self._to_dev(self.collate(exs))
            r = self.policy_elbo(b).float() - self.reference_elbo(b)
            total[0] += r.double().sum()
            total[1] += r.numel()
        if self.world > 1:
            total = self.acc.reduce(total, reduction="sum")
        return kl_reference_point(total[0], total[1]).to(self.acc.device)

    # ---------------------------------------------------------------- ELBO values
    def _to_dev(self, batch: dict) -> dict:
        dev = self.acc.device
        out = dict(batch)
        for k in ("input_ids", "attention_mask", "completion_mask", "completion_len"):
            if out.get(k) is not None:
                out[k] = out[k].to(dev)
        return out

    def policy_elbo(self, batch: dict) -> torch.Tensor:
        """B_hat_policy [B] (mean of draws 0..K'-1), differentiable when grad is on."""
        from dllm_align.objective.elbo import elbo_draws

        v = elbo_draws(
            self.policy,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            batch["ids"],
            self.cfg,
            max_rows_per_forward=self.t.rows_per_forward,
            draws=self.draws,
            pack_length=self.pack_length,
        )
        return v.mean(dim=1)

    @torch.no_grad()
    def reference_elbo(self, batch: dict) -> torch.Tensor:
        """B_hat_ref [B] with the same draws, from the cache or the resident reference."""
        if self.cache is not None:
            return self.cache.lookup(batch["ids"], self.k).mean(dim=1).to(self.acc.device)
        from dllm_align.objective.elbo import elbo_draws

        v = elbo_draws(
            self.ref_mp,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            batch["ids"],
            self.cfg,
            max_rows_per_forward=self.t.rows_per_forward,
            draws=self.draws,
            pack_length=self.pack_length,
        )
        return v.float().mean(dim=1)

    def _global_mean(self, local: torch.Tensor) -> torch.Tensor:
        allv = self.acc.gather(local.detach().float().contiguous()) if self.world > 1 else local.detach().float()
        return allv.double().mean().float()

    # ---------------------------------------------------------------- one optimiser step
    def _same_dropout(self, micro: int):
        """Seed the RNG per (step, rank, micro-batch) when LoRA dropout is on.

        With gradient accumulation the baseline comes from a no-grad pass over the
        step's micro-batches before the gradient pass; both passes draw their dropout
        masks from this seed, so the baseline is the mean of exactly the margins the
        gradient pass differentiates (issue 13, defect 8). The global RNG is restored
        afterwards, so nothing else changes.
        """
        if not (self.t.lora.enabled and self.t.lora.dropout > 0):
            return contextlib.nullcontext()
        return _seeded_rng((self.t.seed, self.step, self.rank, micro), self.acc.device)

    def _sync(self, last: bool):
        return contextlib.nullcontext() if last or self.world == 1 else self.acc.no_sync(self.module)

    def run_step(self, micro: list[list[tuple]], kl_micro: Optional[list[list]] = None) -> dict:
        """Forward/backward over this process's micro-batches; returns summed metrics (local).

        ``kl_micro``: this process's mismatched pairs (``train.baseline: kl``).
        """
        from dllm_align.objective.losses import elbo_kto_loss, sft_loss, vrpo_loss

        batches = []
        for units in micro:
            rows = [ex for u in units for ex in u]  # vrpo: chosen, rejected, chosen, rejected, ...
            batches.append(self._to_dev(self.collate(rows)))
        norm = self.G / self.world  # DDP averages over processes: this makes the sum over all units / G
        acc = {"loss_sum": 0.0, "n": 0, "n_d": 0, "n_u": 0, "r_d": 0.0, "r_u": 0.0, "saturated": 0, "accuracy": 0.0, "baseline": float("nan")}
        acc["tokens"] = sum(ex.length for units in micro for u in units for ex in u)  # real tokens, padding excluded
        obj = self.t.objective
        A = len(batches)

        if obj == "elbo_kto":
            refs = [self.reference_elbo(b) for b in batches]
            baseline = None
            if self.t.baseline == "none":
                baseline = torch.zeros((), device=self.acc.device)
            elif self.t.baseline == "kl":
                baseline = self.kl_baseline(kl_micro)
            elif A > 1:
                margins = []
                with torch.no_grad():  # every margin of the step before any backward
                    for a, (b, rf) in enumerate(zip(batches, refs)):
                        with self._same_dropout(a):
                            margins.append(self.policy_elbo(b).float() - rf)
                baseline = self._global_mean(torch.cat(margins))
            for a, (b, rf) in enumerate(zip(batches, refs)):
                with self._sync(a == A - 1), self._same_dropout(a):
                    pol = self.policy_elbo(b)
                    if baseline is None:
                        baseline = self._global_mean(pol.detach().float() - rf)
                    terms = elbo_kto_loss(
                        pol, rf, b["labels"].to(pol.device), beta=self.t.beta,
                        lambda_desirable=self.lambda_d, lambda_undesirable=self.lambda_u,
                        baseline=baseline, normalizer=norm,
                    )
                    self.acc.backward(terms.loss)
                m = terms.metrics
                acc["loss_sum"] += m["loss_sum"]
                acc["n"] += m["n"]
                acc["n_d"] += m["n_desirable"]
                acc["n_u"] += m["n_undesirable"]
                acc["r_d"] += m["reward_sum_desirable"]
                acc["r_u"] += m["reward_sum_undesirable"]
                acc["saturated"] += m["saturated"]
            acc["baseline"] = float(baseline)
        elif obj == "sft":
            for a, b in enumerate(batches):
                with self._sync(a == A - 1):
                    pol = self.policy_elbo(b)
                    terms = sft_loss(pol, b["completion_len"], normalizer=norm)
                    self.acc.backward(terms.loss)
                acc["loss_sum"] += terms.metrics["loss_sum"]
                acc["n"] += terms.metrics["n"]
        else:  # vrpo: rows alternate chosen / rejected
            for a, b in enumerate(batches):
                rf = self.reference_elbo(b)
                with self._sync(a == A - 1):
                    pol = self.policy_elbo(b)
                    terms = vrpo_loss(pol[0::2], pol[1::2], rf[0::2], rf[1::2], beta=self.t.beta, normalizer=norm)
                    self.acc.backward(terms.loss)
                m = terms.metrics
                acc["loss_sum"] += m["loss_sum"]
                acc["n"] += m["n"]
                acc["n_d"] += m["n"]
                acc["n_u"] += m["n"]
                acc["r_d"] += m["reward_sum_chosen"]
                acc["r_u"] += m["reward_sum_rejected"]
                acc["saturated"] += m["saturated"]
                acc["accuracy"] += m["accuracy_sum"]
        return acc

    def step_once(self, last_ckpt: Optional[Path] = None) -> tuple[float, dict, float]:
        """One optimiser step: forward/backward, global clip, the rank-agreed finite check, update.

        Returns (lr, reduced metrics, gradient norm before clipping).
        """
        t = self.t
        lr = lr_at(self.step, self.total, t.lr, t.warmup_ratio, t.scheduler)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        kl_micro = self.kl_micro_batches(self.step) if self.kl else None
        m = self.reduce(self.run_step(self.micro_batches(self.step), kl_micro))
        clip = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
        self.acc.unscale_gradients()  # fp16 loss scaling (a no-op otherwise)
        grad_norm = clip_global_grad_norm(self.params, clip, sharded=self.fsdp, device=self.acc.device)
        human_step = self.step + 1
        # Both numbers are the same on every rank (reduced / all-reduced): all stop together.
        if not math.isfinite(m["loss"]) or not math.isfinite(grad_norm):
            what = f"loss {m['loss']}" if not math.isfinite(m["loss"]) else f"gradient norm {grad_norm}"
            keep_msg = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
            raise RunFailure(
                f"non-finite {what} at step {human_step}; stopped before applying it ({keep_msg})",
                hint="lower train.lr, check the data, or resume from the checkpoint with other settings",
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = human_step
        return lr, m, grad_norm

    def reduce(self, acc: dict) -> dict:
        keys = ["loss_sum", "n", "n_d", "n_u", "r_d", "r_u", "saturated", "accuracy", "tokens"]
        t = torch.tensor([float(acc[k]) for k in keys], dtype=torch.float64, device=self.acc.device)
        if self.world > 1:
            t = self.acc.reduce(t, reduction="sum")
        s = dict(zip(keys, t.tolist()))
        n = max(s["n"], 1.0)
        out = {"loss": s["loss_sum"] / n}
        if self.t.objective == "sft":
            out.update(reward_desirable=None, reward_undesirable=None, baseline=None, saturation=None)
        else:
            out["reward_desirable"] = s["r_d"] / s["n_d"] if s["n_d"] else None
            out["reward_undesirable"] = s["r_u"] / s["n_u"] if s["n_u"] else None
            out["baseline"] = acc["baseline"] if self.t.objective == "elbo_kto" else None
            out["saturation"] = s["saturated"] / n
            if self.t.objective == "vrpo":
                out["reward_accuracy"] = s["accuracy"] / n
        out["tokens"] = int(s["tokens"])
        return out

    # ---------------------------------------------------------------- checkpoints (checkpoint.py)
    def export(self, folder: Path, sd: dict, final: bool = False) -> dict:
        return checkpoint.export(self, folder, sd, final=final)

    def save_checkpoint(self, history: list) -> Path:
        return checkpoint.save_checkpoint(self, history)

    def _state_dict(self) -> dict:
        return checkpoint.state_dict_of(self)

    def _load_state(self, folder: Path) -> None:
        checkpoint.load_state(self, folder)

@torch.no_grad()
def invariant_margins(run: "_Run", steps: int = 1) -> dict[str, float]:
    """Per-row margins B_policy - B_ref of this process's rows in global steps 0..steps-1, before any update.

    With the policy's weights equal to the reference's, each is 0: exactly when
    the forward is fp32 and deterministic, within the bf16 tolerance under
    autocast (tests/test_invariants.py derives it). Both sides go through the
    training path (the wrapped policy module; the cache or the online reference).
    """
    out: dict[str, float] = {}
    for step in range(steps):
        for units in run.micro_batches(step):
            rows = [ex for u in units for ex in u]
            b = run._to_dev(run.collate(rows))
            m = run.policy_elbo(b).float() - run.reference_elbo(b)
            out.update(zip(b["ids"], m.tolist()))
    return out


def _status(m: dict, lr: float, tok_s: float) -> str:
    parts = [f"loss {m['loss']:.4f}"]
    if m.get("reward_desirable") is not None:
        parts.append(f"r+ {m['reward_desirable']:+.3f}")
    if m.get("reward_undesirable") is not None:
        parts.append(f"r- {m['reward_undesirable']:+.3f}")
    if m.get("baseline") is not None:
        parts.append(f"b {m['baseline']:+.3f}")
    if m.get("saturation") is not None:
        parts.append(f"sat {m['saturation']:.0%}")
    parts.append(f"lr {lr:.2e}")
    parts.append(f"{tok_s:,.0f} tok/s")
    return " | ".join(parts)


def train(
    recipe,
    *,
    resume: bool = False,
    overwrite: bool = False,
    examples: Optional[list] = None,
    accelerator=None,
    allow_changes: Sequence[str] = (),
) -> TrainResult:
    """Train the policy as the recipe says (``dllm-align train``); returns where the model went.

    ``examples`` (tokenised :class:`dllm_align.data.tokenize.Example` s) replace
    ``data.train`` when given (tests, the toy demo). ``resume`` refuses settings
    that change the results unless their keys are in ``allow_changes``.
    """
    from dllm_align.core.io import DirLock, recover_jsonl
    from dllm_align.core.runfolder import check_training_settings

    acc = accelerator or make_accelerator(recipe)
    out = Path(recipe.output_dir)
    created = not out.exists()
    lock: Optional[DirLock] = None
    # The main process inspects the run folder (and verifies the checkpoint to
    # resume from); every process must then agree, or fail together.
    decision: list = [None]
    if acc.is_main_process:
        try:
            lock = DirLock(out, f"another `dllm-align train` is writing to {out}").__enter__()
            found = prepare_output(recipe, resume, overwrite)
            changes = check_training_settings(recipe, out, allow_changes) if resume else []
            if resume:
                recover_jsonl(out / METRICS)  # cut a torn last line; refuse a damaged middle
            decision = [("ok", str(found) if found else None, changes)]
        except UserError as e:
            decision = [("error", e.message, e.hint)]
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(decision, from_process=0)
    try:
        if decision[0][0] == "error":
            raise UserError(decision[0][1], hint=decision[0][2])
        resume_from = Path(decision[0][1]) if decision[0][1] else None
        return _train(recipe, acc, out, resume, overwrite, resume_from, examples, decision[0][2])
    except UserError:
        # Refused before anything was written: leave no empty run folder behind.
        if acc.is_main_process and created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _train(recipe, acc, out: Path, resume: bool, overwrite: bool, resume_from: Optional[Path], examples, changes=()) -> TrainResult:
    from dllm_align.core.console import info, progress, warn
    from dllm_align.core.io import JsonlAppender, atomic_write_json, atomic_write_text, recover_jsonl
    from dllm_align.config.recipe import write_run_info

    torch.manual_seed(recipe.train.seed)
    run = _Run(recipe, acc, resume_from, examples)  # loads and checks everything before the run folder changes
    t = recipe.train
    summary_path = out / FINAL / "training_summary.json"
    if resume and summary_path.exists():
        # Checked before the metrics are trimmed to the checkpoint: a finished run stays as it is.
        summary = json.loads(summary_path.read_text())
        if summary.get("steps", 0) >= run.total:
            if acc.is_main_process:
                info(f"train: {out} already finished ({summary['steps']} steps); nothing to do")
            return TrainResult(out, out / FINAL, 0, 0.0, 0, summary.get("last_metrics") or {})
    if acc.is_main_process:
        if not resume and overwrite:
            _clear_previous(out)
        if changes:  # let through on purpose (--allow-change): said now, and kept in the run's record
            for k, was, now in changes:
                warn(f"train: {k} changed on resume ({was!r} then, {now!r} now)")
        write_run_info(recipe, out, "train", changes=[{"key": k, "was": a, "now": b, "at_step": run.step} for k, a, b in changes])
    history: list[dict] = []
    metrics_path = out / METRICS
    if acc.is_main_process:
        rows = recover_jsonl(metrics_path)
        keep = [r for r in rows if r.get("step", 0) <= run.step]  # steps after the checkpoint are redone
        if len(keep) != len(rows):
            atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        history = keep
    if acc.log_with:
        acc.init_trackers(recipe.name, config=_flat(recipe.model_dump(mode="json")))

    last_ckpt = resume_from
    appender = JsonlAppender(metrics_path) if acc.is_main_process else None
    start_step = run.step
    t_run = time.perf_counter()
    step_examples = run.G * run.rows_per_unit
    try:
        with progress(f"train ({t.objective})", total=run.total if acc.is_main_process else None, unit="step") as bar:
            if start_step:
                bar.advance(0)
            while run.step < run.total:
                t0 = time.perf_counter()
                lr, m, grad_norm = run.step_once(last_ckpt)
                dt = time.perf_counter() - t0
                run.elapsed += dt
                run.examples_seen += step_examples
                run.tokens_seen += m["tokens"]
                row = {
                    "step": run.step,
                    "epoch": round(run.step / run.steps_per_epoch, 4),
                    "loss": m["loss"],
                    "reward_desirable": m["reward_desirable"],
                    "reward_undesirable": m["reward_undesirable"],
                    "baseline": m["baseline"],
                    "saturation": m["saturation"],
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": m["tokens"] / dt,
                    "examples_per_s": step_examples / dt,
                    "seconds": dt,
                }
                if "reward_accuracy" in m:
                    row["reward_accuracy"] = m["reward_accuracy"]
                history.append(row)
                if acc.is_main_process:
                    appender.write(row)
                    bar.advance(1, status=_status(m, lr, row["tokens_per_s"]))
                    if run.step % t.log_every == 0 and not _bar_on():
                        info(f"step {run.step}/{run.total}: " + _status(m, lr, row["tokens_per_s"]))
                    msg = run.margin_watch.add(run.step, m["reward_desirable"] if t.objective == "elbo_kto" else None)
                    if msg:
                        warn(msg)
                if acc.log_with and run.step % t.log_every == 0:
                    acc.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and v is not None}, step=run.step)
                if acc.is_main_process:
                    _fault("kill_after_step", run.step)
                if t.save_every and run.step % t.save_every == 0 and run.step < run.total:
                    last_ckpt = run.save_checkpoint(history)
        # final export: the model (LoRA merged) and tokenizer, written atomically
        final = out / FINAL
        tmp = out / TMP_FINAL
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
        acc.wait_for_everyone()
        sd = run._state_dict()
        seconds = time.perf_counter() - t_run
        n_steps = run.step - start_step
        if acc.is_main_process:
            run.export(tmp, sd, final=True)
            summary = {
                "objective": t.objective,
                "steps": run.step,
                "steps_this_session": n_steps,
                "seconds": seconds,
                "steps_per_s": n_steps / seconds if seconds > 0 else None,
                "examples": n_steps * step_examples,
                "examples_per_s": n_steps * step_examples / seconds if seconds > 0 else None,
                "global_batch_size": run.G,
                "processes": run.world,
                "last_metrics": history[-1] if history else None,
            }
            atomic_write_json(tmp / "training_summary.json", summary)
            from dllm_align.core.io import _fsync_dir, fsync_tree, write_checksums

            write_checksums(tmp)
            fsync_tree(tmp)
            _fault("kill_in_final")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(out)
        if t.save_every and run.step % t.save_every == 0:
            run.save_checkpoint(history)
        acc.wait_for_everyone()
    finally:
        if appender is not None:
            appender.close()
        if acc.log_with:
            acc.end_training()
    return TrainResult(out, out / FINAL, n_steps, seconds, n_steps * step_examples, history[-1] if history else {})


def _bar_on() -> bool:
    from dllm_align.core.console import progress_enabled

    return progress_enabled()
