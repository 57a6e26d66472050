"""LLaDA2.1's published decoding: joint thresholds, mask-to-token plus token-to-token editing (docs/llada21.md).

The rule, from the published ``generate`` of LLaDA2.1's modeling code (batch of one, the canvas
``ceil((prompt + gen_length) / b) * b`` tokens, blocks counted from the sequence start, the prompt's full blocks never
decoded, the block holding the prompt's tail decoded with its prompt positions kept), one block at a time, in rounds:

1. at the start of a round, the block's masked positions are *active*; a round that starts with none counts as a
   post-edit round, and once more than ``max_post_steps`` of them have run the block is finished (before any
   forward);
2. the block (with everything before it, under the block-causal mask) is fed; every one of its positions gets a token
   and a confidence (temperature 0: the argmax of the logits and its softmax probability; else one
   ``torch.multinomial`` draw per position over softmax(logits / temperature) after top-k / top-p, and its
   probability);
3. **mask to token**: every active position whose confidence exceeds ``threshold``; if none does, the single most
   confident active one (``torch.topk``);
4. **token to token**: every position of the block that was neither active nor prompt at the round's start, whose
   confidence exceeds ``edit_threshold`` and whose token differs from the one it holds, takes the new token (no limit
   on how many per round, edits while masks remain included);
5. a round that started with no mask and edited nothing finishes the block.

Earlier blocks are never edited. The published code stops after a block when ``eos_early_stop`` is set and the text so
far holds no mask and an end token; the text up to the first end token is the same either way (finished blocks never
change), so this rule always stops there.

**Modes** (the model card): quality (``threshold`` 0.7, ``edit_threshold`` 0.5) and speed (0.5, 0.0); the published
code's own defaults (0.95 / 0.9) are neither and are not used. ``max_post_steps`` 16 (the published default and the
card's advice, "more than 5").

**The round cap (a departure, only where the published code would not stop).** Nothing in the published loop stops a
block whose draw is the mask token itself: mask-to-token then "unmasks" a position into the mask again, and editing can
write the mask token over a decoded one; at temperature 0 that state repeats for ever (``while True``). Without such
draws a block takes at most ``block_length`` mask rounds plus ``max_post_steps`` post-edit rounds, so this rule stops a
block after ``4 * (block_length + max_post_steps)`` rounds (room for sampled mask draws the published loop recovers
from) and fills any position still masked with its most probable
token other than the mask. Real checkpoints practically never predict the mask token; the parity test counts how often
the cap was reached (never, on its prompts).

``cache: none`` recomputes the whole prefix at every round, as the published code does; ``prefix`` keeps finished
blocks in a key/value cache (the block-causal mask makes their keys and values final: the same logits to float
rounding). ``dual`` has nothing to cache (the positions after the block are not yet fed) and is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dllm_align.core.console import warn
from dllm_align.core.errors import UserError
from dllm_align.generate.block import cache_argument, draw, refuse_other_block_length
from dllm_align.generate.canvas import completion
from dllm_align.generate.rules import DecodingRule
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats

# lazy imports: transformers: the cache class, where the rule runs; the generator factory imports the rules' modules
# for every backend, and transformers takes longer to import than torch.

# The model card's two modes: (mask-to-token threshold, token-to-token threshold).
MODES = {"quality": (0.7, 0.5), "speed": (0.5, 0.0)}


def round_cap(block_length: int, max_post_steps: int) -> int:
    """Rounds after which a block is finished regardless (module docstring: only reached where the published loop
    would not stop)."""
    return 4 * (block_length + max_post_steps)


def joint_draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: Optional[torch.Generator]):
    """One token and its confidence per position, as the published sampler draws them (temperature 0: the argmax
    of the logits themselves, its softmax probability)."""
    if temperature == 0:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        tok = flat.argmax(dim=-1, keepdim=True)
        p = torch.softmax(flat, dim=-1).gather(-1, tok)
        return tok.view(logits.shape[:-1]), p.view(logits.shape[:-1])
    return draw(logits, temperature, top_k, top_p, generator)


@dataclass
class _Tally:
    """What a decode counts: forwards, blocks stopped by the round cap, edited positions, fallback rounds."""

    calls: int = 0
    capped: int = 0
    edits: int = 0
    fallbacks: int = 0


@dataclass(frozen=True)
class _JointRule:
    """The joint-threshold rule's settings for one decode."""

    mask_id: int
    temperature: float
    top_k: int
    top_p: float
    threshold: float
    edit_threshold: float
    max_post_steps: int
    cap: int  # rounds after which a block is finished regardless
    generator: Optional[torch.Generator]


