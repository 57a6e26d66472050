"""Rows -> token ids: chat template on the prompt, the completion, the end-of-turn token.

docs/design.md#tokens-padding-and-packing. For a row (prompt messages x,
completion text y):

    prompt_ids     = tokens of chat_template(x, add_generation_prompt=True)
    completion_ids = tokens of y.strip() + [end-of-turn]   (data.end_of_turn: scored)
    completion_ids = tokens of y.strip()                   (data.end_of_turn: none, the paper's code)

The completion is stripped because chat templates (LLaDA's included) trim every
message they render, so this is the text the model sees as an assistant turn.
Special-token strings inside the completion text stay plain text
(``split_special_tokens``): a reply that quotes ``<|eot_id|>`` must not end the turn.
The end-of-turn token is read off the tokenizer's own chat template (the first
special token after an assistant reply: ``<|eot_id|>`` for LLaDA, id 126348, and
for the built-in tiny tokenizer), falling back to EOS. Appended, it is masked and
scored like any completion token, which teaches the model to stop; the paper's
code scores only the completion's own tokens (followed by its visible, unscored
EOS padding), so the paper recipes set ``end_of_turn: none``.

Only completion positions are ever masked or scored (the prompt is always
visible); :mod:`dllm_align.data.batching` builds that ``completion_mask``.

Truncation (recorded in the recipe: ``data.max_length``,
``data.max_prompt_length``, ``data.truncation``), applied in this order:

1. ``max_prompt_length``: a longer prompt loses its head (the leading BOS, if
   any, is kept), so the latest turns and the generation prompt survive.
2. If prompt + completion still exceed ``max_length``:
   * ``truncation: completion`` - the completion's tail is cut (the end-of-turn
     token goes with it: a cut reply must not be scored as finished). A row whose
     prompt alone fills ``max_length`` cannot be kept; it is dropped and reported.
   * ``truncation: prompt_left`` - the prompt's head is cut (BOS kept, and at
     least its last token); if the completion alone is still too long, its
     tail is cut too.

Rows of a pair (:func:`tokenize_pairs`) share one prompt cut: with
``prompt_left`` it is sized for the longer of the two completions.

Block-diffusion layout (a :class:`BlockLayout` passed to the tokenisers): the layout the published
block trainers score (SDAR's LlamaFactory fork, dllm's BD3LM trainer; docs/block_diffusion.md) and the
block sampler produces. The completion is the reply, then the chat template's whole end-of-turn tail
(``<|im_end|>`` and the newline after it for Qwen's template), then filler tokens until prompt +
completion is a whole number of blocks (blocks counted from the sequence start); every one of those
positions is masked and scored. ``max_length`` is taken down to a whole number of blocks so the filled
row still fits; a cut reply loses its tail (it must not be scored as finished) but is still filled.

Canvas layout (a :class:`BlockLayout` with ``canvas`` set, :func:`canvas_layout`): the layout DiffusionGemma's
published training scores (TRL's DiffusionGemma example and the reference fine-tune's canvas chunker;
docs/diffusion_gemma.md#the-last-canvas) and its sampler decodes. Canvases start at the completion (the prompt is
the encoder's clean context, not a canvas), and the completion is the reply, the template's end-of-turn tail
(``<turn|>`` and its newline), then EOS until the last canvas is full; every one of those positions is noised and
scored. The filler never takes a row past ``max_length`` (which is not rounded), and a cut reply is neither given
its tail nor filled: it has no real end to fill after, so its last canvas is left partial.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from dllm_align.core import console
from dllm_align.core.errors import UserError

_PROBE_REPLY = "zq"  # a reply that no template touches, to find what follows it


@dataclass(frozen=True)
class Example:
    """A tokenised example (CONTRIBUTING.md, shared data structures)."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    label: Optional[bool]
    pair_id: Optional[str] = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class TokenizeReport:
    """What tokenisation did to the rows (for logs and ``data stats``)."""

    rows: int = 0
    kept: int = 0
    completion_cut: int = 0
    prompt_cut: int = 0
    dropped: list[str] = field(default_factory=list)  # ids whose prompt alone fills max_length

    def lines(self, max_length: int) -> list[str]:
        out = []
        if self.prompt_cut:
            out.append(f"{self.prompt_cut:,} of {self.rows:,} prompts lost their head to fit")
        if self.completion_cut:
            out.append(f"{self.completion_cut:,} of {self.rows:,} completions lost their tail to fit max_length {max_length}")
        return out


