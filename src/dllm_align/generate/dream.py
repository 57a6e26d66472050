"""Dream's published decoding rule (``diffusion_generate``), for families whose sampler is "dream".

The rule, as Dream's own generation code applies it (docs/design.md#the-dream-rule):

* one canvas: the prompt followed by ``gen_length`` mask tokens; no blocks, no
  early stop; ``steps`` model calls;
* ``timesteps = linspace(1, eps, steps + 1)`` (float32); at step i, with
  t = timesteps[i] and s = timesteps[i + 1], the logits are read shifted
  (position j from output j - 1; the family does this) at every masked position;
* candidates come from ``sample_tokens``: logits divided by the temperature
  (when > 0), then top-p and top-k filtering (these apply even at temperature
  0), softmax; at temperature > 0 a token is drawn from the categorical and its
  probability is the confidence, else the argmax and its probability; the mask
  token is not excluded;
* ``alg = "origin"``: every masked position independently commits its
  candidate with probability 1 - s / t (1 at the last step), positions
  chosen by uniforms drawn before the tokens;
* ``alg`` in ``maskgit_plus`` (top probability), ``topk_margin`` (top-1 minus
  top-2 probability), ``entropy`` (negative entropy, sum p log(p + 1e-10)):
  ``int(n_masked * (1 - s / t))`` positions are committed (the last step: all
  the rest), the most confident ones, or, with ``alg_temp`` > 0, drawn without
  replacement from ``softmax(confidence / alg_temp)``.

Choices made here (the published code runs one random stream for the whole
batch, so its output depends on batch-mates):

* each prompt owns a ``torch.Generator`` seeded with its own seed and draws, per
  step, in the published order (origin: the commit uniforms, then the
  categorical draws; others: the categorical draws, then the ``alg_temp``
  draw); the number committed is computed per row (the published code uses the
  batch's mean masked count, the same thing when rows hold equally many masks).
  A prompt alone reproduces the published code token for token, seeded the
  same way; in a batch it produces what it produces alone.
* logits are computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from dllm_align.generate.canvas import canvas, completion
from dllm_align.generate.rules import DecodingRule, whole_sequence_model
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def filter_logits(logits: torch.Tensor, top_p: Optional[float], top_k: Optional[int]) -> torch.Tensor:
    """Top-p then top-k filtering; removed entries get the dtype's lowest value (not -inf), as published."""
    low = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        sl, si = torch.sort(logits, descending=True)
        over = torch.cumsum(torch.softmax(sl, dim=-1), dim=-1) > top_p
        over[..., 1:] = over[..., :-1].clone()  # keep the token that crosses top_p
        over[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(over).scatter_(-1, si, over), low)
    if top_k is not None:
        k = min(int(top_k), logits.shape[-1])
        logits = logits.masked_fill(logits < torch.topk(logits, k)[0][..., -1:], low)
    return logits


def candidates(logits, temperature, top_p, top_k, alg, gen: torch.Generator):
    """(confidence, token) at each row of ``logits`` [n, V] under the published ``sample_tokens``."""
    if temperature > 0:
        logits = logits / temperature
    logits = filter_logits(logits, top_p, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0 and probs.shape[0] > 0:
        # torch.distributions.Categorical normalises before it calls multinomial.
        x0 = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, True, generator=gen).squeeze(-1)
        conf = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        conf, x0 = probs.max(dim=-1)
    if alg == "topk_margin":
        top2 = torch.sort(probs, dim=-1, descending=True).values
        conf = top2[:, 0] - top2[:, 1]
    elif alg == "entropy":
        conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf, x0


@torch.no_grad()
def denoise(mp, x: torch.Tensor, attn: torch.Tensor, settings, gens: Sequence[torch.Generator]) -> int:
    """Decode the masks of canvas ``x`` [B, T] in place under Dream's rule; returns the model calls made.

    ``gens`` holds one generator per row (see the module docstring for the order of draws).
    """
    B, T = x.shape
    dev = x.device
    mask_id = mp.mask_token_id
    temp, alg = float(settings.temperature), settings.alg
    timesteps = torch.linspace(1, settings.eps, settings.steps + 1, device=dev)
    sp = mp.family.source_positions
    forwards = 0
    for i in range(settings.steps):
        masked = x == mask_id
        live = [b for b in range(B) if bool(masked[b].any())]
        if not live:
            break  # nothing left to decode: the remaining steps could change nothing
        t, s = timesteps[i], timesteps[i + 1]
        last = i == settings.steps - 1
        if mp.separable:
            h = mp.hidden(x, attn)
            get = lambda b, c: mp.head(h[b, sp(c)]).float()  # noqa: E731
        else:
            full = mp.logits(x, attn).float()
            get = lambda b, c: full[b, c]  # noqa: E731
        forwards += 1
        for b in live:
            g = gens[b]
            cols = masked[b].nonzero(as_tuple=True)[0]
            logits = get(b, cols)
            if alg == "origin":
                p_transfer = 1 if last else 1 - s / t
                x0 = torch.full_like(cols, mask_id)
                move = torch.rand(cols.shape[0], device=dev, generator=g) < p_transfer
                _, x0[move] = candidates(logits[move], temp, settings.top_p, settings.top_k, alg, g)
                x[b, cols] = x0
                continue
            conf, x0 = candidates(logits, temp, settings.top_p, settings.top_k, alg, g)
            n_masked = masked[b].sum() / 1  # a float32 tensor, as the published batch mean
            k = int(n_masked) if last else int(n_masked * (1 - s / t))
            if k <= 0:
                continue
            full_conf = torch.full((1, T), -torch.inf, dtype=logits.dtype, device=dev)
            full_conf[0, cols] = conf
            if not settings.alg_temp:
                take = torch.topk(full_conf, k).indices[0]
            else:
                w = torch.softmax(full_conf / settings.alg_temp, dim=-1)
                take = torch.multinomial(w, num_samples=k, generator=g)[0]
            proposal = torch.full((T,), mask_id, dtype=torch.long, device=dev)
            proposal[cols] = x0
            x[b, take] = proposal[take]
    return forwards


def generate_batch_dream(mp, prompts, settings: SamplerSettings, seeds, stats, t0: float, stop_early: bool) -> list[Completion]:
    """One batch under Dream's rule (:func:`denoise` decodes the canvas; the rule has no early stop)."""
    x, attn = canvas(mp, prompts, settings.gen_length)
    P = x.shape[1] - settings.gen_length
    gens = [torch.Generator(device=mp.device).manual_seed(int(s)) for s in seeds]
    local = SamplerStats(prompts=len(prompts))
    local.forwards = denoise(mp, x, attn, settings, gens)
    local.positions = local.forwards * x.numel()
    stops = torch.tensor(mp.stop_token_ids or [-1], device=mp.device)
    out = [completion(mp, x[b, P:], stops, local.forwards, local) for b in range(len(prompts))]
    local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(local)
    return out


RULE = DecodingRule("dream", generate_batch_dream, whole_sequence_model)
