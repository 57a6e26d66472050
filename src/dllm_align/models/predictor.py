"""The mask-predictor interface (:class:`MaskPredictor`), packed rows and the chunked output head.

The estimator and the sampler talk to a :class:`MaskPredictor`: it runs the
body of the network once and applies the output head only where logits are
needed (the masked positions), which is what keeps the ELBO step's memory small
when the vocabulary is 126,464 wide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils.checkpoint import checkpoint

from dllm_align.core.errors import UserError
from dllm_align.models.block_attention import STREAMS_ATTENTION, uses_streams_attention
from dllm_align.models.families import family_of
from dllm_align.models.precision import autocast, experts_in_compute_precision

# lazy imports: torch.nn.attention.flex_attention: it exists from torch 2.5 on (pyproject allows 2.4); only the flex
# variant runs it

if TYPE_CHECKING:
    from dllm_align.models.block_attention import Streams
    from dllm_align.models.precision import Precision



# --------------------------------------------------------------------------- the interface
class MaskPredictor:
    """A masked diffusion LM seen as a mask predictor p_theta(x_0 | x_t).

    ``hidden`` runs the network body; ``head`` maps hidden states to logits.
    Splitting them lets callers apply the (huge) output head only at the
    positions they score. Models whose head cannot be separated fall back to
    full logits transparently.

    The model's family (``dllm_align.models.families``) says how outputs line up with
    positions: :meth:`logits` and :meth:`target_logprobs` always return the
    prediction *for* position j, reading output j - shift for a shifted family
    (Dream), so the estimator and the sampler never see the difference.
    """

    def __init__(self, model, tokenizer, mask_token_id: Optional[int] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.weight_sources = None  # set by a load with empty weights (models.load.read_weight_shards reads them)
        self.family = family_of(model)
        cfg = getattr(model, "config", None)
        mid = mask_token_id
        if mid is None:
            mid = getattr(cfg, "mask_token_id", None)
        if mid is None and tokenizer is not None:
            mid = getattr(tokenizer, "mask_token_id", None)
        if mid is None:
            raise UserError(
                "could not find the mask token id in the model config or tokenizer",
                hint="set model.mask_token_id in the recipe (LLaDA: 126336)",
            )
        self.mask_token_id = int(mid)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None)
        if vocab is not None and not 0 <= self.mask_token_id < int(vocab):
            # An id past the embedding table fails deep inside a forward (or, on GPU, as a device assert).
            raise UserError(
                f"mask token id {self.mask_token_id} is outside the model's vocabulary (ids 0..{int(vocab) - 1})",
                hint="fix model.mask_token_id in the recipe (LLaDA: 126336), or leave it unset to read it from the model",
            )
        self.stop_token_ids = self._stop_ids()
        self._body, self._head = self._split()

    # -- structure
    def _split(self):
        base = getattr(self.model, "base_model_prefix", None)
        body = getattr(self.model, base, None) if base else None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if body is None or head is None or body is self.model:
            return None, None
        return body, head

    @property
    def separable(self) -> bool:
        return self._body is not None

    def _stop_ids(self) -> list[int]:
        ids = []
        tok = self.tokenizer
        for t in self.family.stop_tokens:
            try:
                i = tok.convert_tokens_to_ids(t)
            except Exception:
                i = None
            if isinstance(i, int) and i != getattr(tok, "unk_token_id", None) and i >= 0:
                ids.append(i)
        if tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.append(tok.eos_token_id)
        return ids

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def block_size(self) -> Optional[int]:
        """The block size of a block-diffusion family (the checkpoint's config wins); None otherwise."""
        return self.family.block_size_in(getattr(self.model, "config", None))

    @property
    def likelihood(self) -> str:
        """The name of the family's likelihood (``dllm_align.objective.elbo.LIKELIHOODS``)."""
        return self.family.likelihood

    @property
    def canvas_length(self) -> Optional[int]:
        """The canvas of an encoder-decoder family (DiffusionGemma's ``canvas_length``); None otherwise."""
        return getattr(getattr(self.model, "config", None), "canvas_length", None)

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size

    def enable_gradient_checkpointing(self) -> None:
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x
            self.model.activation_checkpointing_enable({"use_reentrant": False})
        elif hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(self.model.config, "use_cache"):
                self.model.config.use_cache = False

    # -- compute
    @staticmethod
    def position_ids(attention_mask: Optional[torch.Tensor], shape, device) -> torch.Tensor:
        """Positions that skip padding, so a padded row sees exactly what it sees alone."""
        if attention_mask is None:
            return torch.arange(shape[1], device=device).unsqueeze(0).expand(shape[0], -1)
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.clamp_min(0)

    # The precision every forward of this model runs in (dllm_align.models.precision); None: the weights' dtype.
    precision: Optional["Precision"] = None

    def set_precision(self, precision: Optional["Precision"]) -> None:
        self.precision = precision
        if precision is not None and precision.autocast is not None and precision.autocast != precision.weights:
            experts_in_compute_precision(self.model)  # MoE experts: autocast does not see grouped matmuls

    def _autocast(self, device_type: str):
        return autocast(self.precision, device_type)

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        p = self.precision
        return None if p is None or p.autocast is None or p.autocast == p.weights else p.autocast

    def _forward_args(self, input_ids, attention_mask, packed: Optional[torch.Tensor],
                      streams: Optional["Streams"] = None) -> dict:
        """Keyword arguments of the network call: padded rows, packed rows (:func:`packed_attention`), or
        block-diffusion streams rows (``dllm_align.models.block_attention``: every stream of a row at the
        positions of its sequence; ``attention_mask`` is not used, ``streams.valid`` says what is real)."""
        if streams is not None:
            if not uses_streams_attention(self.model):
                raise RuntimeError(f"block-diffusion streams need the {STREAMS_ATTENTION} attention (load_model sets it)")
            pos = self.position_ids(streams.valid, streams.blocks.shape, input_ids.device).repeat(1, streams.draws + 1)
            return dict(input_ids=input_ids, position_ids=pos, dllm_streams=streams)
        if packed is None:
            pos = self.position_ids(attention_mask, input_ids.shape, input_ids.device)
            return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos)
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None) or "sdpa"
        dtype = self.compute_dtype or next(self.model.parameters()).dtype
        if impl == "flex_attention" and packed.shape[1] % FLEX_BLOCK:
            # widths rounded up to whole blocks, so that the compiled flex kernels see recurring shapes;
            # the added columns join the row's unused tail (outputs there are never read)
            pad = FLEX_BLOCK - packed.shape[1] % FLEX_BLOCK
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
            packed = torch.nn.functional.pad(packed, (0, pad), value=-1)
        mask, extra = packed_attention(packed, impl, dtype)
        return dict(input_ids=input_ids, attention_mask=mask, position_ids=packed_positions(packed), **extra)

    def hidden(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None,
        streams: Optional["Streams"] = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, H] (after the last norm).

        ``packed`` [B, T]: the index of the sequence each position belongs to in
        packed rows (-1 for an unused tail); see :func:`packed_attention`. It
        replaces ``attention_mask``.
        """
        if not self.separable:
            raise RuntimeError("hidden() needs a model whose output head is separable")
        with self._autocast(input_ids.device.type):
            out = self._body(**self._forward_args(input_ids, attention_mask, packed, streams), use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h[:, : input_ids.shape[1]]  # [B, T]: a flex width rounding is dropped

    def head(self, h: torch.Tensor) -> torch.Tensor:
        with self._autocast(h.device.type):
            return self._head(h)

    def logits(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Full logits [B, T, V] (generation, tests)."""
        if self.separable:
            return self.family.align_logits(self.head(self.hidden(input_ids, attention_mask, packed)))
        with self._autocast(input_ids.device.type):
            out = self.model(**self._forward_args(input_ids, attention_mask, packed))
        return self.family.align_logits((out.logits if hasattr(out, "logits") else out[0])[:, : input_ids.shape[1]])

    def target_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        rows: torch.Tensor,
        cols: torch.Tensor,
        targets: torch.Tensor,
        packed: Optional[torch.Tensor] = None,
        streams: Optional["Streams"] = None,
    ) -> torch.Tensor:
        """log p(targets) at positions (rows, cols), in fp32, computing logits only there.

        ``rows``, ``cols`` and ``targets`` are 1-D of equal length N; returns [N].
        ``packed``: the sequence layout of packed rows (:meth:`hidden`); ``cols``
        are then columns of the packed row. For a shifted family the hidden state
        gathered for position j is j - 1's, clamped at the first position of j's own
        sequence (of its packed sequence when packed, so a sequence with an empty
        prompt never reads its row-mate's output: the same value as unpacked).
        ``streams``: rows in the block-diffusion streams layout (:meth:`_forward_args`).
        """
        src = self.family.source_positions(cols)
        if packed is not None and self.family.logit_shift:
            first = cols - packed_positions(packed)[rows, cols]
            src = torch.maximum(src, first)
        if self.separable:
            h = self.hidden(input_ids, attention_mask, packed, streams)[rows, src]  # [N, H]: only the scored positions
            w = self._plain_head_weight()
            if w is not None and self.head_chunk:
                # The chunked head computes its matmul in the autocast dtype explicitly (an
                # out= matmul escapes autocast): the same rounding as the Linear below.
                return chunked_target_logprobs(h, w, targets, self.head_chunk, self.compute_dtype)
            logits = self.head(h)
        else:
            with self._autocast(input_ids.device.type):
                out = self.model(**self._forward_args(input_ids, attention_mask, packed, streams))
            logits = (out.logits if hasattr(out, "logits") else out[0])[rows, src]  # unshifted output, read at src
        logits = logits.float()
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def position_terms(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        rows: torch.Tensor,
        cols: torch.Tensor,
        term,
        extra: tuple = (),
        packed: Optional[torch.Tensor] = None,
        streams: Optional["Streams"] = None,
    ) -> torch.Tensor:
        """``term(logits, *extra)`` at positions (rows, cols): a function of the full fp32 logits [n, V] of n
        positions (and of ``extra``'s tensors [N] cut to them) to one value per position [n], for a likelihood whose
        terms read the whole distribution (``objective.hybrid``). Returns [N].

        The positions go through ``term`` in chunks of about ``TERM_CHUNK`` logits; under autograd each chunk's
        logits (and what ``term`` makes of them) are recomputed in the backward pass (``torch.utils.checkpoint``)
        instead of kept, so what stays is the hidden states at the positions (a non-separable model: its logits
        there). Positions line up as in :meth:`target_logprobs`."""
        src = self.family.source_positions(cols)
        if packed is not None and self.family.logit_shift:
            src = torch.maximum(src, cols - packed_positions(packed)[rows, cols])
        if self.separable:
            feats = self.hidden(input_ids, attention_mask, packed, streams)[rows, src]  # [N, H]

            def run(x, *ex):
                return term(self.head(x).float(), *ex)
        else:
            with self._autocast(input_ids.device.type):
                out = self.model(**self._forward_args(input_ids, attention_mask, packed, streams))
            feats = (out.logits if hasattr(out, "logits") else out[0])[rows, src]

            def run(x, *ex):
                return term(x.float(), *ex)
        step = max(1, self.TERM_CHUNK // max(1, self.vocab_size))
        parts = []
        for s in range(0, feats.shape[0], step):
            args = (feats[s:s + step], *(x[s:s + step] for x in extra))
            if torch.is_grad_enabled() and feats.requires_grad:
                parts.append(checkpoint(run, *args, use_reentrant=False))
            else:
                parts.append(run(*args))
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    # Logits of one chunk of :meth:`position_terms` (about 64 MB in fp32, and a likelihood's float64 working set on
    # them, some 7 times that).
    TERM_CHUNK: int = 1 << 24

    def canvas_logits(self, examples, self_conditioning: str = "none") -> list:
        """An encoder-decoder family's scoring call (``Family.score_canvases``, DiffusionGemma): for each example
        ``(context [S], clean canvases [C_b], their noisy versions [K, C_b])`` the per-canvas logits [K, C_b, V]
        (fp32), the context encoded once and shared by the K draws. One call for a whole batch, so that a wrapped
        policy (``training.policy.PolicyScorer``) sees one forward."""
        score = self.family.score_canvases
        if score is None:
            raise RuntimeError(f"the {self.family.name} family scores one sequence, not canvases against a context")
        dev = self.device
        # Examples of the same shape (context length, canvas lengths, draws) run as one batch: nothing is padded,
        # so a row's value does not depend on which rows share its call beyond floating-point rounding, and the
        # reference (computed in training's micro-batches) groups exactly as training does.
        groups: dict[tuple, list[int]] = {}
        for i, (ctx, clean, noisy) in enumerate(examples):
            key = (int(ctx.shape[0]), tuple(int(c.shape[0]) for c in clean), tuple(int(x.shape[0]) for x in noisy))
            groups.setdefault(key, []).append(i)
        out: list = [None] * len(examples)
        with self._autocast(dev.type):
            for idx in groups.values():
                nb = len(examples[idx[0]][1])
                ctx = torch.stack([examples[i][0] for i in idx]).to(dev)
                clean = [torch.stack([examples[i][1][b] for i in idx]).to(dev) for b in range(nb)]
                noisy = [torch.stack([examples[i][2][b] for i in idx]).to(dev) for b in range(nb)]
                per_canvas = score(self.model, ctx, clean, noisy, self_conditioning)
                for j, i in enumerate(idx):
                    out[i] = [p[j] for p in per_canvas]
        return out

    # Rows of the output head computed at once by the chunked scorer: a [chunk, V] fp32 block
    # (128 x 126,464 x 4 B = 65 MB for LLaDA). 0 turns chunking off.
    head_chunk: int = 128

    def _plain_head_weight(self) -> Optional[torch.Tensor]:
        """The head's weight if the head is a plain bias-free Linear on an unsharded tensor."""
        head = self._head
        w = getattr(head, "weight", None)
        if not isinstance(head, torch.nn.Linear) or head.bias is not None or w is None:
            return None
        if type(w.data) is not torch.Tensor or w.dim() != 2:  # DTensor / FSDP flat params: use the module
            return None
        if head._forward_hooks or head._forward_pre_hooks:  # e.g. PEFT or FSDP hooks: respect them
            return None
        return w


# --------------------------------------------------------------------------- packed rows
def packed_positions(packed: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 at the start of every sequence of a packed row."""
    T = packed.shape[1]
    idx = torch.arange(T, device=packed.device).expand_as(packed)
    start = torch.ones_like(packed, dtype=torch.bool)
    start[:, 1:] = packed[:, 1:] != packed[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def packed_varlen_kwargs(packed: torch.Tensor) -> dict:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` of packed rows, for transformers' flash (varlen) path.

    The rows are flattened into one token stream (row 0, then row 1, ...); every
    run of one layout value in a row is one sequence (the unused tail is a run of
    its own), so a sequence never spans two rows and the offsets cover all R x T
    tokens. The maximum is a Python int (one device sync per forward, not per layer).
    """
    R, T = packed.shape
    start = torch.ones_like(packed, dtype=torch.bool)
    start[:, 1:] = packed[:, 1:] != packed[:, :-1]
    flat = start.reshape(-1).nonzero().view(-1)
    cu = torch.cat([flat, torch.tensor([R * T], device=packed.device)]).to(torch.int32)
    longest = int(cu.diff().max()) if cu.numel() > 1 else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


FLEX_BLOCK = 128  # FlexAttention's default sparse block size; packed widths are rounded up to it under flex


def flex_block_mask(packed: torch.Tensor, block: int = FLEX_BLOCK):
    """The document BlockMask of packed rows, built from the sequences' column ranges at block granularity.

    ``create_block_mask`` without compilation evaluates the mask function on the
    whole [R, 1, T, T] grid every forward; here each row's sequence ids are
    non-decreasing (the tail, -1, is mapped past the last sequence), so a query
    block and a key block meet iff their id ranges overlap, and the pair is
    "full" (no per-element mask needed) iff both blocks lie in one sequence:
    O(R x (T / block)^2) work. The per-element mask function is the same
    same-sequence test for the partial blocks.
    """
    from torch.nn.attention.flex_attention import BlockMask

    R, T = packed.shape
    ids = torch.where(packed < 0, torch.full_like(packed, T + 1), packed)  # the tail: past every sequence
    nb = -(-T // block)
    pad = nb * block - T
    lo_ids = torch.nn.functional.pad(ids, (0, pad), value=T + 2) if pad else ids
    hi_ids = torch.nn.functional.pad(ids, (0, pad), value=-1) if pad else ids
    lo = lo_ids.view(R, nb, block).amin(-1)  # [R, nb] smallest id of each block (real columns only)
    hi = hi_ids.view(R, nb, block).amax(-1)
    meet = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])  # [R, q block, kv block]
    whole = torch.ones(nb, dtype=torch.bool, device=packed.device)
    if pad:
        whole[-1] = False  # a block past the row's end is never "full"
    single = (lo == hi) & whole
    full = meet & single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    partial = meet & ~full

    def blocks(m):
        num = m.sum(-1, dtype=torch.int32)[:, None]  # [R, 1, nb]
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]  # listed first
        return num, idx

    def same_sequence(b, h, q, kv):
        return packed[b, q] == packed[b, kv]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=same_sequence,
                                    seq_lengths=(T, T))


