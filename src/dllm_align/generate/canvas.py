"""What every decoding rule shares: the canvas (prompts left-padded, then masks), the stop tokens, and a
row's result rendered as the family's published code renders it."""

from __future__ import annotations

from typing import Sequence

import torch

from dllm_align.generate.settings import Completion, SamplerStats


def pad_id(mp) -> int:
    tok = mp.tokenizer
    pid = getattr(tok, "pad_token_id", None) if tok is not None else None
    if pid is None:
        pid = mp.stop_token_ids[0] if mp.stop_token_ids else 0
    return int(pid)


def first_stop(gen: torch.Tensor, stops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether a stop token is present and the index of the first one."""
    is_stop = torch.isin(gen, stops)
    has = is_stop.any(dim=1)
    first = torch.where(has, is_stop.int().argmax(dim=1), torch.full_like(has, gen.shape[1], dtype=torch.long))
    return has, first


def canvas(mp, prompts: Sequence[Sequence[int]], gen_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded, each followed by ``gen_length`` masks; and the attention mask (on the model's device)."""
    P = max(len(p) for p in prompts)
    x = torch.full((len(prompts), P + gen_length), pad_id(mp), dtype=torch.long)
    attn = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, P - len(p) :] = 1
    x[:, P:] = mp.mask_token_id
    return x.to(mp.device), attn.to(mp.device)


def completion(mp, gen: torch.Tensor, stops: torch.Tensor, forwards: int, stats: "SamplerStats") -> Completion:
    """One row's result from its generated span: the text before the first stop token, rendered as the
    family's published code renders it."""
    raw = gen.tolist()
    has, first = first_stop(gen[None], stops)
    ids = raw[: int(first[0])]
    keep = getattr(getattr(mp, "family", None), "decode_keeps_special", False)
    text = mp.tokenizer.decode(ids, skip_special_tokens=not keep) if mp.tokenizer is not None else ""
    stats.decoded += sum(1 for t in raw if t != mp.mask_token_id)
    return Completion(ids=ids, text=text, raw=raw, stopped=bool(has[0]), forwards=forwards)
