"""Downstream evaluation through lm-evaluation-harness (paper Table 4 and Appendix C, SPEC.md §9).

:class:`DiffusionLM` is an ``lm_eval.api.model.LM`` registered as
``dllm_align`` (alias ``dllm-align``). It answers the harness's three request
types for a masked diffusion LM:

* ``loglikelihood(context, continuation)``: the Monte Carlo ELBO of the
  continuation given the context (SPEC.md §3, eq. elbo-l; the context is the
  prompt, the continuation the "completion"). The ELBO is a lower bound on
  log p, and it is what LLaDA's own evaluation reports. Masks are a pure
  function of (``mc_seed``, the request text), so a request scores the same in
  any batch, on any number of processes and on a re-run. ``mc_num`` draws per
  request; ``stratified`` spreads the masked counts evenly over them (as
  LLaDA's evaluation does). ``is_greedy`` is computed only when
  ``greedy_check`` is on, by decoding the continuation with the sampler one
  token per step (L forwards, low-confidence order, as LLaDA's
  ``suffix_greedy_prediction``); otherwise it is reported False. Only tasks of
  output type ``loglikelihood`` (e.g. LAMBADA) use it; multiple-choice tasks
  ignore it.
* ``loglikelihood_rolling(text)``: the ELBO of the whole text in the harness's
  disjoint rolling windows (each window conditioned on the tokens before it).
  Perplexities computed from it are upper bounds.
* ``generate_until(context, gen_kwargs)``: the project's LLaDA sampler
  (:mod:`dllm_align.generate.sampler`) with this LM's settings (gen length, block,
  steps, ... set per task by the ``evaluate`` command), the text cut at the
  first of the task's ``until`` strings. The task's ``max_gen_toks``,
  ``do_sample`` and ``temperature`` are not used: a diffusion sampler's
  decoding is the gen length / block / steps / temperature of the recipe
  (the paper evaluates "under identical decoding").

Data parallel: under ``accelerate launch`` (or ``torchrun``), each process
loads the model on its own device and the harness gives it a share of the
documents (``rank`` / ``world_size``); results are merged on rank 0 through
``all_gather`` / ``gather_object``. Scores do not depend on the process count
(masks and sampler seeds are per request).

The ``evaluate`` command drives the harness one task at a time
(:func:`evaluate_model`), with each task's settings from the recipe's
``evaluate.tasks`` map, writes the harness's JSON, and puts two models side by
side (:func:`comparison_rows`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dllm_align.core.errors import UserError

HARNESS_NAME = "dllm_align"
log = logging.getLogger("dllm_align.evaluate.harness")


def bundled_task_dir() -> Path:
    """The bundled task YAMLs (generative HellaSwag for the paper's Table 4), beside the recipes."""
    from dllm_align.config.recipe import bundled_dir

    return bundled_dir() / "tasks"


def request_id(*parts: str) -> str:
    """A stable id of a request's text: the seed of its masks (loglikelihood) or its sampler seed."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:32]


def truncate_at_stops(text: str, until: Sequence[str]) -> str:
    """The text before the first occurrence of any stop string (empty strings ignored)."""
    cut = len(text)
    for s in until:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def _as_stop_list(until: Any) -> list[str]:
    if until is None:
        return []
    if isinstance(until, str):
        return [until]
    if isinstance(until, (list, tuple)) and all(isinstance(u, str) for u in until):
        return list(until)
    raise UserError(f"generation 'until' must be a string or a list of strings, got {until!r}")


# --------------------------------------------------------------------------- distributed
def _dist_state():
    """accelerate's process state when launched with several processes, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    # On a CPU-only machine accelerate needs cpu=True to pick gloo (torchrun launches).
    return PartialState(cpu=not torch.cuda.is_available())


def eval_device() -> torch.device:
    """Where this process evaluates: its own GPU under a multi-process launch, else cuda:0 or the CPU."""
    state = _dist_state()
    if state is not None:
        return torch.device(state.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------- the harness model
_ARG_NAMES = (
    "pretrained", "revision", "tokenizer", "dtype", "device", "trust_remote_code", "mask_token_id",
    "batch_size", "mc_num", "mc_seed", "stratified", "greedy_check", "max_length", "packing",
    "gen_length", "block_length", "steps", "remasking", "temperature", "cfg", "cache", "threshold", "seed",
)


@register_model(HARNESS_NAME, "dllm-align")
class DiffusionLM(LM):
    """A masked diffusion LM as seen by lm-evaluation-harness (see the module docstring).

    From the harness: ``lm_eval.simple_evaluate(model="dllm_align",
    model_args="pretrained=GSAI-ML/LLaDA-8B-Instruct,gen_length=256,block_length=8,steps=256")``
    after ``import dllm_align.evaluate.harness``. From Python with a loaded model:
    ``DiffusionLM(predictor=mp, ...)``.
    """

    def __init__(
        self,
        pretrained: str = "builtin:tiny",
        predictor=None,
        *,
        revision: Optional[str] = None,
        tokenizer: Optional[str] = None,
        dtype: str = "auto",
        device: Optional[str] = None,
        trust_remote_code: bool = False,
        mask_token_id: Optional[int] = None,
        batch_size: int | str = 8,
        mc_num: int = 32,
        mc_seed: int = 0,
        stratified: bool = True,
        greedy_check: bool = False,
        max_length: Optional[int] = None,
        packing: bool = True,
        gen_length: int = 512,
        block_length: int = 32,
        steps: int = 512,
        remasking: str = "low_confidence",
        temperature: float = 0.0,
        cfg: float = 0.0,
        cache: str = "none",
        threshold: Optional[float] = None,
        seed: int = 0,
        max_batch_size: Optional[int] = None,  # passed by the harness; batches here are fixed-size
        **unknown,
    ) -> None:
        super().__init__()
        if unknown:
            bad = sorted(unknown)[0]
            close = difflib.get_close_matches(bad, _ARG_NAMES, n=1)
            raise UserError(
                f"unknown dllm_align model argument '{bad}'" + (f" (did you mean '{close[0]}'?)" if close else ""),
                hint="arguments: " + ", ".join(_ARG_NAMES),
            )
        self._state = _dist_state()
        if self._state is not None:
            self._rank, self._world_size = self._state.process_index, self._state.num_processes
        if predictor is None:
            from dllm_align.models.load import load_model

            dev = torch.device(device) if device and self._state is None else eval_device()
            predictor = load_model(
                pretrained, revision=revision, dtype=dtype, device=dev, trust_remote_code=bool(trust_remote_code),
                mask_token_id=mask_token_id, tokenizer=tokenizer,
            )
        self.mp = predictor
        self.tokenizer = predictor.tokenizer
        self.pretrained = str(pretrained)
        self._device = predictor.device
        self._max_length = max_length
        self.packing = packing if isinstance(packing, bool) else str(packing).lower() in ("1", "true", "yes")
        self._warned: set[str] = set()
        self.configure(
            batch_size=batch_size, mc_num=mc_num, mc_seed=mc_seed, stratified=stratified, greedy_check=greedy_check,
        )
        from dllm_align.generate.sampler import SamplerSettings

        self.configure(
            sampler=SamplerSettings(
                gen_length=int(gen_length), block_length=int(block_length), steps=int(steps), remasking=remasking,
                temperature=float(temperature), cfg=float(cfg), cache=cache,
                threshold=None if threshold is None else float(threshold), seed=int(seed),
            )
        )

    # -- settings
    def configure(self, *, sampler=None, batch_size=None, mc_num=None, mc_seed=None, stratified=None, greedy_check=None) -> None:
        """Change settings between tasks (the ``evaluate`` command sets each task's decoding here)."""
        if sampler is not None:
            sampler.check()
            self.sampler = sampler
        if batch_size is not None:
            try:
                bs = int(batch_size)
            except (TypeError, ValueError):
                raise UserError(f"batch_size must be a positive integer (got {batch_size!r}; 'auto' is not supported)") from None
            if bs < 1:
                raise UserError(f"batch_size must be a positive integer (got {bs})")
            self.batch_size = bs
        if mc_num is not None:
            if int(mc_num) < 1:
                raise UserError(f"mc_num must be >= 1 (got {mc_num})")
            self.mc_num = int(mc_num)
        if mc_seed is not None:
            self.mc_seed = int(mc_seed)
        if stratified is not None:
            self.stratified = bool(stratified)
        if greedy_check is not None:
            self.greedy_check = bool(greedy_check)

    def draw_config(self):
        from dllm_align.objective.elbo import DrawConfig

        return DrawConfig(n_mc=self.mc_num, seed=self.mc_seed, estimator="l", stratified=self.stratified)

    # -- harness properties
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        n = getattr(self.mp.model.config, "max_position_embeddings", None)
        return int(n) if n else 4096

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        name = getattr(self.tokenizer, "name_or_path", "") or self.pretrained
        return str(name).replace("/", "__").replace(":", "_")

    def chat_template(self, chat_template: bool | str = False) -> Optional[str]:
        if not chat_template:
            return None
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's chat template as text; the harness appends the answer (or gen_prefix) after it."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(
                f"{self.pretrained}: the tokenizer has no chat template",
                hint="turn evaluate.apply_chat_template off for a base model",
            )
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def get_model_info(self) -> dict:
        n = sum(p.numel() for p in self.mp.model.parameters())
        return {
            "model": self.pretrained,
            "dtype": str(next(self.mp.model.parameters()).dtype),
            "num_parameters": int(n),
            "mask_token_id": self.mp.mask_token_id,
            "sampler": self.sampler.to_dict(),
            "mc_num": self.mc_num,
            "mc_seed": self.mc_seed,
            "stratified": self.stratified,
            "greedy_check": self.greedy_check,
            "packing": self.packing,
            "world_size": self.world_size,
        }

    # -- distributed primitives used by the harness
    def all_gather(self, tensor):
        if self.world_size <= 1:
            return tensor
        from accelerate.utils import gather

        return gather(tensor)

    def gather_object(self, obj, dst=0):
        if self.world_size <= 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            self._state.wait_for_everyone()

    # -- tokenisation
    def tok_encode(self, text: str, add_special_tokens: Optional[bool] = None) -> list[int]:
        """Token ids of ``text``. By default special tokens (BOS) are added unless the text already
        starts with the BOS string, which is the case after the chat template."""
        if add_special_tokens is None:
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special_tokens = not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation token ids. A trailing space of the context moves to the
        continuation (the harness's convention); the continuation is the tail of the joint
        encoding when the context's encoding is its prefix, so tokens never straddle the cut."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            continuation = context[-n_space:] + continuation
            context = context[:-n_space]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context) if context else []
        if whole[: len(ctx)] == ctx:
            cont = whole[len(ctx):]
        else:
            cont = self.tok_encode(continuation, add_special_tokens=False)
        if not ctx:
            ctx = [self.prefix_token_id]
        return ctx, cont

    def _fit(self, ctx: list[int], room: int, what: str) -> list[int]:
        """Left-truncate a prompt to ``room`` tokens (its head gives way), warning once."""
        if room < 1:
            raise UserError(f"{what} does not fit in max_length {self.max_length}", hint="raise evaluate.max_length")
        if len(ctx) > room:
            if "truncate" not in self._warned:
                self._warned.add("truncate")
                from dllm_align.core.console import warn

                warn(f"prompts longer than {room} tokens lose their head to fit max_length {self.max_length}")
            ctx = ctx[-room:]
        return ctx

    # -- loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """The Monte Carlo ELBO of each continuation given its context (SPEC.md §3)."""
        items = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self.encode_pair(context, continuation)
            items.append((ctx, cont, request_id(context, continuation)))
        out = self.score_tokens(items, disable_progress=disable_tqdm)
        for req, r in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """ELBO of whole texts over the harness's disjoint rolling windows (a lower bound on log p)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        items, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            toks = self.tok_encode(text, add_special_tokens=False)
            windows = get_rolling_token_windows(toks, self.prefix_token_id, self.max_length - 1, 1)
            for w, (ctx, pred) in enumerate(map(make_disjoint_window, windows)):
                items.append((list(ctx), list(pred), request_id("rolling", text, str(w))))
                owner.append(i)
        scores = self.score_tokens(items, disable_progress=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (v, _) in zip(owner, scores):
            totals[i] += v
        for req, t in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, t)
        return totals

    @torch.no_grad()
    def score_tokens(
        self, items: Sequence[tuple[list[int], list[int], str]], disable_progress: bool = False
    ) -> list[tuple[float, bool]]:
        """(ELBO, is_greedy) of each (context ids, continuation ids, id); identical items are scored once.

        Rows of similar length are batched (right-padded, attention-masked: a
        padded row computes what it computes alone); one call holds
        ``batch_size // mc_num`` requests (at least one), and its noisy
        sequences go through the model ``batch_size`` at a time, packed into
        rows of ``max_length`` with block-diagonal attention when ``packing``
        is on (``elbo_draws``: the same values, no compute on padding).
        """
        from dllm_align.core.console import progress
        from dllm_align.objective.elbo import elbo_draws

        cfg = self.draw_config()
        unique: dict[str, tuple[list[int], list[int]]] = {}
        for ctx, cont, rid in items:
            if not cont:
                continue  # log p(empty) = 0
            ctx = self._fit(ctx, self.max_length - len(cont), "a continuation")
            unique.setdefault(rid, (ctx, cont))
        value: dict[str, float] = {}
        keys = sorted(unique, key=lambda k: -(len(unique[k][0]) + len(unique[k][1])))
        per_call = max(1, self.batch_size // self.mc_num)
        pad = self._pad_id()
        dev = self.device
        with progress("loglikelihood", total=len(keys), unit="req") as bar:
            for start in range(0, len(keys), per_call):
                chunk = keys[start : start + per_call]
                T = max(len(unique[k][0]) + len(unique[k][1]) for k in chunk)
                ids = torch.full((len(chunk), T), pad, dtype=torch.long)
                attn = torch.zeros((len(chunk), T), dtype=torch.long)
                cm = torch.zeros((len(chunk), T), dtype=torch.bool)
                for b, k in enumerate(chunk):
                    ctx, cont = unique[k]
                    n = len(ctx) + len(cont)
                    ids[b, :n] = torch.tensor(ctx + cont)
                    attn[b, :n] = 1
                    cm[b, len(ctx) : n] = True
                draws = elbo_draws(
                    self.mp, ids.to(dev), attn.to(dev), cm.to(dev), chunk, cfg, self.batch_size,
                    pack_length=self.max_length if self.packing else None,
                )
                for k, v in zip(chunk, draws.mean(dim=1).tolist()):
                    value[k] = float(v)
                if not disable_progress and self.rank == 0:
                    bar.advance(len(chunk))
        greedy = self._greedy(unique) if self.greedy_check else {}
        return [(value.get(rid, 0.0), greedy.get(rid, not cont)) for _, cont, rid in items]

    def _greedy(self, unique: dict[str, tuple[list[int], list[int]]]) -> dict[str, bool]:
        """Whether decoding the continuation one token per step (low-confidence order, temperature 0)
        reproduces it: the sampler with gen_length = block_length = steps = L."""
        from dllm_align.generate.sampler import SamplerSettings, generate

        by_len: dict[int, list[str]] = {}
        for k, (_, cont) in unique.items():
            by_len.setdefault(len(cont), []).append(k)
        out = {}
        for L, ks in by_len.items():
            st = SamplerSettings(gen_length=L, block_length=L, steps=L, remasking="low_confidence", temperature=0.0)
            res = generate(self.mp, [unique[k][0] for k in ks], st, batch_size=self.batch_size, stop_early=False)
            for k, r in zip(ks, res):
                out[k] = list(r.raw) == list(unique[k][1])
        return out

    def _pad_id(self) -> int:
        pid = getattr(self.tokenizer, "pad_token_id", None)
        return int(pid if pid is not None else self.eot_token_id)

    # -- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode each context with the LLaDA sampler (SPEC.md §7) and cut at the task's stop strings."""
        from dllm_align.core.console import progress
        from dllm_align.generate.sampler import generate, row_seed

        st = self.sampler
        deterministic = st.temperature == 0 and st.remasking == "low_confidence"
        room = self.max_length - st.gen_length
        prompts: list[list[int]] = []
        seeds: list[int] = []
        slot: list[int] = []  # which decoded prompt answers each request
        seen: dict[str, int] = {}
        occurrences: dict[str, int] = {}
        stops = []
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            stops.append(_as_stop_list(gen_kwargs.get("until")))
            self._note_ignored(gen_kwargs)
            rid = request_id(context)
            if deterministic and rid in seen:
                slot.append(seen[rid])
                continue
            # A repeated request (repeats > 1, e.g. pass@k) gets its own seed per occurrence.
            k = occurrences.get(rid, 0)
            occurrences[rid] = k + 1
            seen[rid] = len(prompts)
            slot.append(len(prompts))
            prompts.append(self._fit(self.tok_encode(context), room, "a prompt"))
            seeds.append(row_seed(st.seed, rid if k == 0 else f"{rid}/{k}"))
        with progress("generate_until", total=len(prompts), unit="prompt") as bar:
            def advance(idx, _res):
                if not disable_tqdm and self.rank == 0:
                    bar.advance(len(idx))

            done = generate(self.mp, prompts, st, seeds=seeds, batch_size=self.batch_size, on_batch=advance)
        out = []
        for req, j, until in zip(requests, slot, stops):
            text = truncate_at_stops(done[j].text, until)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _note_ignored(self, gen_kwargs: dict) -> None:
        wants = {k: gen_kwargs[k] for k in ("do_sample", "temperature", "max_gen_toks") if k in gen_kwargs}
        key = json.dumps(wants, sort_keys=True, default=str)
        if wants and key not in self._warned:
            self._warned.add(key)
            log.info(
                "task generation settings %s are not used: decoding follows gen_length=%d, block_length=%d, steps=%d, temperature=%g",
                wants, self.sampler.gen_length, self.sampler.block_length, self.sampler.steps, self.sampler.temperature,
            )


# --------------------------------------------------------------------------- the evaluate command
@dataclass(frozen=True)
class TaskPlan:
    """One task as the ``evaluate`` command runs it: the recipe's entry resolved against its defaults."""

    key: str  # the name in the table (the recipe's key)
    harness_task: str  # the harness's task or group name
    sampler: Any  # generation.SamplerSettings
    num_fewshot: Optional[int]
    limit: Optional[int]
    metric: Optional[str]
    apply_chat_template: bool

    def describe(self) -> dict:
        return {
            "harness_task": self.harness_task,
            "gen_length": self.sampler.gen_length,
            "block_length": self.sampler.block_length,
            "steps": self.sampler.steps,
            "num_fewshot": self.num_fewshot,
            "limit": self.limit,
            "metric": self.metric,
            "apply_chat_template": self.apply_chat_template,
        }


def plan_tasks(recipe, keys: Optional[Sequence[str]] = None, limit: Optional[int] = None) -> list[TaskPlan]:
    """Resolve the tasks to run: the recipe's ``evaluate.tasks`` (or ``keys``, which may also name
    harness tasks absent from the map, run with the ``generate`` defaults).

    Decoding comes from the task's gen_length / block_length / steps, else the
    ``generate`` section; ``limit`` (the command line) wins over the task's and
    the section's.
    """
    from dllm_align.generate.sampler import SamplerSettings
    from dllm_align.config.recipe import EvalTask

    ev = recipe.evaluate
    if keys is None:
        keys = list(ev.tasks)
    if not keys:
        raise UserError(
            "no tasks to evaluate: the recipe's evaluate.tasks is empty and --tasks was not given",
            hint="e.g. --tasks gsm8k,mmlu_generative, or see `dllm-align recipes show table4_downstream`",
        )
    base = SamplerSettings.from_section(recipe.generate)
    plans = []
    for key in keys:
        t = ev.tasks.get(key) or EvalTask()
        sampler = dataclasses.replace(
            base,
            gen_length=t.gen_length or base.gen_length,
            block_length=t.block_length or base.block_length,
            steps=t.steps or base.steps,
        )
        probs = sampler.problems()
        if probs:
            raise UserError(f"evaluate.tasks.{key}: " + "; ".join(probs))
        plans.append(
            TaskPlan(
                key=key,
                harness_task=t.task or key,
                sampler=sampler,
                num_fewshot=t.num_fewshot,
                limit=limit or t.limit or ev.limit,
                metric=t.metric,
                apply_chat_template=ev.apply_chat_template if t.apply_chat_template is None else t.apply_chat_template,
            )
        )
    return plans


def task_manager(names: Sequence[str], include_path: Optional[str | Sequence[str]] = None):
    """A harness TaskManager that knows ``names``; unknown names are a UserError with a did-you-mean.

    Indexing the harness's ~15k built-in tasks takes several seconds, so when
    every name is found in the include paths (the bundled task folder and the
    user's) the built-in index is skipped.
    """
    from lm_eval.tasks import TaskManager

    paths = [str(bundled_task_dir())] if bundled_task_dir().is_dir() else []
    if include_path:
        for p in [include_path] if isinstance(include_path, (str, Path)) else include_path:
            if not Path(p).is_dir():
                raise UserError(f"--include-path {p}: not a folder of task YAMLs")
            paths.append(str(p))
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(n in local.all_tasks for n in names):
        return local
    tm = TaskManager(include_path=paths)
    for n in names:
        if n not in tm.all_tasks:
            close = difflib.get_close_matches(n, tm.all_tasks, n=3)
            raise UserError(
                f"lm-evaluation-harness has no task or group named '{n}'"
                + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""),
                hint="`lm-eval ls tasks` lists them; local YAMLs go in --include-path DIR",
            )
    return tm