def packed_attention(packed: torch.Tensor, impl: str, dtype: torch.dtype) -> tuple[Any, dict]:
    """The block-diagonal bidirectional mask of packed rows, in the form ``impl`` takes; plus extra call kwargs.

    ``packed`` [B, T] gives each position's sequence index within its row (an
    unused tail is one more "sequence", -1, that attends only to itself, so no
    query row is fully masked). A token attends to every token of its own
    sequence and to nothing else:

    * ``flash_attention_*``: no mask; the sequence boundaries go to the
      variable-length kernel explicitly (:func:`packed_varlen_kwargs`), told
      ``is_causal=False``. (transformers 5.23 infers them from restarting
      position ids only when the batch has one row; with R >= 2 packed rows it
      would call the dense kernel, and every sequence would see its row-mates.)
    * ``flex_attention``: a BlockMask built from the sequence offsets (:func:`flex_block_mask`);
    * ``sdpa``: a [B, 1, T, T] boolean mask; ``eager``: the same as an additive float mask.
    """
    if impl.startswith("flash") or "flash" in impl:
        return None, {"is_causal": False, **packed_varlen_kwargs(packed)}
    if impl == "flex_attention":
        return flex_block_mask(packed), {}
    same = packed[:, None, :, None] == packed[:, None, None, :]  # [B, 1, T, T]
    if impl == "sdpa":
        return same, {}
    return torch.zeros(same.shape, dtype=dtype, device=packed.device).masked_fill_(~same, torch.finfo(dtype).min), {}