class _BlockForward:
    """The model over the block-causal canvas ``x``: the whole prefix recomputed at every call, or (``use_cache``)
    the finished blocks kept as keys and values. Every forward is counted in ``tally.calls``."""

    def __init__(self, model, x: torch.Tensor, block_length: int, use_cache: bool, tally: _Tally):
        from transformers import DynamicCache

        self.model, self.x, self.block_length, self.use_cache, self.tally = model, x, block_length, use_cache, tally
        self.dtype = next(model.parameters()).dtype
        dev = x.device
        total = x.shape[1]
        blk = torch.arange(total, device=dev) // block_length
        self.causal = blk[:, None] >= blk[None, :]
        self.pos = torch.arange(total, device=dev)[None]
        self.cache = DynamicCache() if use_cache else None
        self.kv = {cache_argument(model): self.cache}

    def additive(self, allowed: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(allowed.shape, dtype=self.dtype, device=self.x.device)
        return out.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]

    def prefill(self, n: int) -> None:
        """Cache the prompt's full blocks (never decoded), with the cache on and such blocks there."""
        if self.use_cache and n:
            self.model(input_ids=self.x[:, :n], position_ids=self.pos[:, :n],
                       attention_mask=self.additive(self.causal[:n, :n]), **self.kv, use_cache=True)
            self.tally.calls += 1

    def block_logits(self, lo: int, hi: int, store: bool) -> torch.Tensor:
        """The block [lo, hi)'s logits; ``store``: the block is final, keep its keys and values."""
        self.tally.calls += 1
        x, pos, causal = self.x, self.pos, self.causal
        if self.use_cache:
            out = self.model(input_ids=x[:, lo:hi], position_ids=pos[:, lo:hi], attention_mask=self.additive(causal[lo:hi, :hi]),
                             **self.kv, use_cache=True).logits
            if not store:
                self.cache.crop(-self.block_length)  # the block was appended: drop it again (not final yet)
            return out
        return self.model(input_ids=x[:, :hi], position_ids=pos[:, :hi], attention_mask=self.additive(causal[:hi, :hi]),
                          use_cache=False).logits[:, lo:hi]