def model_label(name_or_path: str) -> str:
    """A folder name for a model: the hub id with '/' -> '__', or a path's last two parts."""
    if name_or_path.startswith("builtin:"):
        return name_or_path.replace(":", "_")
    p = Path(name_or_path).expanduser()
    if p.exists() or name_or_path.startswith((".", "/", "~")):
        parts = [x for x in p.resolve().parts if x not in ("/", "")]
        return "__".join(parts[-2:]) or "model"
    return name_or_path.replace("/", "__")


def model_fingerprint(name_or_path: str, revision: Optional[str] = None) -> str:
    """What identifies a model's weights without loading them: a folder's config and the
    sizes and times of its weight files; a hub id and revision; the built-in spec."""
    h = hashlib.sha256(f"{name_or_path}@{revision}".encode())
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        h = hashlib.sha256(str(p.resolve()).encode())
        for f in sorted(p.iterdir()):
            if f.suffix in (".json", ".safetensors", ".bin") and f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
                if f.name == "config.json":
                    h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _fingerprint(plan: TaskPlan, ev, model_fp: str, model_section) -> dict:
    from importlib.metadata import version

    return {
        "model": model_fp,
        "tokenizer": model_section.tokenizer,
        "dtype": model_section.dtype,
        "task": plan.describe() | {"sampler": plan.sampler.to_dict()},
        "mc_num": ev.mc_num,
        "mc_seed": ev.mc_seed,
        "stratified": ev.stratified,
        "greedy_check": ev.greedy_check,
        "max_length": ev.max_length,
        "fewshot_as_multiturn": ev.fewshot_as_multiturn,
        "system_instruction": ev.system_instruction,
        "lm_eval": version("lm-eval"),
    }


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def run_task(lm: DiffusionLM, plan: TaskPlan, ev, tm) -> Optional[dict]:
    """One harness run of one task with the plan's settings; the harness's result dict on rank 0, None elsewhere."""
    import lm_eval

    lm.configure(sampler=plan.sampler)
    if ev.allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # the harness's code_eval metric checks this
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=[plan.harness_task],
            num_fewshot=plan.num_fewshot,
            limit=plan.limit,
            task_manager=tm,
            bootstrap_iters=ev.bootstrap_iters,
            log_samples=ev.log_samples,
            apply_chat_template=plan.apply_chat_template,
            fewshot_as_multiturn=ev.fewshot_as_multiturn and plan.apply_chat_template,
            system_instruction=ev.system_instruction,
            confirm_run_unsafe_code=ev.allow_code_execution,
        )
    except ValueError as e:
        if "unsafe" in str(e):
            raise UserError(
                f"task '{plan.key}' runs model-written code to score it",
                hint="pass --allow-code-execution (or evaluate.allow_code_execution: true) on a sandboxed machine",
            ) from None
        raise