# --------------------------------------------------------------------------- tokenizer facts
def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' has no chat template",
            hint="use an instruct model's tokenizer (model.tokenizer in the recipe)",
        )
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as e:  # jinja errors: a template that rejects a role order, ...
        raise UserError(f"the chat template failed on a prompt ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


def _encode(tokenizer, texts: list[str], plain: bool) -> list[list[int]]:
    if not texts:
        return []
    kw = {"split_special_tokens": True} if plain else {}
    return tokenizer(texts, add_special_tokens=False, **kw)["input_ids"]


def _reply_tail(tokenizer) -> Optional[str]:
    """The text the chat template renders after an assistant reply (found with a probe reply), or None when the
    tokenizer has no template or the template's output cannot be split around the reply."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    user = [{"role": "user", "content": "hi"}]
    try:
        head = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": _PROBE_REPLY}], add_generation_prompt=False, tokenize=False
        )
    except Exception:
        return None
    if not (full.startswith(head) and _PROBE_REPLY in full[len(head):]):
        return None
    return full[len(head):].split(_PROBE_REPLY, 1)[1]


def end_of_turn_id(tokenizer) -> int:
    """The token that closes an assistant turn in this tokenizer's chat template, else EOS."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            special.add(i)
    tail_checked = False  # the template ends a reply with no special token: EOS it is
    tail = _reply_tail(tokenizer)
    if tail is not None:
        for i in _encode(tokenizer, [tail], plain=False)[0]:
            if i in special:
                return int(i)
        tail_checked = True
    for name in () if tail_checked else ("<|eot_id|>", "<|im_end|>", "<|role_end|>", "<end_of_turn>", "<|end|>"):
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and i >= 0 and i != getattr(tokenizer, "unk_token_id", None) and i in special:
            return i
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has neither an end-of-turn token nor an EOS token")
    return int(tokenizer.eos_token_id)


def end_of_turn_tail(tokenizer) -> list[int]:
    """Every token the chat template renders after an assistant reply, up to and including the first special
    token and the whitespace-only tokens right after it (``<|im_end|>``, ``\\n`` for Qwen's template): what a
    rendered reply ends with, and what SDAR's training scores after it. Falls back to :func:`end_of_turn_id`."""
    eot = end_of_turn_id(tokenizer)
    tail = _reply_tail(tokenizer)
    if tail is None:
        return [eot]
    ids = _encode(tokenizer, [tail], plain=False)[0]
    if eot not in ids:
        return [eot]
    end = ids.index(eot) + 1
    while end < len(ids) and not tokenizer.decode([ids[end]]).strip():
        end += 1
    return [int(i) for i in ids[:end]]


@dataclass(frozen=True)
class BlockLayout:
    """The published block-diffusion layout (module docstring): block size, end-of-turn tail, filler id.
    ``canvas``: blocks count from the completion's start, not the sequence's (DiffusionGemma's canvases), and the
    filler stops at ``max_length``."""

    size: int
    tail: tuple[int, ...]
    filler: int
    canvas: bool = False

    def fill(self, prompt_len: int, completion: list[int], max_length: Optional[int] = None) -> list[int]:
        """``completion`` followed by filler up to the next block boundary of prompt + completion (of the completion
        alone for canvases, and then no further than ``max_length``)."""
        if not self.canvas:
            return completion + [self.filler] * (-(prompt_len + len(completion)) % self.size)
        n = -len(completion) % self.size
        if max_length is not None:
            n = max(0, min(n, max_length - prompt_len - len(completion)))
        return completion + [self.filler] * n

    def room(self, max_length: int) -> int:
        """``max_length`` taken down to whole blocks (a filled row never exceeds it); canvases keep it whole, their
        filler stopping at it instead."""
        return max_length if self.canvas else max_length - max_length % self.size


def block_layout(tokenizer, block_size: int) -> BlockLayout:
    """The published layout for a block model of ``block_size``: the template's end-of-turn tail, filled with the
    pad token (SDAR's ``<|endoftext|>``, as its LlamaFactory fork pads; LLaDA2.0's pad, as dFactory pads)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return BlockLayout(int(block_size), tuple(end_of_turn_tail(tokenizer)), pad_token_id(tokenizer))


def canvas_layout(tokenizer, canvas_length: int) -> BlockLayout:
    """DiffusionGemma's published layout for canvases of ``canvas_length``: the template's end-of-turn tail, then
    EOS to the end of the last canvas (TRL's example fills with the tokenizer's EOS, as the reference fine-tune's
    canvas chunker does)."""
    if canvas_length < 1:
        raise ValueError(f"canvas_length must be >= 1, got {canvas_length}")
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token, which fills DiffusionGemma's last canvas",
                        hint="set data.block_scoring: completion_only, or use a tokenizer with an EOS token")
    return BlockLayout(int(canvas_length), tuple(end_of_turn_tail(tokenizer)), int(tokenizer.eos_token_id), canvas=True)


def pad_token_id(tokenizer) -> int:
    """The id used to pad: the tokenizer's pad token, else EOS (the paper pads with EOS)."""
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pid is None:
        raise UserError("the tokenizer has neither a pad token nor an EOS token")
    return int(pid)


# --------------------------------------------------------------------------- truncation
def _cut_head(ids: list[int], n: int, bos: Optional[int]) -> list[int]:
    """Keep the last ``n`` tokens, and the leading BOS if there was one (n >= 1)."""
    if len(ids) <= n:
        return ids
    if bos is not None and ids and ids[0] == bos and n >= 2:
        return [bos] + ids[len(ids) - (n - 1):]
    return ids[len(ids) - n:]


def fit(
    prompt: list[int],
    completions: Sequence[list[int]],
    max_length: int,
    max_prompt_length: Optional[int],
    truncation: str,
    bos: Optional[int] = None,
) -> Optional[tuple[list[int], list[list[int]], bool, list[bool]]]:
    """Apply the truncation rule (module docstring) to one prompt and its completion(s).

    Returns (prompt, completions, prompt_was_cut, [completion_was_cut]) or None
    when the row cannot be kept (``completion`` rule, prompt alone too long).
    """
    p = prompt
    if max_prompt_length is not None and len(p) > max_prompt_length:
        p = _cut_head(p, max_prompt_length, bos)
    longest = max(len(c) for c in completions)
    if len(p) + longest > max_length:
        if truncation == "completion":
            if len(p) >= max_length:
                return None
        elif truncation == "prompt_left":
            min_p = min(len(p), 2 if (bos is not None and p and p[0] == bos) else 1)
            p = _cut_head(p, max(max_length - longest, min_p), bos)
        else:
            raise ValueError(f"unknown truncation rule {truncation!r}")
    room = max_length - len(p)
    cs = [c[:room] for c in completions]
    return p, cs, len(p) < len(prompt), [len(c) > room for c in completions]


# --------------------------------------------------------------------------- rows -> examples
def _prompt_key(messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def _prompt_ids(tokenizer, prompts: Iterable) -> dict[str, list[int]]:
    """Tokenise each distinct prompt once (rows of a pair or of one prompt share it)."""
    keys: dict[str, object] = {}
    for m in prompts:
        keys.setdefault(_prompt_key(m), m)
    texts = [_render(tokenizer, m, add_generation_prompt=True) for m in keys.values()]
    return dict(zip(keys, _encode(tokenizer, texts, plain=False)))


def _completion_ids(tokenizer, texts: list[str], tail: Sequence[int]) -> list[list[int]]:
    return [ids + list(tail) for ids in _encode(tokenizer, [t.strip() for t in texts], plain=True)]


def _tail(tokenizer, data_section, block: Optional[BlockLayout]) -> list[int]:
    if block is not None:
        return list(block.tail)
    eot = scored_end_of_turn(tokenizer, data_section)
    return [] if eot is None else [eot]


def _cut_tail(completion: list[int], full_len: int, tail_len: int) -> list[int]:
    """A cut completion loses whatever survived of the end-of-turn tail (it must not be scored as finished)."""
    if len(completion) < full_len and tail_len:
        return completion[:max(0, min(len(completion), full_len - tail_len))]
    return completion


def _filled(block: BlockLayout, prompt_len: int, completion: list[int], full_len: int, tail_len: int, cut: bool,
            max_length: int) -> list[int]:
    """A fitted completion in ``block``'s layout: a cut one loses its tail, and is filled unless canvases (module
    docstring: a cut reply's last canvas is left partial)."""
    completion = _cut_tail(completion, full_len, tail_len)
    if block.canvas and cut:
        return completion
    return block.fill(prompt_len, completion, max_length)


def scored_end_of_turn(tokenizer, data_section) -> Optional[int]:
    """The end-of-turn id appended to completions, or None (``data.end_of_turn: none``, the paper's code)."""
    if getattr(data_section, "end_of_turn", "scored") == "none":
        return None
    return end_of_turn_id(tokenizer)


def tokenize_with_report(rows: Sequence, tokenizer, data_section,
                         block: Optional[BlockLayout] = None) -> tuple[list[Example], TokenizeReport]:
    """:func:`tokenize_rows` plus what truncation did."""
    tail = _tail(tokenizer, data_section, block)
    bos = tokenizer.bos_token_id
    max_len, max_p, rule = data_section.max_length, data_section.max_prompt_length, data_section.truncation
    if block is not None:
        max_len = block.room(max_len)
    prompts = _prompt_ids(tokenizer, (r.prompt for r in rows))
    completions = _completion_ids(tokenizer, [r.completion for r in rows], tail)
    rep = TokenizeReport(rows=len(rows))
    out = []
    for r, c in zip(rows, completions):
        fitted = fit(prompts[_prompt_key(r.prompt)], [c], max_len, max_p, rule, bos)
        if fitted is None:
            rep.dropped.append(r.id)
            continue
        p, (c2,), p_cut, (c_cut,) = fitted
        rep.prompt_cut += p_cut
        rep.completion_cut += c_cut
        if block is not None:
            c2 = _filled(block, len(p), c2, len(c), len(tail), c_cut, max_len)
        out.append(Example(r.id, p, c2, r.label, r.pair_id))
    rep.kept = len(out)
    return out, rep


def _log(rep: TokenizeReport, max_length: int, rows_word: str = "rows") -> None:
    for line in rep.lines(max_length):
        console.info(line)
    if rep.dropped:
        shown = ", ".join(rep.dropped[:5]) + (" ..." if len(rep.dropped) > 5 else "")
        console.warn(
            f"dropped {len(rep.dropped):,} {rows_word} whose prompt alone fills max_length {max_length} ({shown}); "
            "raise data.max_length, set data.max_prompt_length, or use data.truncation: prompt_left"
        )


def tokenize_rows(rows: Sequence, tokenizer, data_section, *, quiet: bool = False,
                  block: Optional[BlockLayout] = None) -> list[Example]:
    """Tokenise unpaired rows (:class:`dllm_align.data.rows.Row`) into :class:`Example` s.

    ``data_section`` is the recipe's ``data`` section (``max_length``,
    ``max_prompt_length``, ``truncation``). Truncations are reported on stderr;
    dropped rows always are. ``block``: the published block-diffusion layout (module docstring).
    """
    examples, rep = tokenize_with_report(rows, tokenizer, data_section, block)
    if quiet:
        if rep.dropped:
            _log(TokenizeReport(dropped=rep.dropped), data_section.max_length)
    else:
        _log(rep, data_section.max_length)
    if not examples:
        raise UserError(f"no rows fit in data.max_length {data_section.max_length}")
    return examples


def tokenize_pairs(pairs: Sequence, tokenizer, data_section, *, quiet: bool = False,
                   block: Optional[BlockLayout] = None) -> list[tuple[Example, Example]]:
    """Tokenise pairs (:class:`dllm_align.data.rows.PairRow`) for VRPO: (chosen, rejected) per pair.

    The examples are ``ID:chosen`` (label true) and ``ID:rejected`` (label false)
    with pair id ``ID``, the same ids :func:`dllm_align.data.rows.unpair` gives, so the
    masks (seeded by id) match between the paired and unpaired views. Both share
    the same (possibly cut) prompt. ``block``: the published block-diffusion layout (module docstring).
    """
    tail = _tail(tokenizer, data_section, block)
    bos = tokenizer.bos_token_id
    max_len, max_p, rule = data_section.max_length, data_section.max_prompt_length, data_section.truncation
    if block is not None:
        max_len = block.room(max_len)
    prompts = _prompt_ids(tokenizer, (p.prompt for p in pairs))
    chosen = _completion_ids(tokenizer, [p.chosen for p in pairs], tail)
    rejected = _completion_ids(tokenizer, [p.rejected for p in pairs], tail)
    rep = TokenizeReport(rows=len(pairs))
    out = []
    for pr, c, r in zip(pairs, chosen, rejected):
        fitted = fit(prompts[_prompt_key(pr.prompt)], [c, r], max_len, max_p, rule, bos)
        if fitted is None:
            rep.dropped.append(pr.id)
            continue
        p, (c2, r2), p_cut, cuts = fitted
        rep.prompt_cut += p_cut
        rep.completion_cut += any(cuts)
        if block is not None:
            c2 = _filled(block, len(p), c2, len(c), len(tail), cuts[0], max_len)
            r2 = _filled(block, len(p), r2, len(r), len(tail), cuts[1], max_len)
        out.append(
            (
                Example(f"{pr.id}:chosen", p, c2, True, pr.id),
                Example(f"{pr.id}:rejected", p, r2, False, pr.id),
            )
        )
    rep.kept = len(out)
    if quiet:
        if rep.dropped:
            _log(TokenizeReport(dropped=rep.dropped), max_len, "pairs")
    else:
        _log(rep, max_len, "pairs")
    if not out:
        raise UserError(f"no pairs fit in data.max_length {max_len}")
    return out