@torch.no_grad()
def llada21_generate(model, prompt: torch.Tensor, mask_id: int, gen_length: int, block_length: int = 32,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, threshold: float = 0.7,
                     edit_threshold: float = 0.5, max_post_steps: int = 16, stop_ids: Optional[Sequence[int]] = None,
                     use_cache: bool = False, generator: Optional[torch.Generator] = None,
                     calls: Optional[list] = None, capped: Optional[list] = None,
                     counts: Optional[dict] = None) -> torch.Tensor:
    """Decode ``gen_length`` tokens after ``prompt`` [P] (batch 1) by the joint-threshold rule. Returns the whole
    canvas [1, total]. ``generator``: the draws' random stream (None: torch's global one, as the published code);
    ``calls`` / ``capped``: lists the number of forwards and of blocks stopped by the round cap are appended to;
    ``counts``: a dict whose ``edits`` (positions replaced by token-to-token) and ``fallbacks`` (rounds where no masked
    position cleared the threshold) are added to."""
    dev = prompt.device
    plen = prompt.shape[0]
    n_blocks = -(-(plen + gen_length) // block_length)
    x = torch.full((1, n_blocks * block_length), mask_id, dtype=torch.long, device=dev)
    x[0, :plen] = prompt
    tally = _Tally()
    fwd = _BlockForward(model, x, block_length, use_cache, tally)
    rule = _JointRule(mask_id, temperature, top_k, top_p, threshold, edit_threshold, max_post_steps,
                      round_cap(block_length, max_post_steps), generator)
    stops = torch.tensor(list(stop_ids or []), dtype=torch.long, device=dev)
    fwd.prefill((plen // block_length) * block_length)
    for b in range(plen // block_length, n_blocks):
        lo, hi = b * block_length, (b + 1) * block_length
        _decode_block(fwd, rule, lo, hi, plen, tally)
        if use_cache:  # the block is final: store its keys and values
            fwd.block_logits(lo, hi, True)
        gen = x[0, plen:hi]
        if len(stops) and not (gen == mask_id).any() and torch.isin(gen, stops).any():
            break
    if calls is not None:
        calls.append(tally.calls)
    if capped is not None:
        capped.append(tally.capped)
    if counts is not None:
        counts["edits"] = counts.get("edits", 0) + tally.edits
        counts["fallbacks"] = counts.get("fallbacks", 0) + tally.fallbacks
    return x


def _decode_block(fwd: _BlockForward, rule: _JointRule, lo: int, hi: int, plen: int, tally: _Tally) -> None:
    """Block [lo, hi)'s rounds, until a post-edit round edits nothing, the post-edit rounds run out or the cap is
    reached (module docstring, steps 1 and 5)."""
    x, mask_id = fwd.x, rule.mask_id
    prompt_here = torch.arange(lo, hi, device=x.device) < plen
    post = rounds = 0
    while True:
        old = x[0, lo:hi].clone()
        active = old == mask_id
        if not active.any():
            post += 1
            if post > rule.max_post_steps:
                break
        if rounds >= rule.cap:
            tally.capped += 1
            if active.any():  # fill what the mask draws left, the mask token excluded
                logits = fwd.block_logits(lo, hi, False).float()
                tok = logits.index_fill(-1, torch.tensor([mask_id], device=x.device), -torch.inf)[0].argmax(-1)
                x[0, lo:hi] = torch.where(active, tok, old)
            break
        logits = fwd.block_logits(lo, hi, False)
        rounds += 1
        tok, p = joint_draw(logits, rule.temperature, rule.top_k, rule.top_p, rule.generator)
        tok, p = tok[0], p[0]
        write, edit = _round_writes(tok, p, old, active, prompt_here, rule, tally)
        if write.any():
            x[0, lo:hi] = torch.where(write, tok, old)
        if not active.any() and not edit.any():
            break


def _round_writes(tok: torch.Tensor, p: torch.Tensor, old: torch.Tensor, active: torch.Tensor,
                  prompt_here: torch.Tensor, rule: _JointRule, tally: _Tally) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's writes (module docstring, steps 3 and 4): mask to token over the active positions, token to
    token over the decoded ones. Returns (every position written, the edited ones)."""
    unmask = torch.zeros_like(active)
    if active.any():
        conf = torch.where(active, p, torch.full_like(p, -torch.inf))
        high = (conf > rule.threshold) & active
        if int(high.sum()) >= 1:
            unmask = high
        else:
            unmask[torch.topk(conf, k=1).indices] = True
            tally.fallbacks += 1
    editable = ~active & ~prompt_here
    edit = editable & (torch.where(editable, p, torch.full_like(p, -torch.inf)) > rule.edit_threshold) & (tok != old)
    tally.edits += int(edit.sum())
    return unmask | edit, edit


def decode_batch(mp, prompts, settings: SamplerSettings, seeds, stats, t0: float, stop_early: bool) -> list[Completion]:
    """One batch, prompt by prompt (the published decoder takes one sequence)."""
    own = settings.own_settings("llada21")
    tau_mask, tau_edit = resolved_thresholds(own)
    b = mp.block_size
    dev = mp.device
    stops = torch.tensor(mp.stop_token_ids or [-1], device=dev)
    local = SamplerStats(prompts=len(prompts))
    out = []
    capped: list[int] = []
    for prompt, seed in zip(prompts, seeds):
        calls: list[int] = []
        with mp._autocast(dev.type):
            x = llada21_generate(mp.model, torch.tensor(list(prompt), device=dev), mp.mask_token_id, settings.gen_length,
                                 b, float(settings.temperature), top_k=settings.top_k or 0, top_p=settings.top_p or 1.0,
                                 threshold=tau_mask, edit_threshold=tau_edit, max_post_steps=own.max_post_steps,
                                 stop_ids=mp.stop_token_ids, use_cache=settings.cache != "none",
                                 generator=torch.Generator(device=dev).manual_seed(int(seed)), calls=calls, capped=capped)
        gen = x[0, len(prompt): len(prompt) + settings.gen_length]
        local.forwards += calls[0]
        local.positions += calls[0] * b
        out.append(completion(mp, gen, stops, calls[0], local))
    if sum(capped):
        warn(f"llada21: {sum(capped)} block(s) of this batch reached the round cap: the model drew the mask token, "
             "where the published loop would not stop (docs/llada21.md#the-round-cap)")
    local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(local)
    return out


def resolved_thresholds(own) -> tuple[float, float]:
    """(mask-to-token, token-to-token) thresholds: the ones set, else the mode's."""
    tau_mask, tau_edit = MODES[own.mode]
    return (tau_mask if own.threshold is None else own.threshold,
            tau_edit if own.edit_threshold is None else own.edit_threshold)


def check_model(mp, settings: SamplerSettings) -> None:
    """The joint-threshold rule decodes LLaDA2.1 (a model whose family's rule it is), in the block length it was
    trained with, with no cache of the positions after the block."""
    b = mp.block_size
    if b is None or mp.family.sampler != "llada21":
        raise UserError(f"generate.sampler: llada21: the token-editing rule is LLaDA2.1's; {mp.family.name} models "
                        f"decode with the {mp.family.sampler} rule",
                        hint="set generate.sampler: auto (the family's own rule)")
    refuse_other_block_length(settings, b)
    if settings.cache == "dual":
        raise UserError("generate.cache: dual: the llada21 rule edits the block being decoded against the finished "
                        "blocks before it; nothing after the block is fed, so there is no dual cache to keep",
                        hint="set generate.cache: prefix (or none, the published recomputation)")


RULE = DecodingRule("llada21", decode_batch, check_model)
