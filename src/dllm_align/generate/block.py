"""The block-diffusion sampler of SDAR's published ``generate.py`` (``block_diffusion_generate``), with a KV cache.

The rule, from the published code:

* the canvas is ``ceil((prompt + gen_length) / b) * b`` tokens, blocks counted from the sequence start; the
  prompt's full blocks are prefilled into the cache under the block-causal mask; the block holding the
  prompt's tail (if any) is decoded like the others, its prompt tokens never masked;
* each block runs up to ``steps + 1`` iterations (one more, filling every position left, if the mask id
  itself was drawn and the schedule is spent; the published loop stops there with an IndexError): the block alone is fed against the cache (not stored);
  a token is drawn for every position with ``torch.multinomial`` over softmax(logits / temperature) (after
  top-k / top-p), and its probability is its confidence; ``low_confidence_dynamic`` unmasks every masked
  position whose confidence exceeds the threshold when there are at least as many as the schedule's count
  for this step (the block split evenly over the steps, the remainder to the first steps), else the
  schedule's count of most confident ones; ``low_confidence_static`` always the latter; once the block has
  no mask left it is fed once more and its keys and values are stored;
* generation stops after a block when any stop id appears after the prompt.

Temperature 0 (dllm-align's greedy setting; the published code divides by the temperature) is the limit of
each rule's own draw. SDAR's: as T -> 0 softmax(logits / T) puts all its mass on the most probable token,
so the drawn token is the argmax and its confidence tends to 1 at every position (every position clears any
threshold below 1); the order in which ``low_confidence_static`` takes them is the order of
1 - p_max(T) ~ exp(-gap / T), i.e. the gap between the two largest logits, widest first. LLaDA2's published
rule is itself greedy (argmax, with the T = 1 probability as the confidence).

The cache is transformers' ``DynamicCache``; a step that must not store is cropped back after the forward.
"""

from __future__ import annotations

import inspect
import time
from typing import Optional, Sequence

import torch

from dllm_align.core.errors import UserError
from dllm_align.generate.canvas import completion
from dllm_align.generate.rules import DecodingRule
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats

# lazy imports: transformers: imported where the block rule runs: it takes longer to import than torch, and the generator
# factory (generate/backend.py) imports this module for every backend, served ones included


def transfer_schedule(block_length: int, steps: int) -> torch.Tensor:
    base, rem = divmod(block_length, steps)
    out = torch.full((steps,), base, dtype=torch.int64)
    out[:rem] += 1
    return out


