"""The LLaDA sampler (docs/design.md#the-llada-rule), in an exact and a fast mode (docs/design.md#fast-mode).

Exact mode is the semi-autoregressive sampler of LLaDA (docs/design.md#the-llada-rule, the
paper's decoding settings of Appendix C / Table 4):

* the prompt is followed by ``gen_length`` mask tokens, decoded in blocks of
  ``block_length`` from left to right, ``steps / num_blocks`` steps per block;
* a block holding n masked tokens decoded in s steps commits n // s tokens per
  step, plus one in each of the first n % s steps (:func:`transfer_schedule`);
* each step runs the model on the whole sequence, picks a candidate at every
  masked position (argmax at temperature 0; Gumbel-max with the noise in
  float64 otherwise, in the reference's form ``exp(logits) / (-log u) ** T``),
  scores it by its softmax probability (``low_confidence``) or a uniform
  number (``random``), forbids positions beyond the current block, and commits
  the top-scoring candidates;
* classifier-free guidance (``cfg`` > 0) adds a pass with the prompt masked and
  uses ``un + (cfg + 1) * (cond - un)``;
* batches are left-padded with an attention mask (positions skip the padding,
  so a padded row computes what it computes alone);
* the completion is the text before the first end-of-turn / EOS token.

Choices the reference leaves open, fixed here so that runs are reproducible:

* Ties in the score go to the leftmost position (stable sort); ties in argmax
  to the lowest token id.
* A step whose schedule commits nothing (possible when steps per block exceed
  the block length) is skipped: it could change nothing but the random stream.
* The candidate set at a step is every masked generated position left of the
  block's end, in position order. Usually that is the block's masked
  positions; it also holds an earlier position whose committed candidate was
  the mask token itself (the reference allows it; an untrained model does it).
* Randomness is per prompt: each row owns a ``torch.Generator`` seeded with its
  own seed (:func:`row_seed` of ``generate.seed`` and the prompt id). At each
  step a row draws, in this order, Gumbel uniforms of shape [c, V] (only when
  temperature > 0) and remasking uniforms of shape [c] (only for ``random``),
  both float64, c being its number of candidates. A prompt's tokens therefore
  do not depend on its batch-mates, the batch size or the number of processes
  (up to floating-point differences between batch shapes, which can flip a
  near-tie; on the same device and batch composition runs are bit-identical).
  The generator lives on the model's device, so CPU and GPU draw differently.
* The softmax for ``low_confidence`` is computed in float32 whatever the
  model's dtype (bf16 softmax produces many exact ties).
* Early stop: once a row has a committed stop token with nothing masked
  before it, no later step can change its text (committed tokens are final),
  so the row leaves the batch at the next block boundary. ``stop_early=False``
  decodes every block (the raw tokens then match the reference everywhere).

Fast mode (beyond the paper, after Fast-dLLM): ``cache='prefix'`` runs the
whole sequence once at the start of each block, keeps the keys/values of the
positions left of the block, and for the other steps of the block runs only the
block and the (masked) suffix against them; ``cache='dual'`` also keeps the
suffix's keys/values and runs only the block. The kept keys/values are stale
(they saw the block still masked), which is the approximation; they are
refreshed at every block boundary. A cached step offers as candidates only
the masked positions it recomputes (those of the block). ``threshold`` replaces the step schedule:
each step commits every candidate whose confidence exceeds it (at least the
best one per row), until the block is full; the mask token is then never a
candidate (otherwise a block could never finish) and ``steps`` is not used.
The cache needs the forward of :class:`_KVForward` (Llama-layout bodies: native
LLaDA, Dream as Qwen2, LLaDA-MoE as Qwen3-MoE); other models fall back to full recomputation with a
warning. With ``cache='none'`` and no threshold, fast mode *is* exact mode.

Families with shifted logits (Dream: position j is scored by output j - 1) are
decoded the same way: candidates are scored from the output the family names,
and a cached window starts one position before the block so that output is
recomputed. A family whose published rule is another (``Family.sampler``) is
decoded by that rule unless ``sampler: llada`` is asked for (:mod:`dllm_align.generate.dream`).


Settings, results and prompt encoding are in :mod:`dllm_align.generate.settings`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from dllm_align.core.console import warn
from dllm_align.core.errors import UserError
from dllm_align.generate.canvas import canvas, completion, first_stop
from dllm_align.generate.rules import DecodingRule, rule_for, settings_for, whole_sequence_model
from dllm_align.generate.settings import Completion, SamplerSettings, SamplerStats, length_batches, row_seed, transfer_schedule

# lazy imports: transformers: imported where the fast mode builds its cache: it takes longer to import than torch, and the
# generator factory (generate/backend.py) imports this module for every backend, served ones included


# --------------------------------------------------------------------------- cached forward
class _KVForward:
    """A forward over a Llama-family body that returns and reuses per-layer keys/values.

    Written against the layer's parts (norms, projections, rotary, MLP) rather
    than transformers' cache classes: attention here is bidirectional and the
    kept keys are not a prefix (dual cache keeps both sides of the block), which
    the causal cache API does not express. Attention is a set operation, so the
    kept keys can sit in any order as long as each carries its rotary position.
    """

    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.inner = model.model
        self.rope = apply_rotary_pos_emb
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    # Bodies with the Llama layout (LLaDA natively, Dream as Qwen2, LLaDA-MoE as Qwen3-MoE,
    # whose per-head q/k norms are applied below; its MoE MLP is just ``layer.mlp``).
    LAYOUTS = ("llama", "qwen2", "qwen3_moe")

    @staticmethod
    def unsupported(model) -> Optional[str]:
        """Why this model cannot use the cache (None: it can)."""
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) not in _KVForward.LAYOUTS:
            return f"model type {getattr(cfg, 'model_type', type(model).__name__)!r} is not Llama-family"
        if getattr(cfg, "use_sliding_window", False):
            return "the model uses sliding-window attention"
        if getattr(cfg, "is_causal", True) is not False:
            return "the model is not configured bidirectional (config.is_causal is not False)"
        inner = getattr(model, "model", None)
        need = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in need):
            return "the model body does not have the Llama layout"
        for layer in inner.layers:
            att = getattr(layer, "self_attn", None)
            if att is None or not all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return "an attention layer does not have the Llama layout"
        return None

    @torch.no_grad()
    def __call__(self, ids, pos, key_mask, past=None, want_kv=False):
        """Hidden states [R, W, H] of the window ``ids`` [R, W] at positions ``pos``.

        ``key_mask`` [R, K + W] says which keys may be attended (kept ones first);
        ``past`` is a per-layer list of kept (k, v) [R, kv_heads, K, d].
        """
        R, W = ids.shape
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        mask = key_mask.bool()[:, None, None, :]
        rep = self.heads // self.kv_heads
        kvs = []
        for i, layer in enumerate(self.inner.layers):
            att = layer.self_attn
            a = layer.input_layernorm(h)
            q = att.q_proj(a).view(R, W, self.heads, self.head_dim)
            k = att.k_proj(a).view(R, W, self.kv_heads, self.head_dim)
            if getattr(att, "q_norm", None) is not None:  # per-head RMSNorm (Qwen3-MoE / LLaDA-MoE)
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = att.v_proj(a).view(R, W, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            if want_kv:
                kvs.append((k, v))
            if past is not None:
                k = torch.cat([past[i][0], k], dim=2)
                v = torch.cat([past[i][1], v], dim=2)
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=att.scaling)
            h = h + att.o_proj(o.transpose(1, 2).reshape(R, W, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.inner.norm(h), kvs


_WARNED: set[str] = set()


def _kv_forward_for(mp) -> Optional[_KVForward]:
    cached = getattr(mp, "_dllm_kv_forward", None)
    if cached is not None:
        return cached
    why = _KVForward.unsupported(mp.model) if mp.separable else "the model's output head is not separable"
    if why is not None:
        if why not in _WARNED:
            warn(f"fast mode cache is not available ({why}); recomputing the whole sequence at every step")
            _WARNED.add(why)
        return None
    fwd = _KVForward(mp.model)
    mp._dllm_kv_forward = fwd
    return fwd


# --------------------------------------------------------------------------- the sampler
@dataclass
class _Batch:
    """One batch under LLaDA's rule: what stays fixed while it decodes, and the rows still decoding (``x`` to
    ``rows``, narrowed as rows stop early)."""

    mp: Any
    settings: SamplerSettings
    P: int  # the prompt width (the longest prompt; the others are left-padded to it)
    kvf: Optional[_KVForward]  # the cached forward of fast mode, None to recompute the whole sequence
    stops: torch.Tensor
    col: torch.Tensor  # 0 .. P + gen_length - 1, to compare positions against
    x: torch.Tensor
    attn: torch.Tensor
    is_prompt: torch.Tensor
    pos: torch.Tensor
    gens: list[torch.Generator]
    rows: list[int]  # original index of each live row
    forwards: torch.Tensor  # forwards each original row took part in
    results: list[Optional[Completion]]
    local: SamplerStats

    @classmethod
    def start(cls, mp, prompts, settings: SamplerSettings, seeds) -> "_Batch":
        """The canvas: prompts left-padded, then ``gen_length`` masks; one random stream per row."""
        B = len(prompts)
        dev = mp.device
        P = max(len(p) for p in prompts)
        x, attn = canvas(mp, prompts, settings.gen_length)
        is_prompt = attn.bool().clone()
        is_prompt[:, P:] = False
        return cls(
            mp=mp, settings=settings, P=P,
            kvf=_kv_forward_for(mp) if settings.cache != "none" else None,
            stops=torch.tensor(mp.stop_token_ids or [-1], device=dev),
            col=torch.arange(P + settings.gen_length, device=dev),
            x=x, attn=attn, is_prompt=is_prompt, pos=mp.position_ids(attn, x.shape, dev),
            gens=[torch.Generator(device=dev).manual_seed(int(s)) for s in seeds],
            rows=list(range(B)),
            forwards=torch.zeros(B, dtype=torch.long),
            results=[None] * B,
            local=SamplerStats(prompts=B),
        )

    def finish(self, j: int) -> None:
        """Live row ``j``'s completion, into its original slot."""
        r = self.rows[j]
        self.results[r] = completion(self.mp, self.x[j, self.P:], self.stops, int(self.forwards[r]), self.local)

    def keep_rows(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.mp.device)
        self.x, self.attn, self.is_prompt, self.pos = self.x[idx], self.attn[idx], self.is_prompt[idx], self.pos[idx]
        self.gens = [self.gens[j] for j in keep]
        self.rows = [self.rows[j] for j in keep]

    def retire_finished(self) -> None:
        """Early stop, at a block boundary: finish the rows whose text can no longer change (a committed stop token
        with nothing masked before it) and drop them from the batch."""
        G = self.settings.gen_length
        has, first = first_stop(self.x[:, self.P:], self.stops)
        before = (self.x[:, self.P:] == self.mp.mask_token_id) & (self.col[:G].unsqueeze(0) < first.unsqueeze(1))
        done = (has & ~before.any(dim=1)).tolist()
        if any(done):
            for j, d in enumerate(done):
                if d:
                    self.finish(j)
            self.keep_rows([j for j, d in enumerate(done) if not d])


