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
import math
import warnings
from pathlib import Path
from typing import Optional

import torch

from dllm_align.training import checkpoint
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.data.examples import load_training_examples, make_collate, step_count
from dllm_align.objective.base import ClassWeights, StepInputs, objective_for
from dllm_align.training.monitor import MarginWatch
from dllm_align.training.policy import PolicyScorer, _ViaModule
from dllm_align.training.distributed import _is_fsdp, _seeded_rng, fsdp_wrap_family_layer
from dllm_align.training.optim import build_optimizer, clip_global_grad_norm, lr_at
from dllm_align.training.plan import class_weights, grad_accum_for


# --------------------------------------------------------------------------- the loop
class _Run:
    """State of one training run; :func:`train` is its readable driver."""

    def __init__(self, recipe, accelerator, resume_from: Optional[Path], examples: Optional[list]):
        from dllm_align.core.console import info
        from dllm_align.objective.elbo import DrawConfig
        from dllm_align.models.load import check_max_length, load_from_section
        from dllm_align.training.plan import check_trainable_on
        from dllm_align.models.precision import precision_for

        self.recipe = recipe
        self.acc = accelerator
        self.t = recipe.train
        self.lambda_d, self.lambda_u = class_weights(recipe)
        chosen = bool({"lambda_desirable", "lambda_undesirable"} & self.t.model_fields_set) or bool(recipe.data.weights_file)
        self.objective = objective_for(self.t, ClassWeights(self.lambda_d, self.lambda_u, chosen))
        self.out = Path(recipe.output_dir)
        self.main = accelerator.is_main_process
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.fsdp = _is_fsdp(accelerator)
        self.resume_from = resume_from

        check_trainable_on(recipe, accelerator.device)
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
        check_max_length(self.mp, recipe.data.max_length)
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
        self.units = self.objective.make_units(examples)
        self.rows_per_unit = self.objective.rows_per_unit
        self.collate = make_collate(recipe, self.tokenizer)
        self.pack_length = recipe.data.max_length if recipe.data.padding == "packed" else None
        self.accum = grad_accum_for(self.t, self.world)
        self.G = self.t.batch_size * self.accum * self.world
        if len(self.units) < self.G:
            raise UserError(
                f"the training set has {len(self.units)} {self.objective.unit_name}, fewer than one global batch "
                f"(train.batch_size {self.t.batch_size} x grad_accum {self.accum} x {self.world} process(es) = {self.G})"
            )
        self.lengths = [sum(ex.length for ex in u) for u in self.units]
        self.steps_per_epoch, self.total = step_count(self.t, len(self.units), self.G)
        self.objective.check_units(self.units, self.G, self.main)
        self.dropped_per_epoch = len(self.units) - self.steps_per_epoch * self.G
        self._plans: dict[int, list[list[int]]] = {}

        # -- draws: the policy uses the reference's masks (draws 0..K'-1 of the K-draw set)
        self.cfg = DrawConfig.from_reference(recipe.reference)
        self.k = recipe.train_n_mc()
        self.draws = list(range(self.k))

        # -- reference
        self.cache = None
        self.ref_mp = None
        if self.objective.needs_reference:
            self._setup_reference()

        # -- distributed wrapping, optimiser
        if self.fsdp:
            from dllm_align.models.precision import fsdp_mixed_precision

            # accelerate's default casts parameters and buffers (the rotary frequencies) to
            # bf16 and reduces gradients in bf16; ours keeps fp32 and lets autocast do bf16.
            plugin = accelerator.state.fsdp_plugin
            plugin.mixed_precision_policy = fsdp_mixed_precision(getattr(plugin, "fsdp_version", 1))
            fsdp_wrap_family_layer(plugin, self.mp.model)
            if self.t.fsdp_gather == "bf16_layers":
                self._bf16_layer_units(plugin)
        elif self.t.fsdp_gather != "fp32" and self.main:
            info("train: train.fsdp_gather applies to FSDP2 launches only; ignored here")
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
        if self.fsdp:
            from dllm_align.training.distributed import preserve_checkpoint_rng

            preserve_checkpoint_rng(self.module)  # FSDP2's layer checkpoints replay the forward's dropout masks
        self.policy = _ViaModule(self.module, self.mp.mask_token_id, self.mp.block_size)
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
                f"train: objective {self.objective.name}, {len(self.units):,} {self.objective.unit_name}, "
                f"global batch {self.G} ({self.world} process(es) x {self.accum} micro-batch(es) x {self.t.batch_size}), "
                f"{self.total} step(s), K={self.k} draws, {n_params:,} trainable parameters, "
                f"mixed precision {accelerator.mixed_precision}"
            )
            if self.objective.step_legend:  # the step line's abbreviations, said once
                info(f"train: step lines show {self.objective.step_legend}")
            if self.dropped_per_epoch:
                info(f"train: {self.dropped_per_epoch} row(s) per epoch do not fill a global batch and are left out of that epoch")
            if accelerator.device.type == "cpu" and self.t.mixed_precision == "auto":
                info("train: bf16 autocast is off (no CUDA device: CPU bf16 is slow and changes the numbers)")

    # ---------------------------------------------------------------- setup helpers
    def _bf16_layer_units(self, plugin) -> None:
        """``train.fsdp_gather: bf16_layers`` (FSDP2 + bf16 autocast): decoder layers gathered in bf16."""
        from dllm_align.models.families.base import Family
        from dllm_align.models.precision import fsdp2_bf16_layer_units

        if getattr(plugin, "fsdp_version", 1) != 2:
            raise UserError("train.fsdp_gather bf16_layers needs an FSDP2 launch (fsdp_version: 2 in the accelerate config)")
        if self.precision.autocast != torch.bfloat16:
            raise UserError("train.fsdp_gather bf16_layers needs train.mixed_precision bf16 (it gathers what autocast "
                            "would cast to bf16)", hint="set train.mixed_precision: bf16, or train.fsdp_gather: fp32")
        mesh = getattr(self.acc, "torch_device_mesh", None)
        if mesh is not None:
            mesh = mesh[tuple(self.acc.parallelism_config.fsdp_dim_names)]
        cls = Family.decoder_layer_class(self.mp.model)
        fsdp2_bf16_layer_units(self.mp.model, cls, reshard_after_forward=plugin.reshard_after_forward, mesh=mesh)
        # fully_shard renames a unit's class FSDP<name>: accelerate finds the layers by that name (and
        # skips them, already sharded) for its wrap policy and its activation checkpointing
        plugin.transformer_cls_names_to_wrap = [type(m).__name__ for m in self.mp.model.modules() if isinstance(m, cls)][:1]

    def _apply_lora(self, resume_from: Optional[Path]) -> None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UserError("train.lora.enabled needs the peft package", hint="pip install 'dllm-align[lora]'") from None
        lora = self.t.lora
        cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none")
        try:
            with warnings.catch_warnings():  # peft asks the deprecated name of transformers 5.2x (a warning per run)
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
                get_peft_model(self.mp.model, cfg)  # injects the adapter layers into mp.model in place
        except ValueError as e:
            raise UserError(f"train.lora.target_modules: {str(e).splitlines()[0][:200]}") from None
        if resume_from is not None:
            from safetensors.torch import load_file

            adapter = load_file(str(resume_from / "adapter.safetensors"))
            named = dict(self.mp.model.named_parameters())
            extra = sorted(set(adapter) - set(named))
            if extra:
                raise UserError(f"cannot resume from {resume_from}: its LoRA adapter has weights this run's model lacks ({extra[0]})",
                                hint="resume with the recipe's original train.lora settings and model")
            for k, v in adapter.items():
                if named[k].shape != v.shape:
                    raise UserError(
                        f"cannot resume from {resume_from}: LoRA weight {k} is {tuple(v.shape)} there but {tuple(named[k].shape)} now "
                        "(train.lora.r or the model changed)"
                    )
                named[k].data.copy_(v)

    def _setup_reference(self) -> None:
        from dllm_align.training import reference as ref
        from dllm_align.training import cache as refcache
        from dllm_align.core.console import info

        r = self.recipe.reference
        if r.mode == "online":
            self.ref_mp = ref.load_reference(self.recipe, self.acc.device)
            if self.main:
                info(f"train: reference computed online ({refcache.reference_name(self.recipe)}, resident)")
            return
        folder = refcache.cache_dir(self.recipe)
        cache = refcache.ReferenceCache.open(folder)
        fp = refcache.fingerprint(
            self.recipe,
            tokenizer=self.tokenizer,
            mask_token_id=self.mp.mask_token_id,
            device=self.acc.device,
            examples=self.examples,
            known_files=cache.weight_files(),
        )
        used = [ex for u in self.units for ex in u]
        if self.objective.uses_extra_rows:
            from dllm_align.data.examples import planned_batches

            pairs = {}
            for batch in planned_batches(self.recipe, self.lengths, self.G, self.total):
                for ex in self.objective.extra_rows([self.units[i] for i in batch], self.recipe.data.max_length):
                    pairs.setdefault(ex.id, ex)
            missing = next((i for i in pairs if i not in cache._digests), None)
            if missing is not None:
                raise self.objective.extra_rows_missing(folder, missing, cache.manifest["fingerprint"])
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

    def extra_micro_batches(self, step: int) -> list[list]:
        """This process's extra rows of step ``step`` (the objective's, e.g. the kl baseline's pairs): row i goes where unit i goes."""
        from dllm_align.data.batching import shard

        epoch, j = divmod(step, self.steps_per_epoch)
        batch = self.plan(epoch)[j]
        extra = self.objective.extra_rows([self.units[i] for i in batch], self.recipe.data.max_length)
        return [[extra[p] for p in m] for m in shard(list(range(len(batch))), self.rank, self.world, self.t.batch_size)]

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

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every process's values (float32, detached), concatenated."""
        local = local.detach().float()
        return self.acc.gather(local.contiguous()) if self.world > 1 else local

    def _sum_over_processes(self, t: torch.Tensor) -> torch.Tensor:
        return self.acc.reduce(t, reduction="sum") if self.world > 1 else t

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
        """Gradient synchronisation of one micro-batch's backward.

        DDP skips the all-reduce of all but the step's last micro-batch (its gradients are
        whole on every rank either way). FSDP reduce-scatters every micro-batch: skipping it
        (``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``) keeps each rank's whole
        *unsharded* fp32 gradient until the last micro-batch, ~30 GiB per rank for an 8B
        model on top of its shards (issue 22, defect 2); reduced each time, a rank holds only
        its shard. The cost is one reduce-scatter per micro-batch instead of per step.
        """
        if last or self.world == 1 or self.fsdp:
            return contextlib.nullcontext()
        return self.acc.no_sync(self.module)

    def run_step(self, micro: list[list[tuple]], extra_micro: Optional[list[list]] = None) -> dict:
        """Forward/backward over this process's micro-batches; returns the objective's summed metrics (local).

        ``extra_micro``: this process's extra rows of the step (:meth:`extra_micro_batches`).
        """
        obj = self.objective
        batches = []
        for units in micro:
            rows = [ex for u in units for ex in u]  # vrpo: chosen, rejected, chosen, rejected, ...
            batches.append(self._to_dev(self.collate(rows)))
        step = StepInputs(
            batches=batches,
            references=[self.reference_elbo(b) if obj.needs_reference else None for b in batches],
            extra_batches=[self._to_dev(self.collate(exs)) for exs in extra_micro or []],
            normalizer=self.G / self.world,  # DDP averages over processes: this makes the sum over all units / G
            device=self.acc.device,
            policy_elbo=self.policy_elbo,
            reference_elbo=self.reference_elbo,
            gather=self._gather,
            sum_over_processes=self._sum_over_processes,
            same_dropout=self._same_dropout,
        )
        obj.begin_step(step)
        sums = dict.fromkeys(obj.summed, 0)
        A = len(batches)
        for a, (b, rf) in enumerate(zip(batches, step.references)):
            with self._sync(a == A - 1), (self._same_dropout(a) if obj.replays_dropout else contextlib.nullcontext()):
                terms = obj.loss(self.policy_elbo(b), rf, b, step)
                self.acc.backward(terms.loss)
            for k in obj.summed:
                sums[k] += terms.metrics[k]
        sums["tokens"] = sum(ex.length for units in micro for u in units for ex in u)  # real tokens, padding excluded
        return {"sums": sums, "step": step}

    def step_once(self, last_ckpt: Optional[Path] = None) -> tuple[float, dict, float]:
        """One optimiser step: forward/backward, global clip, the rank-agreed finite check, update.

        Returns (lr, reduced metrics, gradient norm before clipping).
        """
        t = self.t
        lr = lr_at(self.step, self.total, t.lr, t.warmup_ratio, t.scheduler)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        extra = self.extra_micro_batches(self.step) if self.objective.uses_extra_rows else None
        m = self.reduce(self.run_step(self.micro_batches(self.step), extra))
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

    def reduce(self, local: dict) -> dict:
        """The step's metrics: the objective's sums over every process, reduced by the objective."""
        keys = [*self.objective.summed, "tokens"]
        t = torch.tensor([float(local["sums"][k]) for k in keys], dtype=torch.float64, device=self.acc.device)
        if self.world > 1:
            t = self.acc.reduce(t, reduction="sum")
        s = dict(zip(keys, t.tolist()))
        out = self.objective.reduce(s, local["step"])
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


def _status(objective, m: dict, lr: float, tok_s: float) -> str:
    return " | ".join([*objective.status(m), f"lr {lr:.2e}", f"{tok_s:,.0f} tok/s"])
