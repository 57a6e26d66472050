"""Downstream evaluation through lm-evaluation-harness (paper Table 4 and Appendix C;
docs/design.md#evaluation).

:class:`DiffusionLM` is an ``lm_eval.api.model.LM`` registered as
``dllm_align`` (alias ``dllm-align``). It answers the harness's three request
types for a masked diffusion LM:

* ``loglikelihood(context, continuation)``: the Monte Carlo ELBO of the
  continuation given the context (docs/design.md#the-masked-diffusion-elbo; the context is the
  prompt, the continuation the "completion"). The ELBO is a lower bound on
  log p, and it is what LLaDA's own evaluation reports. It is the model family's
  likelihood, or the one ``likelihood`` names (the ``evaluate`` command passes the
  recipe's ``reference.likelihood`` and its settings: a model trained with a chosen
  bound is scored with that bound), refused by name where the family does not
  take it, and recorded in the results' ``config`` (``likelihood``). Masks are a pure
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
* ``generate_until(context, gen_kwargs)``: the generator of ``backend`` (:mod:`dllm_align.generate.backend`;
  in process: the model family's rule, LLaDA's, Dream's or the block rule) with this LM's settings (gen length, block,
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

The `evaluate` command's task plans, runs and tables are in :mod:`dllm_align.evaluate.run`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from accelerate import PartialState
from accelerate.utils import gather
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from dllm_align.config.recipe import bundled_dir
from dllm_align.core.console import progress, warn
from dllm_align.core.errors import UserError
from dllm_align.generate.backend import backend_component, make_generator, recorded_settings
from dllm_align.generate.settings import SamplerSettings, row_seed
from dllm_align.models.load import load_model
from dllm_align.objective.elbo import DrawConfig, elbo_draws, get_likelihood, likelihood_choice



HARNESS_NAME = "dllm_align"
log = logging.getLogger("dllm_align.evaluate.harness")


def bundled_task_dir() -> Path:
    """The bundled task YAMLs (generative HellaSwag for the paper's Table 4), beside the recipes."""
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
    "gen_length", "block_length", "steps", "remasking", "temperature", "cfg", "cache", "threshold", "seed", "backend",
    "likelihood",
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
        # Decoding: None takes the recipe schema's default (``generate`` section).
        gen_length: Optional[int] = None,
        block_length: Optional[int] = None,
        steps: Optional[int] = None,
        remasking: Optional[str] = None,
        temperature: Optional[float] = None,
        cfg: Optional[float] = None,
        cache: Optional[str] = None,
        threshold: Optional[float] = None,
        seed: Optional[int] = None,
        backend: Optional[str] = None,
        likelihood: Optional[str] = None,
        max_batch_size: Optional[int] = None,  # passed by the harness; batches here are fixed-size
        generate=None,  # the recipe's generate section, whose backend settings (generate.<backend>) travel along
        model_section=None,  # the recipe's model section, handed to the backend with ``pretrained``
        reference=None,  # the recipe's reference section: the own settings of the likelihood ``likelihood`` names
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

        given = dict(gen_length=gen_length, block_length=block_length, steps=steps, remasking=remasking, temperature=temperature,
                     cfg=cfg, cache=cache, threshold=threshold, seed=seed, backend=backend)
        own = {k: v.model_dump() for k, v in (generate.__pydantic_extra__ or {}).items()} if generate is not None else {}
        sampler = SamplerSettings(**{k: v for k, v in given.items() if v is not None}, **own)
        backend_component(sampler.backend)  # refused before the model is loaded
        if predictor is None:
            dev = torch.device(device) if device and self._state is None else eval_device()
            predictor = load_model(
                pretrained, revision=revision, dtype=dtype, device=dev, trust_remote_code=bool(trust_remote_code),
                mask_token_id=mask_token_id, tokenizer=tokenizer,
            )
        self.mp = predictor  # scores loglikelihoods; sampling goes through the generator
        # the likelihood the scores use: the family's, or a choice it accepts (refused by name before any task runs)
        self._choice = likelihood_choice(predictor.family, likelihood)
        self.likelihood = self._choice or predictor.family.likelihood
        self._choice_settings = (((self._choice, reference.own_settings(self._choice)),)
                                 if self._choice and reference is not None else ())
        # the backend's own refusal of these settings for this model comes here, before any task runs
        self.generator = make_generator(sampler, model_section, name_or_path=str(pretrained), predictor=predictor)
        self.tokenizer = predictor.tokenizer
        self.pretrained = str(pretrained)
        self._device = predictor.device
        self._max_length = max_length
        self.packing = packing if isinstance(packing, bool) else str(packing).lower() in ("1", "true", "yes")
        self._warned: set[str] = set()
        self.configure(
            batch_size=batch_size, mc_num=mc_num, mc_seed=mc_seed, stratified=stratified, greedy_check=greedy_check,
        )
        self.configure(sampler=sampler)

    # -- settings
    def configure(self, *, sampler=None, batch_size=None, mc_num=None, mc_seed=None, stratified=None, greedy_check=None) -> None:
        """Change settings between tasks (the ``evaluate`` command sets each task's decoding here)."""
        if sampler is not None:
            self.sampler = SamplerSettings.from_section(sampler)
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
        return DrawConfig(n_mc=self.mc_num, seed=self.mc_seed, estimator="l", stratified=self.stratified,
                          likelihood=self._choice, likelihood_settings=self._choice_settings)

    @property
    def packs(self) -> bool:
        """Whether loglikelihood forwards are packed: ``packing``, where the likelihood packs (the
        masked-plus-replaced bound does not: its values are those of padded rows, which it scores instead)."""
        return self.packing and get_likelihood(self.likelihood).packs

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
            "sampler": recorded_settings(self.sampler),
            "mc_num": self.mc_num,
            "mc_seed": self.mc_seed,
            "stratified": self.stratified,
            "greedy_check": self.greedy_check,
            "packing": self.packs,
            "world_size": self.world_size,
            "likelihood": self.likelihood,
        } | ({"likelihood_settings": self.draw_config().settings_of(self._choice).model_dump()} if self._choice else {})

    # -- distributed primitives used by the harness
    def all_gather(self, tensor):
        if self.world_size <= 1:
            return tensor

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

                warn(f"prompts longer than {room} tokens lose their head to fit max_length {self.max_length}")
            ctx = ctx[-room:]
        return ctx

    # -- loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """The Monte Carlo ELBO of each continuation given its context (docs/design.md#evaluation)."""
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
                    pack_length=self.max_length if self.packs else None,
                )
                for k, v in zip(chunk, draws.mean(dim=1).tolist()):
                    value[k] = float(v)
                if not disable_progress and self.rank == 0:
                    bar.advance(len(chunk))
        greedy = self._greedy(unique) if self.greedy_check else {}
        return [(value.get(rid, 0.0), greedy.get(rid, not cont)) for _, cont, rid in items]

    def _greedy(self, unique: dict[str, tuple[list[int], list[int]]]) -> dict[str, bool]:
        """Whether decoding the continuation one token per step (low-confidence order, temperature 0)
        reproduces it: the sampler with gen_length = block_length = steps = L.

        A block-diffusion model decodes in its own blocks (the block length is the model's): one token
        per step over the whole blocks that cover the L tokens, the first L compared."""
        by_len: dict[int, list[str]] = {}
        for k, (_, cont) in unique.items():
            by_len.setdefault(len(cont), []).append(k)
        out = {}
        b = getattr(self.mp, "block_size", None)
        for L, ks in by_len.items():
            n = -(-L // b) * b if b else L
            st = SamplerSettings(gen_length=n, block_length=b or L, steps=n, remasking="low_confidence", temperature=0.0)
            res = self.generator.generate([unique[k][0] for k in ks], st, batch_size=self.batch_size, stop_early=False)
            for k, r in zip(ks, res):
                out[k] = list(r.raw[:L]) == list(unique[k][1])
        return out

    def _pad_id(self) -> int:
        pid = getattr(self.tokenizer, "pad_token_id", None)
        return int(pid if pid is not None else self.eot_token_id)

    # -- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode each context with the family's decoding rule and cut at the task's stop strings.

        The rules: docs/design.md#generation.
        """
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

            done = self.generator.generate(prompts, st, seeds, batch_size=self.batch_size, on_batch=advance)
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