@torch.no_grad()
def _generate_batch_llada(mp, prompts, settings: SamplerSettings, seeds, stats, t0: float, stop_early: bool) -> list[Completion]:
    """One batch under LLaDA's rule, exact or fast (the module docstring)."""
    b = _Batch.start(mp, prompts, settings, seeds)
    for blk in range(settings.num_blocks):
        if stop_early and blk > 0:
            b.retire_finished()
            if not b.rows:
                break
        _decode_block(b, blk)
    for j in range(len(b.rows)):
        b.finish(j)
    b.local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(b.local)
    return b.results  # type: ignore[return-value]


def _decode_block(b: _Batch, blk: int) -> None:
    """Block ``blk``'s steps: the schedule's (exact mode), or until the block holds no mask (a threshold)."""
    s = b.settings
    mask_id = b.mp.mask_token_id
    bs, be = b.P + blk * s.block_length, b.P + (blk + 1) * s.block_length
    in_block = (b.col >= bs) & (b.col < be)
    if s.threshold is None:
        n = (b.x[:, bs:be] == mask_id).sum(dim=1).tolist()
        sched = torch.tensor([transfer_schedule(int(v), s.steps_per_block) for v in n], device=b.mp.device)  # [R, s]
    kept = None  # (per-layer k/v, key mask) kept for this block
    k_now = None  # tokens each row commits at this step (None: the threshold decides)
    step = 0
    while True:
        if s.threshold is None:
            if step == s.steps_per_block:
                break
            k_now = sched[:, step]
            if not bool(k_now.any()):
                step += 1
                continue
        elif not bool((b.x[:, bs:be] == mask_id).any()):
            break
        kept = _step(b, bs, be, in_block, k_now, kept)
        step += 1