def evaluate_model(
    recipe,
    name_or_path: str,
    plans: Sequence[TaskPlan],
    out_dir: Path,
    *,
    rerun: bool = False,
    lm_factory=None,
) -> Optional[dict]:
    """Run every planned task on one model; write ``out_dir/results.json`` (the harness's JSON, all
    tasks merged), ``tasks/<key>.json`` and ``samples_<key>.jsonl``; return the merged dict (rank 0).

    A task whose ``tasks/<key>.json`` was made with the same model and
    settings is not run again unless ``rerun`` (so a killed run, or a second
    comparison against the same base, resumes). The model is loaded only if a
    task has to run.
    """
    from dllm_align.core.console import info as _info
    from dllm_align.core.io import atomic_write_json, atomic_write_text

    rank0 = int(os.environ.get("RANK", "0")) == 0

    def info(msg: str) -> None:
        if rank0:
            _info(msg)

    ev = recipe.evaluate
    out_dir = Path(out_dir)
    model_fp = model_fingerprint(name_or_path, recipe.model.revision)
    names = [p.harness_task for p in plans]
    tm = None
    lm = None
    per_task: dict[str, dict] = {}
    for plan in plans:
        fp = _fingerprint(plan, ev, model_fp, recipe.model)
        task_file = out_dir / "tasks" / f"{plan.key}.json"
        if not rerun and task_file.is_file():
            try:
                old = json.loads(task_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                old = {}
            if old.get("fingerprint") == fp:
                info(f"{plan.key}: reusing {task_file}")
                per_task[plan.key] = old["results"]
                continue
        if tm is None:
            tm = task_manager(names, ev.include_path)
        if lm is None:
            lm = lm_factory() if lm_factory else make_lm(recipe, name_or_path)
        shots = plan.num_fewshot if plan.num_fewshot is not None else "task default"
        info(
            f"{plan.key}: {plan.harness_task} on {name_or_path} (shots {shots}; generation: gen {plan.sampler.gen_length} / "
            f"block {plan.sampler.block_length} / steps {plan.sampler.steps}; loglikelihood: {ev.mc_num} ELBO draws)"
        )
        res = run_task(lm, plan, ev, tm)
        if res is None:  # not rank 0: the merged result lives there
            continue
        res = _jsonable(dict(res))
        samples = res.pop("samples", None)
        res.pop("pretty_env_info", None)
        if samples is not None:
            lines = []
            for task_name, rows in samples.items():
                for row in rows:
                    lines.append(json.dumps({"task": task_name, **row}, ensure_ascii=False))
            atomic_write_text(out_dir / f"samples_{plan.key}.jsonl", "\n".join(lines) + ("\n" if lines else ""))
        atomic_write_json(task_file, {"fingerprint": fp, "results": res})
        per_task[plan.key] = res
    if lm is not None:  # free the weights before the next model loads
        del lm
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not rank0:
        return None
    merged = merge_results(per_task, plans, name_or_path)
    atomic_write_json(out_dir / "results.json", merged)
    return merged


def make_lm(recipe, name_or_path: str) -> DiffusionLM:
    """Load ``name_or_path`` as the recipe's model section describes and wrap it for the harness."""
    from dllm_align.models.load import load_from_section

    ev = recipe.evaluate
    mp = load_from_section(recipe.model, device=eval_device(), name_or_path=name_or_path)
    g = recipe.generate
    return DiffusionLM(
        pretrained=name_or_path, predictor=mp, batch_size=ev.batch_size, mc_num=ev.mc_num, mc_seed=ev.mc_seed,
        stratified=ev.stratified, greedy_check=ev.greedy_check, max_length=ev.max_length, packing=ev.packing,
        gen_length=g.gen_length, block_length=g.block_length, steps=g.steps, remasking=g.remasking,
        temperature=g.temperature, cfg=g.cfg, cache=g.cache, threshold=g.threshold, seed=g.seed,
    )


_MERGED_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def merge_results(per_task: dict[str, dict], plans: Sequence[TaskPlan], name_or_path: str) -> dict:
    """One harness-shaped JSON for all tasks (each task ran on its own), plus this project's plan."""
    merged: dict[str, Any] = {k: {} for k in _MERGED_KEYS}
    for plan in plans:
        res = per_task.get(plan.key)
        if not res:
            continue
        for k in _MERGED_KEYS:
            merged[k].update(res.get(k) or {})
        for k in ("config", "lm_eval_version", "transformers_version", "git_hash"):
            if k in res:
                merged[k] = res[k]
    if merged.get("config"):
        merged["config"]["model"] = HARNESS_NAME
        merged["config"]["model_args"] = {"pretrained": name_or_path}
    merged["dllm_align"] = {
        "model": name_or_path,
        "tasks": {p.key: p.describe() | {"sampler": p.sampler.to_dict()} for p in plans},
        "scores": {p.key: headline(merged, p) for p in plans if p.key in per_task},
    }
    return merged


def headline(results: dict, plan: TaskPlan) -> dict:
    """The score shown for a task: its group's entry if it is a group, the chosen (or first) metric."""
    entry = (results.get("groups") or {}).get(plan.harness_task) or results["results"].get(plan.harness_task)
    if entry is None:
        raise UserError(f"the harness returned no result for '{plan.harness_task}'")
    metrics = [k for k in entry if "," in k and "_stderr," not in k]
    if plan.metric is not None:
        if plan.metric not in entry:
            raise UserError(
                f"evaluate.tasks.{plan.key}.metric: '{plan.metric}' is not among the task's metrics",
                hint="metrics: " + ", ".join(metrics),
            )
        metric = plan.metric
    else:
        numeric = [m for m in metrics if isinstance(entry[m], (int, float))]
        if not numeric:
            raise UserError(f"task '{plan.key}' reported no numeric metric")
        metric = numeric[0]
    name, _, filt = metric.partition(",")
    se = entry.get(f"{name}_stderr,{filt}")
    return {
        "metric": metric,
        "value": entry[metric],
        "stderr": se if isinstance(se, (int, float)) else None,
        "n_shot": (results.get("n-shot") or {}).get(plan.harness_task),
    }


def comparison_rows(a: dict, b: dict, plans: Sequence[TaskPlan]) -> list[dict]:
    """Rows of the side-by-side table (paper Table 4): task, shots, metric, score A, score B, B - A."""
    rows = []
    for p in plans:
        sa, sb = a["dllm_align"]["scores"].get(p.key), b["dllm_align"]["scores"].get(p.key)
        if sa is None or sb is None:
            continue
        rows.append(
            {
                "task": p.key,
                "n_shot": sa["n_shot"] if sa["n_shot"] is not None else p.num_fewshot,
                "metric": sa["metric"],
                "a": sa["value"],
                "a_stderr": sa["stderr"],
                "b": sb["value"],
                "b_stderr": sb["stderr"],
                "delta": sb["value"] - sa["value"],
            }
        )
    return rows


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{100 * v:.2f}"


def comparison_markdown(rows: Sequence[dict], name_a: str, name_b: str) -> str:
    """A markdown table of :func:`comparison_rows` in percent, the better score in bold."""
    lines = [
        f"| Task (shots) | Metric | {name_a} | {name_b} | Δ |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        a, b = _pct(r["a"]), _pct(r["b"])
        if r["b"] > r["a"]:
            b = f"**{b}**"
        elif r["a"] > r["b"]:
            a = f"**{a}**"
        if r["a_stderr"] is not None:
            a += f" ± {_pct(r['a_stderr'])}"
        if r["b_stderr"] is not None:
            b += f" ± {_pct(r['b_stderr'])}"
        shots = "" if r["n_shot"] is None else f" ({r['n_shot']})"
        lines.append(f"| {r['task']}{shots} | {r['metric']} | {a} | {b} | {100 * r['delta']:+.2f} |")
    return "\n".join(lines) + "\n"


def scores_markdown(merged: dict, plans: Sequence[TaskPlan], name: str) -> str:
    """A one-model markdown table of the headline scores (percent)."""
    lines = [f"| Task (shots) | Metric | {name} |", "|---|---|---:|"]
    for p in plans:
        s = merged["dllm_align"]["scores"].get(p.key)
        if s is None:
            continue
        shots = "" if s["n_shot"] is None else f" ({s['n_shot']})"
        se = "" if s["stderr"] is None else f" ± {_pct(s['stderr'])}"
        lines.append(f"| {p.key}{shots} | {s['metric']} | {_pct(s['value'])}{se} |")
    return "\n".join(lines) + "\n"