# --------------------------------------------------------------------------- chunked head
class _ChunkedTargetLogprob(torch.autograd.Function):
    """log softmax(h W^T)[target] without materialising [N, V] logits for the whole batch.

    Forward and backward walk over row chunks; the backward recomputes each
    chunk's logits (the fused linear + cross-entropy trick), so peak memory is
    one [chunk, V] block instead of N x V (N = masked positions, up to K * L).

    Speed: the [chunk, V] block is allocated once per call and every pass over
    it is in place (on the CPU a fresh 65 MB block per chunk costs as much as
    the matmul: it is page-faulted in each time). The backward never scales or
    scatters into the block: with d_i = g_i (onehot(t_i) - p_i),
    grad_h = g * W[t] - g * (P W) and grad_W = P^T (-g * h) + index_add(t, g * h),
    so the block sees one matmul, one subtract-and-exp, and two matmuls.
    """

    @staticmethod
    def _logits(hc, weight, buf, cd=None):
        """hc W^T into ``buf`` (fp32), without a temporary when the inputs are fp32 already.

        ``cd`` (the autocast dtype) rounds both operands and the product to it, as an
        autocast Linear does; ``weight`` is then already in ``cd`` (cast once per call).
        """
        if cd is not None:
            return buf.copy_(hc.to(cd) @ weight.t())
        if hc.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.mm(hc, weight.t(), out=buf)
        return buf.copy_(hc @ weight.t())

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, cd=None):
        N = h.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=h.device)
        lse = torch.empty(N, dtype=torch.float32, device=h.device)
        block = torch.empty(min(chunk, N), weight.shape[0], dtype=torch.float32, device=h.device)
        wc = weight.to(cd) if cd is not None else weight
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            logits = _ChunkedTargetLogprob._logits(h[s:e], wc, block[: e - s], cd)
            picked = logits.gather(-1, targets[s:e, None]).squeeze(-1)
            m = logits.amax(dim=-1, keepdim=True)
            # logsumexp in place: the block is scratch once the target logits are picked
            lse[s:e] = m.squeeze(-1) + logits.sub_(m).exp_().sum(dim=-1).log()
            out[s:e] = picked - lse[s:e]
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk = chunk
        ctx.cd = cd
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        chunk = ctx.chunk
        N = h.shape[0]
        block = torch.empty(min(chunk, N), weight.shape[0], dtype=torch.float32, device=h.device)
        cd = ctx.cd
        wc = weight.to(cd) if cd is not None else weight
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            hc, t = h[s:e], targets[s:e]
            g = grad_out[s:e].float()[:, None]
            # the forward's softmax (same rounding of the logits); the gradient itself is taken in fp32
            p = _ChunkedTargetLogprob._logits(hc, wc, block[: e - s], cd)
            p.sub_(lse[s:e, None]).exp_()  # softmax rows
            if need_h:
                pw = p @ weight.float() if weight.dtype == torch.float32 else (p.to(weight.dtype) @ weight).float()
                grad_h[s:e] = (g * (weight[t].float() - pw)).to(h.dtype)
            if need_w:
                gh = g * hc.float()
                grad_w.addmm_(p.t(), gh, alpha=-1.0)
                grad_w.index_add_(0, t, gh)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def chunked_target_logprobs(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 128, compute_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """fp32 log p(targets) for hidden states ``h`` [N, H] and head ``weight`` [V, H].

    ``compute_dtype`` (bf16 under autocast) is the dtype the logits matmul runs in;
    the log-softmax is always taken in fp32.
    """
    if h.shape[0] == 0:
        return h.new_zeros(0, dtype=torch.float32) + 0 * weight.sum()
    return _ChunkedTargetLogprob.apply(h, weight, targets, chunk, compute_dtype)