def _step(b: _Batch, bs: int, be: int, in_block: torch.Tensor, k_now: Optional[torch.Tensor], kept):
    """One denoising step of the block [bs, be): pick the candidates, run the model, propose, commit. Returns the
    block's kept keys/values (set by its first cached forward)."""
    mp, s = b.mp, b.settings
    shift = mp.family.logit_shift
    # A shifted family (Dream) scores position j with output j - shift: a cached window starts ``shift`` early so
    # that the output scoring the block's first position is recomputed too.
    ws = bs - shift  # where a cached window starts
    # The window of positions whose outputs this forward computes.
    if b.kvf is None or kept is None:
        lo, hi = 0, len(b.col)
    elif s.cache == "prefix":
        lo, hi = ws, len(b.col)
    else:
        lo, hi = ws, be
    cand = (b.x == mp.mask_token_id) & (b.col >= max(b.P, lo + shift)) & (b.col < min(be, hi))
    if k_now is None:
        cand &= in_block
    else:
        cand &= (k_now > 0).unsqueeze(1)
    if not bool(cand.any()):
        return kept
    rr, cc = cand.nonzero(as_tuple=True)  # row-major: by row, then position
    get, kept = _forward(b, lo, hi, ws, be, kept)
    logits = _candidate_logits(b, get, rr, cc)
    counts = torch.bincount(rr, minlength=len(b.rows)).tolist()
    x0, conf = _propose(b, logits, counts)
    _commit(b, rr, cc, x0, conf, counts, k_now)
    return kept