def draw(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         generator: Optional[torch.Generator] = None):
    """Tokens and their probabilities, one multinomial draw per position (the published order of operations).

    ``temperature`` 0 (dllm-align's greedy setting; the published code divides by it) takes the most
    probable token, its softmax probability as the confidence: LLaDA2's greedy rule (SDAR's limit is
    :func:`limit_draw`)."""
    shape = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1]).float()
    if temperature == 0:
        probs = torch.softmax(logits, dim=-1)
        p, tok = probs.max(dim=-1)
        return tok.view(*shape), p.view(*shape)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p < 1.0:
        srt, order = torch.sort(logits, descending=True)
        drop = torch.cumsum(torch.softmax(srt, -1), -1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    tok = torch.multinomial(probs, num_samples=1, generator=generator)
    return tok.view(*shape), torch.gather(probs, -1, tok).view(*shape)


def limit_draw(logits: torch.Tensor):
    """SDAR's draw in the limit T -> 0 (module docstring): the argmax token, confidence 1, and the rank that orders
    the confidences as T -> 0 (the gap between the two largest logits; +inf where there is one token only)."""
    logits = logits.float()
    if logits.shape[-1] < 2:
        tok = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        return tok, torch.ones(tok.shape, device=logits.device), torch.full(tok.shape, torch.inf, device=logits.device)
    top2 = torch.topk(logits, 2, dim=-1)
    gap = top2.values[..., 0] - top2.values[..., 1]
    return top2.indices[..., 0], torch.ones_like(gap), gap


def choose(masked: torch.Tensor, conf: torch.Tensor, count: int, strategy: str, threshold: float,
           rank: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which masked positions of one block [b] to unmask this step. ``rank`` (default: ``conf``) orders the
    positions when the schedule's count of most confident is taken (the T -> 0 order, :func:`limit_draw`)."""
    conf = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
    order = conf if rank is None else torch.where(masked, rank.to(conf.dtype), torch.full_like(conf, -torch.inf))
    pick = torch.zeros_like(masked)
    if strategy == "low_confidence_dynamic":
        high = conf > threshold
        if int(high.sum()) >= count:
            return high
    elif strategy != "low_confidence_static":
        raise ValueError(f"unknown remasking strategy {strategy!r}")
    pick[torch.topk(order, count).indices] = True
    return pick


def _mask(q: int, k: int, dtype) -> torch.Tensor:
    return torch.zeros(1, 1, q, k, dtype=dtype)


def cache_argument(model) -> str:
    """The name the body's forward takes its KV cache under: ``cache`` from transformers 5.2x on (the old
    ``past_key_values`` still works there, with a deprecation warning at every call), else ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def block_generate(model, prompt: torch.Tensor, mask_id: int, gen_length: int, block_length: int = 4,
                   steps: int = 4, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   strategy: str = "low_confidence_dynamic", threshold: float = 0.9,
                   stop_ids: Optional[Sequence[int]] = None, use_cache: bool = True,
                   generator: Optional[torch.Generator] = None, calls: Optional[list] = None,
                   rule: str = "sdar") -> torch.Tensor:
    """Decode ``gen_length`` tokens after ``prompt`` [P] (batch 1). Returns the whole canvas [1, total].

    ``use_cache=False`` recomputes the whole prefix at every step under the block-causal mask (the
    reference the cached path is checked against). ``generator``: the draws' random stream (default:
    torch's global one, as the published code). ``calls``: a list the number of model calls is appended to.

    ``rule="llada2"``: LLaDA2's published rule (``LLaDA2MoeModelLM.generate``, dllm's ``LLaDA2Sampler``):
    at most ``steps`` rounds per block (positions still masked after them stay masked), a round never
    takes more positions than are masked, and the block is recomputed with its prefix at every round
    (``use_cache`` keeps finished blocks in a cache instead: the same values).
    """
    if rule not in ("sdar", "llada2"):
        raise ValueError(f"unknown block rule {rule!r}")
    from transformers import DynamicCache

    dtype = next(model.parameters()).dtype
    dev = prompt.device
    plen = prompt.shape[0]
    n_blocks = -(-(plen + gen_length) // block_length)
    total = n_blocks * block_length
    blk = torch.arange(total, device=dev) // block_length
    causal = blk[:, None] >= blk[None, :]
    x = torch.full((1, total), mask_id, dtype=torch.long, device=dev)
    x[0, :plen] = prompt
    pos = torch.arange(total, device=dev)[None]
    prefill = (plen // block_length) * block_length
    cache = DynamicCache() if use_cache else None
    kv = {cache_argument(model): cache}

    def additive(allowed):
        out = torch.zeros(allowed.shape, dtype=dtype, device=dev)
        return out.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]

    if use_cache and prefill:
        model(input_ids=x[:, :prefill], position_ids=pos[:, :prefill], attention_mask=additive(causal[:prefill, :prefill]),
              **kv, use_cache=True)
    n_calls = int(use_cache and prefill > 0)
    sched = transfer_schedule(block_length, steps)
    for b in range(plen // block_length, n_blocks):
        lo, hi = b * block_length, (b + 1) * block_length
        cur = x[:, lo:hi].clone()
        step = 0
        while True:
            masked = cur == mask_id
            if rule == "llada2" and step >= steps:
                if use_cache:  # the block is finished as it stands: store it
                    model(input_ids=cur, position_ids=pos[:, lo:hi], attention_mask=additive(causal[lo:hi, :hi]),
                          **kv, use_cache=True)
                    n_calls += 1
                break
            n_calls += int(use_cache or bool(masked.any()))
            if not masked.any():
                if use_cache:
                    model(input_ids=cur, position_ids=pos[:, lo:hi], attention_mask=additive(causal[lo:hi, :hi]),
                          **kv, use_cache=True)
                break
            if use_cache:
                logits = model(input_ids=cur, position_ids=pos[:, lo:hi], attention_mask=additive(causal[lo:hi, :hi]),
                               **kv, use_cache=True).logits
                cache.crop(-block_length)  # the block was appended: drop it again (not stored)
            else:
                ids = torch.cat([x[:, :lo], cur], dim=1)
                logits = model(input_ids=ids, position_ids=pos[:, :hi], attention_mask=additive(causal[:hi, :hi]),
                               use_cache=False).logits[:, lo:hi]
            if step < steps:
                rank = None
                if rule == "sdar" and temperature == 0:
                    tok, p, rank = limit_draw(logits)
                    rank = rank[0]
                else:
                    tok, p = draw(logits, temperature, top_k, top_p, generator)
                count = int(sched[step]) if rule == "sdar" else min(int(sched[step]), int(masked.sum()))
                pick = choose(masked[0], p[0], count, strategy, threshold, rank)
            else:
                # The schedule is spent and masks remain: the mask id itself was drawn. The published loop
                # raises an IndexError here; every remaining position is filled, the mask id excluded.
                no_mask = logits.float().index_fill(-1, torch.tensor([mask_id], device=dev), -torch.inf)
                if rule == "sdar" and temperature == 0:
                    tok = limit_draw(no_mask)[0]
                else:
                    tok, _ = draw(no_mask, temperature, top_k, top_p, generator)
                pick = masked[0]
            cur[0, pick] = tok[0, pick]
            step += 1
        x[:, lo:hi] = cur
        if stop_ids and any(bool((x[0, plen:] == s).any()) for s in stop_ids):
            break
    if calls is not None:
        calls.append(n_calls)
    return x


def generate_batch_block(mp, prompts, settings: SamplerSettings, seeds, stats, t0: float, stop_early: bool) -> list[Completion]:
    """One batch under the block-diffusion rule (:mod:`dllm_align.generate.block`), prompt by prompt.

    ``cache: none`` recomputes every finished block at each step (exact); ``prefix`` / ``dual`` keep
    finished blocks in a KV cache (SDAR's published way). The family says whose rule (``block_rule``). ``threshold`` set: ``low_confidence_dynamic``
    (every position above it, when they are at least the step's count), else ``low_confidence_static``.
    """
    b = mp.block_size
    dev = mp.device
    stops = torch.tensor(mp.stop_token_ids or [-1], device=dev)
    local = SamplerStats(prompts=len(prompts))
    strategy = "low_confidence_static" if settings.threshold is None else "low_confidence_dynamic"
    out = []
    for prompt, seed in zip(prompts, seeds):
        calls: list[int] = []
        with mp._autocast(dev.type):
            x = block_generate(mp.model, torch.tensor(list(prompt), device=dev), mp.mask_token_id, settings.gen_length,
                               b, settings.steps_per_block, float(settings.temperature), top_k=settings.top_k or 0,
                               top_p=settings.top_p or 1.0, strategy=strategy, threshold=settings.threshold or 1.0,
                               stop_ids=mp.stop_token_ids, use_cache=settings.cache != "none",
                               generator=torch.Generator(device=dev).manual_seed(int(seed)), calls=calls,
                               rule=mp.family.block_rule)
        gen = x[0, len(prompt): len(prompt) + settings.gen_length]
        local.forwards += calls[0]
        local.positions += calls[0] * b
        out.append(completion(mp, gen, stops, calls[0], local))
    local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(local)
    return out


def check_block_model(mp, settings: SamplerSettings) -> None:
    """The block rule decodes a block-diffusion model in the block length it was trained with."""
    b = mp.block_size
    if b is None:
        raise UserError(f"generate.sampler: block needs a block-diffusion model ({mp.family.name} is not one)")
    if mp.family.sampler != "block":  # a block family with a rule of its own (LLaDA2.1's token editing)
        raise UserError(f"generate.sampler: block: {mp.family.name} models decode with their own rule, "
                        f"{mp.family.sampler}; the block rule would decode them without it",
                        hint="set generate.sampler: auto (the family's own rule)")
    refuse_other_block_length(settings, b)
    if settings.cache == "dual":
        raise UserError("generate.cache: dual: the block rule keeps finished blocks in its cache and recomputes the "
                        "block being decoded; it has no cache of the positions after it",
                        hint="set generate.cache: prefix (or none)")


RULE = DecodingRule("block", generate_batch_block, check_block_model)


def refuse_other_block_length(settings: SamplerSettings, b: int) -> None:
    """A block-diffusion model decodes in the blocks it was trained with: another ``generate.block_length`` is
    refused by name (the block rule's check and LLaDA2.1's)."""
    if settings.block_length != b:
        raise UserError(f"generate.block_length {settings.block_length} differs from the model's block size {b}",
                        hint=f"set generate.block_length: {b} (the blocks it was trained with)")
