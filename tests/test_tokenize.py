"""Tokenisation: chat template + completion + end-of-turn, the completion mask, truncation rules."""

from __future__ import annotations

import pytest

from dllm_align.data.batching import collate
from dllm_align.data.rows import PairRow, Row
from dllm_align.models.load import build_tiny_tokenizer
from dllm_align.config.schema import DataSection
from dllm_align.data.tokenize import (
    end_of_turn_id,
    fit,
    pad_token_id,
    tokenize_pairs,
    tokenize_rows,
    tokenize_with_report,
)

USER = [{"role": "user", "content": "Sort 3 1 2."}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def row(completion: str, prompt=USER, label=True, id="r1") -> Row:
    return Row(id, prompt, completion, label, None)


def test_layout_and_completion_mask_cover_exactly_the_completion(tok):
    (ex,) = tokenize_rows([row("  1 2 3  ")], tok, DataSection())
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_id(tok) == eot == 260
    # prompt = the chat template with the generation prompt, tokenised
    text = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ex.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    # completion = stripped text (the template trims every message) + end of turn
    assert ex.completion_ids == tok("1 2 3", add_special_tokens=False)["input_ids"] + [eot]
    assert tok.decode(ex.completion_ids) == "1 2 3<|eot_id|>"
    assert len(ex.completion_ids) == len("1 2 3") + 1
    for padding in ("paper", "none"):
        b = collate([ex], padding, 256, pad_token_id(tok))
        m = b["completion_mask"][0]
        assert int(m.sum()) == len(ex.completion_ids) == int(b["completion_len"][0])
        assert b["input_ids"][0][m].tolist() == ex.completion_ids
        # masked positions are exactly [len(prompt), len(prompt) + len(completion))
        idx = m.nonzero().flatten().tolist()
        assert idx == list(range(len(ex.prompt_ids), ex.length))


def test_end_of_turn_none_scores_only_the_completion(tok):
    """data.end_of_turn: none (the paper's code): no end-of-turn token, so nothing but the reply is masked or scored."""
    rows = [row("1 2 3"), row("3 2 1", label=False, id="r2")]
    scored = tokenize_rows(rows, tok, DataSection())
    plain = tokenize_rows(rows, tok, DataSection(end_of_turn="none"))
    for a, b in zip(scored, plain):
        assert a.prompt_ids == b.prompt_ids
        assert b.completion_ids == a.completion_ids[:-1] == tok("1 2 3" if b.label else "3 2 1", add_special_tokens=False)["input_ids"]
        assert end_of_turn_id(tok) not in b.completion_ids
    (pc, pr), = tokenize_pairs([PairRow("p", USER, "1 2 3", "3 2 1")], tok, DataSection(end_of_turn="none"))
    assert pc.completion_ids == plain[0].completion_ids and pr.completion_ids == plain[1].completion_ids


def test_special_token_text_inside_a_completion_stays_text(tok):
    (ex,) = tokenize_rows([row("say <|eot_id|> twice")], tok, DataSection())
    eot = end_of_turn_id(tok)
    assert ex.completion_ids.count(eot) == 1 and ex.completion_ids[-1] == eot
    assert tok.decode(ex.completion_ids[:-1]) == "say <|eot_id|> twice"


def test_end_of_turn_found_from_template_or_eos():
    t = build_tiny_tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert end_of_turn_id(t) == t.convert_tokens_to_ids("<|im_end|>")
    (ex,) = tokenize_rows([row("ok")], t, DataSection())
    assert t.decode(ex.completion_ids) == "ok<|im_end|>"
    plain = build_tiny_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(plain) == plain.eos_token_id


def test_no_chat_template_is_a_user_error():
    from dllm_align.core.errors import UserError

    t = build_tiny_tokenizer()
    t.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        tokenize_rows([row("x")], t, DataSection())


# --------------------------------------------------------------------------- truncation
BOS = 100


def test_fit_rules_by_hand():
    p = [BOS, 1, 2, 3, 4, 5]  # 6 prompt tokens
    c = [10, 11, 12, 13, 99]  # 5 completion tokens, 99 = end of turn
    # fits: untouched
    assert fit(p, [c], 11, None, "completion", BOS) == (p, [c], False, [False])
    # completion rule: the tail goes, end-of-turn with it
    assert fit(p, [c], 9, None, "completion", BOS) == (p, [[10, 11, 12]], False, [True])
    # prompt alone fills max_length: cannot keep the row
    assert fit(p, [c], 6, None, "completion", BOS) is None
    # prompt_left: the prompt's head goes, BOS stays
    assert fit(p, [c], 9, None, "prompt_left", BOS) == ([BOS, 3, 4, 5], [c], True, [False])
    # prompt_left with a completion longer than the room: BOS + last prompt token, completion tail cut
    assert fit(p, [c], 4, None, "prompt_left", BOS) == ([BOS, 5], [[10, 11]], True, [True])
    # max_prompt_length first, keeping BOS
    assert fit(p, [c], 100, 3, "completion", BOS) == ([BOS, 4, 5], [c], True, [False])
    # no BOS: the plain last tokens
    assert fit([1, 2, 3, 4], [[7, 8]], 4, None, "prompt_left", None) == ([3, 4], [[7, 8]], True, [False])
    # pairs share one prompt cut, sized for the longer completion
    got = fit(p, [c, [20, 99]], 9, None, "prompt_left", BOS)
    assert got == ([BOS, 3, 4, 5], [c, [20, 99]], True, [False, False])


def test_truncation_on_real_rows(tok):
    long = "word " * 200
    rows = [row(long.strip(), id="long"), row("short", id="short")]
    sec = DataSection(max_length=64, truncation="completion")
    exs, rep = tokenize_with_report(rows, tok, sec)
    assert [e.length for e in exs][0] == 64 and exs[0].completion_ids[-1] != end_of_turn_id(tok)
    assert exs[1].completion_ids[-1] == end_of_turn_id(tok)
    assert rep.completion_cut == 1 and rep.prompt_cut == 0 and not rep.dropped
    # a prompt longer than max_length: dropped with the completion rule (and said so), cut with prompt_left
    big_prompt = [{"role": "user", "content": "x" * 100}]
    rows = [row("ok", prompt=big_prompt, id="big"), row("ok", id="small")]
    exs, rep = tokenize_with_report(rows, tok, sec)
    assert [e.id for e in exs] == ["small"] and rep.dropped == ["big"]
    exs, rep = tokenize_with_report(rows, tok, DataSection(max_length=64, truncation="prompt_left"))
    assert [e.id for e in exs] == ["big", "small"]
    assert exs[0].length == 64 and exs[0].prompt_ids[0] == tok.bos_token_id
    assert tok.decode(exs[0].completion_ids) == "ok<|eot_id|>"
    assert tok.decode(exs[0].prompt_ids).endswith("x<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # max_prompt_length
    exs, _ = tokenize_with_report(rows, tok, DataSection(max_length=4096, max_prompt_length=40))
    assert len(exs[0].prompt_ids) == 40 and exs[0].prompt_ids[0] == tok.bos_token_id


def test_dropped_rows_are_reported(tok, capsys):
    rows = [row("ok", prompt=[{"role": "user", "content": "x" * 100}], id="big"), row("ok", id="small")]
    tokenize_rows(rows, tok, DataSection(max_length=64), quiet=True)
    assert "dropped 1 rows whose prompt alone fills max_length 64 (big)" in capsys.readouterr().err


def test_labels_ids_and_pairs(tok):
    rows = [Row("a:chosen", USER, "1 2 3", True, "a"), Row("a:rejected", USER, "3 2 1", False, "a")]
    exs = tokenize_rows(rows, tok, DataSection())
    assert [(e.id, e.label, e.pair_id) for e in exs] == [("a:chosen", True, "a"), ("a:rejected", False, "a")]
    ((c, r),) = tokenize_pairs([PairRow("a", USER, "1 2 3", "3 2 1")], tok, DataSection())
    assert (c, r) == tuple(exs)
    # prompt_left with pairs: one shared prompt, cut for the longer completion
    long_prompt = [{"role": "user", "content": "y" * 80}]
    ((c, r),) = tokenize_pairs([PairRow("b", long_prompt, "z" * 20, "w")], tok, DataSection(max_length=64, truncation="prompt_left"))
    assert c.prompt_ids == r.prompt_ids and c.length == 64 and r.length < 64


# --------------------------------------------------------------------------- block-diffusion layout
@pytest.fixture(scope="module")
def sdar_tok():
    from pathlib import Path

    from transformers import AutoTokenizer

    import dllm_align

    return AutoTokenizer.from_pretrained(Path(dllm_align.__file__).parent / "assets" / "toy_sort_base_sdar")


def published_sdar_layout(tokenizer, messages, reply, block):
    """SDAR's LlamaFactory training layout, rebuilt independently: the whole conversation rendered by the
    template (reply and its `<|im_end|>\\n`), labels -100 on the generation prompt, then the pad token,
    scored, until the sample is a whole number of blocks."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": reply}], tokenize=False)
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    labels = [-100] * n_prompt + ids[n_prompt:]
    pad = (block - len(ids) % block) % block
    return ids + [tokenizer.pad_token_id] * pad, labels + [tokenizer.pad_token_id] * pad


def test_end_of_turn_tail_is_the_templates_whole_tail(sdar_tok, tok):
    from dllm_align.data.tokenize import end_of_turn_tail

    assert end_of_turn_tail(sdar_tok) == [sdar_tok.convert_tokens_to_ids("<|im_end|>"), sdar_tok("\n")["input_ids"][0]]
    assert end_of_turn_tail(tok) == [end_of_turn_id(tok)]  # LLaDA's template: nothing after <|eot_id|>


@pytest.mark.parametrize("reply", ["1 2 3", "1 2 3 4 5 6 7", "9", "3 1 2 0"])
def test_block_layout_equals_sdars_published_training_layout(sdar_tok, reply):
    """Prompt + completion is exactly SDAR's training sample, and the scored positions (completion_mask) are
    exactly its non -100 labels: the reply, `<|im_end|>\\n` and the filler."""
    from dllm_align.data.tokenize import block_layout

    layout = block_layout(sdar_tok, 4)
    assert layout.filler == sdar_tok.convert_tokens_to_ids("<|endoftext|>")
    (ex,) = tokenize_rows([row(reply)], sdar_tok, DataSection(max_length=200), block=layout)
    ids, labels = published_sdar_layout(sdar_tok, USER, reply, 4)
    assert ex.prompt_ids + ex.completion_ids == ids
    assert ex.length % 4 == 0
    b = collate([ex], padding="none", max_length=200, pad_id=layout.filler)
    scored = [i for i, m in enumerate(b["completion_mask"][0].tolist()) if m]
    assert scored == [i for i, lab in enumerate(labels) if lab != -100]
    (plain,) = tokenize_rows([row(reply)], sdar_tok, DataSection(max_length=200, end_of_turn="none"))
    assert plain.completion_ids == ex.completion_ids[:len(plain.completion_ids)]  # completion_only: the reply alone


def test_block_layout_cut_reply_loses_its_tail_but_fills_and_fits(sdar_tok):
    from dllm_align.data.tokenize import block_layout

    layout = block_layout(sdar_tok, 4)
    (full,) = tokenize_rows([row("1 2 3 4 5 6 7 8 9")], sdar_tok, DataSection(max_length=400), block=layout)
    room = len(full.prompt_ids) + 6  # not a whole number of blocks
    (ex,) = tokenize_rows([row("1 2 3 4 5 6 7 8 9")], sdar_tok, DataSection(max_length=room), block=layout)
    assert ex.length <= room and ex.length % 4 == 0
    assert sdar_tok.convert_tokens_to_ids("<|im_end|>") not in ex.completion_ids
    (pc, pr), = tokenize_pairs([PairRow("p", USER, "1 2 3", "3 2 1 0 9")], sdar_tok, DataSection(max_length=200),
                               block=layout)
    assert pc.length % 4 == 0 and pr.length % 4 == 0 and pc.prompt_ids == pr.prompt_ids