def _forward(b: _Batch, lo: int, hi: int, ws: int, be: int, kept):
    """Run the model over the window [lo, hi) (the whole sequence when nothing is cached), with the unconditional
    copies under CFG. Returns ``get(rows, positions)``, the logits scoring those positions, and the kept
    keys/values (refreshed by the first cached forward of a block)."""
    mp, s = b.mp, b.settings
    mask_id = mp.mask_token_id
    cfg = float(s.cfg)
    sp = mp.family.source_positions  # maps scored positions to the outputs read (shifted families)

    def doubled(t: torch.Tensor, un: Optional[torch.Tensor] = None) -> torch.Tensor:
        # CFG: the unconditional copies follow the conditional rows in one forward.
        return torch.cat([t, t if un is None else un], dim=0) if cfg > 0 else t

    un_x = b.x.masked_fill(b.is_prompt, mask_id) if cfg > 0 else None
    xx, aa, pp = doubled(b.x, un_x), doubled(b.attn), doubled(b.pos)
    if b.kvf is None:
        h = mp.hidden(xx, aa) if mp.separable else None
        if h is None:
            full = mp.logits(xx, aa)
            get = lambda r, c: full[r, c]  # noqa: E731
        else:
            get = lambda r, c: mp.head(h[r, sp(c)])  # noqa: E731
    elif kept is None:
        h, kvs = b.kvf(xx, pp, aa, want_kv=True)
        kept = _kept_keys_values(kvs, aa, ws, be, prefix=s.cache == "prefix")
        get = lambda r, c: mp.head(h[r, sp(c)])  # noqa: E731
    else:
        past, km = kept
        h, _ = b.kvf(xx[:, lo:hi], pp[:, lo:hi], torch.cat([km, aa[:, lo:hi]], dim=1), past=past)
        get = lambda r, c: mp.head(h[r, sp(c) - lo])  # noqa: E731
    b.local.forwards += 1
    b.local.positions += xx.shape[0] * (hi - lo)
    b.forwards[torch.tensor(b.rows)] += 1
    return get, kept


def _kept_keys_values(kvs, aa: torch.Tensor, ws: int, be: int, prefix: bool):
    """The fast cache's refresh at a block's first forward: the keys/values (and key mask) of the positions left of
    the window, and with ``dual`` also of those right of the block."""
    if prefix:
        return [(k[:, :, :ws], v[:, :, :ws]) for k, v in kvs], aa[:, :ws]
    past = [(torch.cat([k[:, :, :ws], k[:, :, be:]], 2), torch.cat([v[:, :, :ws], v[:, :, be:]], 2)) for k, v in kvs]
    return past, torch.cat([aa[:, :ws], aa[:, be:]], dim=1)


def _candidate_logits(b: _Batch, get, rr: torch.Tensor, cc: torch.Tensor) -> torch.Tensor:
    """The candidates' logits in float32, guided under CFG; the mask token barred under a threshold."""
    cfg = float(b.settings.cfg)
    logits = get(rr, cc).float()
    if cfg > 0:
        un = get(rr + len(b.rows), cc).float()
        logits = un + (cfg + 1) * (logits - un)
    if b.settings.threshold is not None:
        logits[:, b.mp.mask_token_id] = -float("inf")
    return logits


