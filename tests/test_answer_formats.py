"""Every bundled recipe that labels with a verifier states, in its prompts, the answer format that verifier reads:
math_answer's sentence appended to each prompt and read back by the verifier in each format, and the toy task's
`sort: DIGITS`, whose digit string is the shape the sort rule reads (docs/online.md, "Answer formats")."""

from __future__ import annotations

import json

import pytest

from dllm_align.config.recipe import bundled_dir, bundled_names, load_recipe
from dllm_align.data import toy
from dllm_align.online.components import ANSWER_FORMATS
from dllm_align.online.label import read_prompts, with_instruction
from dllm_align.online.math_answer import INSTRUCTIONS, instruction
from dllm_align.online.verifiers import apply, get_rule
from reliability import run_cli

# The recipes that label with a verifier: those with an online section, and `demo`, which the first command of
# docs/online.md runs with --rule sort.
VERIFIER_RECIPES = sorted({n for n in bundled_names() if load_recipe(n).online is not None} | {"demo"})

# A completion that does what each format's sentence asks, and one that gives the same answer without the format.
FOLLOWS = {
    "hashes": "2 + 2 = 4 apples.\n#### 4",
    "boxed": "2 + 2 = 4 apples, so the answer is \\boxed{4}.",
    "json": 'Two and two apples make four.\n{"answer": 4}',
    "answer_tag": "Two and two apples make four. <answer>4</answer>",
}
IGNORES_FORMAT = "Two and two apples make four, so the answer is 4."


def _rule_of(name: str):
    recipe = load_recipe(name)
    spec = recipe.online.rule if recipe.online is not None else "sort"
    return recipe, get_rule(spec, recipe=recipe)


def test_the_bundled_verifier_recipes_are_the_ones_expected():
    # a new recipe with an online section is picked up by the tests below; this says which ones they cover now
    assert {"demo", "demo_online", "online_gsm8k"} <= set(VERIFIER_RECIPES)
    assert all(_rule_of(n)[1].name in ("sort", "math_answer") for n in VERIFIER_RECIPES)


@pytest.mark.parametrize("name", VERIFIER_RECIPES)
def test_each_bundled_verifier_recipe_states_the_format_its_verifier_reads(name):
    recipe, rule = _rule_of(name)
    if rule.name == "math_answer":
        fmt = recipe.online.math_answer.format
        assert rule.instruction == instruction(fmt, recipe.online.math_answer.field) and rule.instruction
        row = {"id": "q1", "question": "Ann has 2 apples and buys 2 more. How many does she have?", "answer": "#### 4"}
        assert FOLLOWS[fmt] and apply(rule, row["question"], FOLLOWS[fmt], row, "q1").verdict == "desirable"
        assert apply(rule, row["question"], IGNORES_FORMAT, row, "q1").verdict != "desirable"  # read there only
        return
    assert rule.name == "sort"
    # No sentence: the toy base model only ever saw `sort: DIGITS` and answers nothing to one (docs/online.md).
    # What the prompt states is the answer's shape, one string of the prompt's digits; the rule reads that shape.
    assert rule.instruction is None
    prompts = read_prompts(str(recipe.data.train), "train", 50)
    for p in prompts:
        text = p.messages[-1]["content"]
        digits = toy.digits_of(text)
        assert text == toy.prompt_text(digits) and digits.isdigit()
        assert apply(rule, text, toy.desirable(digits), p.row, p.where).verdict == "desirable"
        for other in (" ".join(toy.desirable(digits)), toy.desirable(digits) + ".", f"[{toy.desirable(digits)}]"):
            assert apply(rule, text, other, p.row, p.where).reason == "malformed"  # another shape is not read
    if recipe.online is not None:  # the choice is the recipe's, written down in it
        assert "no sentence is appended" in (bundled_dir() / f"{name}.yaml").read_text().lower()


@pytest.mark.parametrize("fmt", ANSWER_FORMATS)
def test_each_formats_sentence_asks_for_what_math_answer_reads(fmt, tmp_path):
    """A completion written as the sentence asks is read; the same answer elsewhere is not."""
    said = instruction(fmt)
    assert said == (INSTRUCTIONS[fmt].format(field="answer") if fmt == "json" else INSTRUCTIONS[fmt])
    marker = {"hashes": "####", "boxed": "\\boxed{}", "json": '{"answer": <number>}', "answer_tag": "<answer>"}[fmt]
    assert marker in said
    recipe = load_recipe("online_gsm8k")
    recipe.online.math_answer.format = fmt
    rule = get_rule("math_answer", recipe=recipe)
    row = {"answer": "#### 4"}
    assert apply(rule, "q", FOLLOWS[fmt], row, "q").verdict == "desirable"
    assert apply(rule, "q", FOLLOWS[fmt].replace("4", "5"), row, "q").verdict == "undesirable"
    assert apply(rule, "q", IGNORES_FORMAT, row, "q").reason == "none"


def test_online_gsm8k_prompts_carry_its_format_sentence_as_label_samples_them(tmp_path, monkeypatch):
    """The GSM8K recipe's rows as `datasets` writes them: the question, then the hashes sentence, is what is sampled
    and stored; the run records the sentence."""
    from dllm_align.generate.settings import Completion
    from dllm_align.online import label as label_mod

    seen = []

    def fake_sample(gen, prompts, settings, seeds, batch_size, rank, world):
        seen.extend(gen.tokenizer.decode(p) for p in prompts)
        return [Completion(ids=[], text="2 + 2 = 4\n#### 4", raw=[], stopped=True, forwards=0) for _ in prompts]

    monkeypatch.setattr(label_mod, "_sample", fake_sample)
    src = tmp_path / "gsm8k_train.jsonl"
    src.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n")
    r = run_cli(["label", "online_gsm8k", "-o", tmp_path / "lab", "--model", "builtin:toy-sort-base", "--prompts", src,
                 "--n", "2", "--set", "generate.gen_length=16", "--set", "generate.block_length=16",
                 "--set", "generate.steps=16"])
    assert r.code == 0, r.err
    said = instruction("hashes")
    rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text().splitlines()]
    assert [x["prompt"][-1]["content"] for x in rows] == ["What is 2 + 2?\n\n" + said] * 2
    assert [x["verdict"] for x in rows] == ["desirable"] * 2 and all(said in s for s in seen)
    assert json.loads((tmp_path / "lab" / "label_summary.json").read_text())["settings"]["instruction"] == said