def _propose(b: _Batch, logits: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A token and a score per candidate: argmax or Gumbel-max, scored by its probability or a uniform number; each
    row draws from its own stream, Gumbel uniforms first."""
    s = b.settings
    dev = b.mp.device
    temp = float(s.temperature)
    random_remask = s.remasking == "random"
    N, V = logits.shape
    if temp > 0 or random_remask:
        u = torch.empty((N, V), dtype=torch.float64, device=dev) if temp > 0 else None
        rnd = torch.empty(N, dtype=torch.float64, device=dev) if random_remask else None
        start = 0
        for j, c in enumerate(counts):
            if c:
                if u is not None:
                    u[start : start + c] = torch.rand((c, V), dtype=torch.float64, device=dev, generator=b.gens[j])
                if rnd is not None:
                    rnd[start : start + c] = torch.rand((c,), dtype=torch.float64, device=dev, generator=b.gens[j])
            start += c
    if temp > 0:
        x0 = (logits.double().exp() / (-torch.log(u)) ** temp).argmax(dim=-1)
    else:
        x0 = logits.argmax(dim=-1)
    if random_remask:
        conf = rnd
    else:
        conf = torch.softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1).double()
    return x0, conf


def _commit(b: _Batch, rr: torch.Tensor, cc: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, counts: list[int],
            k_now: Optional[torch.Tensor]) -> None:
    """The transfer rule: each row commits its ``k_now`` best candidates (exact mode), or every candidate above the
    threshold and at least its best one."""
    dev = b.mp.device
    R, N = len(b.rows), len(rr)
    # Rank the candidates within each row: highest score first, ties to the left.
    counts_t = torch.tensor(counts, device=dev)
    starts = torch.cumsum(counts_t, 0) - counts_t
    slot = torch.arange(N, device=dev) - starts[rr]
    C = int(max(counts))
    table = torch.full((R, C), -float("inf"), dtype=torch.float64, device=dev)
    table[rr, slot] = conf
    order = torch.sort(table, dim=1, descending=True, stable=True).indices
    rank_t = torch.empty_like(order)
    rank_t.scatter_(1, order, torch.arange(C, device=dev).expand(R, C).contiguous())
    rank = rank_t[rr, slot]
    if k_now is None:
        take = (rank == 0) | (conf > b.settings.threshold)
    else:
        take = rank < k_now[rr]
    b.x[rr[take], cc[take]] = x0[take]


RULE = DecodingRule("llada", _generate_batch_llada, whole_sequence_model)


@torch.no_grad()
def generate_batch(
    mp,
    prompts: Sequence[Sequence[int]],
    settings: SamplerSettings,
    *,
    seeds: Optional[Sequence[int]] = None,
    stop_early: bool = True,
    stats: Optional[SamplerStats] = None,
) -> list[Completion]:
    """Decode one batch of tokenised prompts (left-padded together). See the module docstring.

    ``seeds``: one per prompt (default: :func:`row_seed` of ``settings.seed`` and
    the prompt's index in this call; the CLI passes the prompt ids instead).
    The rule is ``settings.sampler``'s (auto: the model family's), looked up by name in
    the components registry (:func:`dllm_align.generate.rules.rule_for`).
    """
    settings = settings_for(mp, settings)
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise UserError("an empty prompt cannot be decoded (it has no tokens)")
    t0 = time.perf_counter()
    B = len(prompts)
    if seeds is None:
        seeds = [row_seed(settings.seed, i) for i in range(B)]
    if len(seeds) != B:
        raise ValueError(f"{len(seeds)} seeds for {B} prompts")
    return rule_for(settings.sampler).decode_batch(mp, prompts, settings, seeds, stats, t0, stop_early)


def generate(
    mp,
    prompts: Sequence[Sequence[int]],
    settings: SamplerSettings,
    *,
    seeds: Optional[Sequence[int]] = None,
    batch_size: int = 8,
    stop_early: bool = True,
    stats: Optional[SamplerStats] = None,
    on_batch: Optional[Callable[[list[int], list[Completion]], None]] = None,
) -> list[Completion]:
    """Decode many prompts in length-grouped batches; results come back in input order.

    ``on_batch(indices, completions)`` is called as each batch finishes (the CLI
    appends rows there, so a killed run keeps what it finished).
    """
    settings = settings_for(mp, settings)
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1 (got {batch_size})")
    if seeds is None:
        seeds = [row_seed(settings.seed, i) for i in range(len(prompts))]
    out: list[Optional[Completion]] = [None] * len(prompts)
    for idx in length_batches([len(p) for p in prompts], batch_size):
        res = generate_batch(mp, [prompts[i] for i in idx], settings, seeds=[seeds[i] for i in idx], stop_early=stop_early, stats=stats)
        for i, r in zip(idx, res):
            out[i] = r
        if on_batch is not None:
            on_batch(idx, res)
    return out  # type: ignore[return-value]

