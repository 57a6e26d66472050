"""`dllm-align label`: the labelled rows, their verdicts and provenance, reruns, and bad input (one Error line,
nothing written); math_answer's own rule is tested in test_math_answer.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm_align.data.toy import desirable, digits_of
from reliability import run_cli

FAST = ["--set", "generate.gen_length=16", "--set", "generate.block_length=16", "--set", "generate.steps=16"]


def _label(tmp_path: Path, *extra, out="lab"):
    return run_cli(["label", "demo", "-o", tmp_path / out, "--n", "2", "--limit", "6", *FAST, *extra])


def test_label_writes_rows_with_provenance_and_a_rerun_gives_the_same_rows(tmp_path):
    r = _label(tmp_path)
    assert r.code == 0, r.err
    rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and len({x["id"] for x in rows}) == 12
    for x in rows:  # the verifier's verdict, recomputed here
        assert x["label"] == (x["completion"].strip() == desirable(digits_of(x["prompt"][-1]["content"])))
        assert {"round", "model", "sampler", "labeller", "verdict", "prompt_id"} <= set(x)
        assert x["sampler"]["temperature"] == 1.0 and x["labeller"] == "sort"
    summary = json.loads(r.out)
    assert summary == json.loads((tmp_path / "lab" / "label_summary.json").read_text())
    assert summary["rows"] == 12 and summary["desirable"] == sum(x["label"] for x in rows)
    assert summary["prompts_all_desirable"] + summary["prompts_all_undesirable"] <= 6
    again = _label(tmp_path, out="lab2")
    assert again.code == 0 and (tmp_path / "lab2" / "labelled.jsonl").read_text() == (tmp_path / "lab" / "labelled.jsonl").read_text()
    # the rows are training data as they are: an unpaired file the data loader reads
    from dllm_align.data.load import load_unpaired

    assert len(load_unpaired(tmp_path / "lab" / "labelled.jsonl", quiet=True)) == 12


def _one_error(r) -> str:
    errors = [line for line in r.err.splitlines() if line.startswith("Error:")]
    assert r.code == 2 and len(errors) == 1 and "Traceback" not in r.err, r.err
    return errors[0]


def test_unknown_rule(tmp_path):
    assert "--rule nosuch: unknown verifier" in _one_error(_label(tmp_path, "--rule", "nosuch"))
    assert not (tmp_path / "lab").exists()


def test_a_rule_that_raises_on_one_row_names_it_and_writes_nothing(tmp_path, monkeypatch):
    (tmp_path / "myrules.py").write_text(
        "def picky(prompt, completion, row):\n"
        "    if row.get('id') == 'sort-train-00003':\n"
        "        raise ValueError('cannot read this one')\n"
        "    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _one_error(_label(tmp_path, "--rule", "myrules:picky"))
    assert "rule myrules:picky failed on" in err and "sort-train-00003" in err and "cannot read this one" in err
    assert not (tmp_path / "lab" / "labelled.jsonl").exists()


def test_unsure_rows_are_counted_kept_apart_and_never_trained_on(tmp_path, monkeypatch):
    """A verifier's None and ("unsure", reason) leave the row out of labelled.jsonl (what train reads), in
    unsure.jsonl with its reason, counted in the summary and said on stderr; a row past the time bound is
    unsure too (reason timeout) instead of stopping the run."""
    (tmp_path / "shy_rules.py").write_text(
        "import time\n"
        "def shy(prompt, completion, row):\n"
        "    k = int(row['id'].rsplit('-', 1)[1])\n"
        "    if k == 1:\n"
        "        return None\n"
        "    if k == 2:\n"
        "        return ('unsure', 'two answers')\n"
        "    if k == 3:\n"
        "        time.sleep(30)\n"
        "    return ('desirable', 'fine') if k % 2 else False\n"
        "def wrong(prompt, completion, row):\n"
        "    return ('maybe', 'no such verdict')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = run_cli(["label", "demo", "-o", tmp_path / "lab", "--n", "2", "--limit", "6", *FAST, "--rule", "shy_rules:shy"],
                env={"DLLM_ALIGN_RULE_TIMEOUT": "0.5"})
    assert r.code == 0, r.err
    lab = tmp_path / "lab"
    rows = [json.loads(x) for x in (lab / "labelled.jsonl").read_text().splitlines()]
    unsure = [json.loads(x) for x in (lab / "unsure.jsonl").read_text().splitlines()]
    summary = json.loads((lab / "label_summary.json").read_text())
    assert len(rows) == 6 and len(unsure) == 6 and all(isinstance(x["label"], bool) for x in rows)
    assert {x["prompt_id"] for x in unsure} == {"sort-train-00001", "sort-train-00002", "sort-train-00003"}
    assert all(x["verdict"] == "unsure" and x["label"] is None for x in unsure)
    assert sorted(x.get("reason") for x in unsure if x.get("reason")) == ["timeout", "timeout", "two answers", "two answers"]
    assert summary["unsure"] == 6 and summary["unsure_share"] == 0.5 and summary["rows"] == 6
    assert "6 of 12 samples unsure (50.0%)" in r.err
    bad = run_cli(["label", "demo", "-o", tmp_path / "bad", "--n", "1", "--limit", "2", *FAST, "--rule", "shy_rules:wrong"],
                  env={"DLLM_ALIGN_RULE_TIMEOUT": "0.5"})
    assert bad.code == 2 and "a verifier returns True, False, None (unsure) or (verdict, reason)" in bad.err


def test_label_on_a_thousand_samples_with_a_megabyte_loop_finishes_with_that_row_unsure(tmp_path, monkeypatch):
    """math_answer on 1,000 samples, one of them 1 MB of a model revising its answer over and over: the run
    finishes in the time bound, that row unsure (the rule is linear in the completion)."""
    from dllm_align.generate.settings import Completion
    from dllm_align.online import label as label_mod

    loop = "#### 12\nOn second thought, it is 13.\n"
    big = loop * (1_000_000 // len(loop))
    texts = {0: big}

    def fake_sample(gen, prompts, settings, seeds, batch_size, rank, world):
        out = []
        for k in range(len(prompts)):
            t = texts.get(k, f"Adding up gives {k % 7}.\n#### {k % 7}" if k % 3 else "I am not sure.")
            out.append(Completion(ids=[], text=t, raw=[], stopped=True, forwards=0))
        return out

    monkeypatch.setattr(label_mod, "_sample", fake_sample)
    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} mod 7?", "answer": f"#### {i % 7}"}) + "\n"
                           for i in range(250)))
    r = run_cli(["label", "demo", "-o", tmp_path / "lab", "--rule", "math_answer", "--prompts", src, "--n", "4", *FAST],
                env={"DLLM_ALIGN_RULE_TIMEOUT": "5"})
    assert r.code == 0, r.err
    lab = tmp_path / "lab"
    summary = json.loads((lab / "label_summary.json").read_text())
    unsure = [json.loads(x) for x in (lab / "unsure.jsonl").read_text().splitlines()]
    assert summary["rows"] + summary["unsure"] == 1000
    assert [x["id"] for x in unsure] == ["q0:s0"] and unsure[0]["reason"] == "revised" and len(unsure[0]["completion"]) > 999_000
    assert summary["reasons"]["none"] == sum(1 for k in range(1, 1000) if k % 3 == 0)


def test_math_answer_reads_the_recipes_format_and_states_it_in_the_prompt(tmp_path, monkeypatch):
    """online.math_answer.format picks where the answer is read and the sentence every prompt gets (recorded with
    the run); no_answer: unsure keeps an output without the format out of training; instruction '' adds none."""
    from dllm_align.generate.settings import Completion
    from dllm_align.online import label as label_mod
    from dllm_align.online.math_answer import instruction

    outs = ["So the total is \\boxed{4}.", "#### 4", "It is 4.", "\\boxed{4} or \\boxed{5}"]
    seen = []

    def fake_sample(gen, prompts, settings, seeds, batch_size, rank, world):
        seen.extend(gen.tokenizer.decode(p) for p in prompts)
        return [Completion(ids=[], text=outs[k % 4], raw=[], stopped=True, forwards=0) for k in range(len(prompts))]

    monkeypatch.setattr(label_mod, "_sample", fake_sample)
    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps({"id": "q1", "question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    args = ["label", "demo", "--rule", "math_answer", "--prompts", src, "--n", "4", *FAST]
    r = run_cli([*args, "-o", tmp_path / "boxed", "--set", "online.math_answer.format=boxed",
                 "--set", "online.math_answer.no_answer=unsure"])
    assert r.code == 0, r.err
    lab = tmp_path / "boxed"
    rows = [json.loads(x) for x in (lab / "labelled.jsonl").read_text().splitlines()]
    unsure = [json.loads(x) for x in (lab / "unsure.jsonl").read_text().splitlines()]
    said = instruction("boxed")
    assert rows[0]["prompt"][-1]["content"] == "What is 2 + 2?\n\n" + said and said in seen[0]
    assert [(x["completion"], x["verdict"]) for x in rows] == [(outs[0], "desirable")]
    assert sorted((x["completion"], x["reason"]) for x in unsure) == sorted(
        [(outs[1], "none"), (outs[2], "none"), (outs[3], "two_answers")])
    summary = json.loads((lab / "label_summary.json").read_text())
    assert summary["settings"]["instruction"] == said and summary["unsure"] == 3
    assert summary["settings"]["verifier_settings"]["format"] == "boxed"
    other = run_cli([*args, "-o", lab, "--set", "online.math_answer.format=answer_tag",
                     "--set", "online.math_answer.no_answer=unsure", "--set", f"online.math_answer.instruction={said}"])
    assert other.code == 2 and "verifier_settings.format" in other.err  # the same sentence, another format: refused
    r = run_cli([*args, "-o", tmp_path / "plain", "--set", "online.math_answer.instruction=''"])
    assert r.code == 0, r.err
    rows = [json.loads(x) for x in (tmp_path / "plain" / "labelled.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"][-1]["content"] == "What is 2 + 2?" and "instruction" not in json.loads(
        (tmp_path / "plain" / "label_summary.json").read_text())["settings"]
    assert [x["verdict"] for x in rows] == ["undesirable", "desirable", "undesirable", "undesirable"]  # hashes read only


def test_math_answer_needs_the_reference_column(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps({"id": "q1", "question": "What is 2 + 2?"}) + "\n")
    err = _one_error(_label(tmp_path, "--rule", "math_answer", "--prompts", p))
    assert "q.jsonl:1" in err and "no 'answer' column" in err
    assert not (tmp_path / "lab" / "labelled.jsonl").exists()


def test_online_rounds_train_on_the_policys_own_samples_and_resume(tmp_path):
    """Two rounds: each labels the current policy's samples, balances the class weights, trains from the
    current policy against the initial reference; the second round samples the first round's model. A rerun
    reuses every finished stage; another setting is refused by name."""
    args = ["online", "demo", "-o", tmp_path / "on", "--rounds", "2", "--n", "2", "--limit", "12", "--heldout-limit", "4", *FAST,
            "--set", "train.max_steps=null", "--set", "train.batch_size=4", "--set", "reference.n_mc=2", "--set", "train.n_mc=2"]
    r = run_cli(args)
    assert r.code == 0, r.err
    rounds = json.loads((tmp_path / "on" / "rounds.json").read_text())["rounds"]
    assert [t["round"] for t in rounds] == [0, 1]
    assert rounds[0]["policy"] == "builtin:toy-sort-base" and rounds[1]["policy"].endswith("round-0/final")
    for t in rounds:
        w = json.loads((tmp_path / "on" / f"round-{t['round']}" / "weights.json").read_text())
        assert w["balance_desirable"] * t["desirable"] == pytest.approx(w["balance_undesirable"] * t["undesirable"])
        assert (w["lambda_desirable"], w["lambda_undesirable"]) == (w["balance_desirable"], 0.3 * w["balance_undesirable"])  # demo's lambda_U
    assert "| round | samples | desirable % |" in r.out and r.out.count("\n| 1 |") == 1
    before = (tmp_path / "on" / "round-1" / "labelled.jsonl").read_text()
    again = run_cli(args)
    assert again.code == 0 and "reusing" in again.err
    assert (tmp_path / "on" / "round-1" / "labelled.jsonl").read_text() == before
    other = run_cli(args[:-2] + ["--set", "train.n_mc=2", "--set", "train.lr=0.5"])
    assert other.code == 2 and "differs from the recorded run" in other.err and "train.lr" in other.err


def test_an_absolute_judge_labels_through_the_judge_client_with_a_cache(tmp_path, monkeypatch):
    """`--rule judge:MODEL`: a yes/no judge at the recipe's judge.base_url (a fake server on 127.0.0.1).
    Its verdict here: YES for an ascending answer. A reply without a verdict is asked once for the verdict
    alone, then counted unjudgeable and left out; a rerun asks nothing twice; the key is never written."""
    import re

    from judge_server import JudgeServer

    key = "sk-test-label-0123456789"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    state = {"dodged": 0}

    def yes_no(first: str, n_messages: int) -> str:
        answer = first.split("[Answer]\n", 1)[1].strip()
        request = re.search(r"sort: (\d+)", first).group(1)
        if int(request) % 3 == 0 and n_messages == 1:  # dodge the first time: the re-ask gets the verdict
            state["dodged"] += 1
            return "Hard to say."
        return "[[YES]]" if answer == "".join(sorted(request)) else "Not sorted. [[NO]]"

    with JudgeServer(key) as srv:
        srv.absolute = yes_no
        args = ["--rule", "judge:m", "--set", f"judge.base_url={srv.url}"]
        r = _label(tmp_path, *args)
        assert r.code == 0, r.err
        asked = len(srv.bodies)
        again = _label(tmp_path, *args, out="lab")  # same folder: every verdict is cached
        assert again.code == 0 and len(srv.bodies) == asked
    rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(x["labeller"] == "judge:m" for x in rows)
    for x in rows:
        digits = digits_of(x["prompt"][-1]["content"])
        assert x["label"] == (x["completion"].strip() == "".join(sorted(digits)))
    assert key not in "".join(p.read_text() for p in (tmp_path / "lab").iterdir() if p.is_file())
    distinct = {(x["prompt"][-1]["content"], x["completion"]) for x in rows}
    assert state["dodged"] >= 1 and asked == len(distinct) + state["dodged"]  # one per distinct sample, one re-ask per dodge


def test_math_answer_rows_carry_their_reason_and_the_summary_counts_them(tmp_path):
    from collections import Counter

    from dllm_align.data.toy import desirable as ascending, make_prompts, prompt_text
    from dllm_align.online.math_answer import REASONS

    digits = make_prompts(6, 5, 3)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": prompt_text(d), "answer": ascending(d)}) + "\n" for d in digits))
    r = run_cli(["label", "demo", "-o", tmp_path / "lab", "--rule", "math_answer", "--prompts", src, "--n", "2"])
    assert r.code == 0, r.err
    rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "lab" / "label_summary.json").read_text())
    for x in rows:
        assert x["reason"] in REASONS and x["label"] == (x["reason"] == "correct")
    assert summary["reasons"] == {k: Counter(x["reason"] for x in rows)[k] for k in REASONS}
    plain = run_cli(["label", "demo", "-o", tmp_path / "s", "--prompts", src, "--n", "1", "--rule", "regex:1"])
    assert plain.code == 0 and json.loads((tmp_path / "s" / "label_summary.json").read_text())["reasons"] is None  # no reasons


def _judge_env(monkeypatch):
    key = "sk-test-label-0123456789"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    return key


def test_the_judge_labeller_uses_the_batch_api_when_asked(tmp_path, monkeypatch):
    """--batch: the verdicts come through the Batch API (files, batches) and are cached like live ones; a
    reply without a verdict is then asked live for the verdict alone."""
    import re

    from judge_server import JudgeServer

    key = _judge_env(monkeypatch)

    def yes_no(first: str, n_messages: int) -> str:
        answer = first.split("[Answer]\n", 1)[1].strip()
        request = re.search(r"sort: (\d+)", first).group(1)
        if int(request) % 3 == 0 and n_messages == 1:
            return "Hard to say."
        return "[[YES]]" if answer == "".join(sorted(request)) else "Not sorted. [[NO]]"

    with JudgeServer(key) as srv:
        srv.absolute, srv.batch_polls = yes_no, 1
        args = ["--rule", "judge:m", "--set", f"judge.base_url={srv.url}", "--set", "judge.batch_poll_interval=0.01", "--batch"]
        r = _label(tmp_path, *args)
        assert r.code == 0, r.err
        batched, live = len(srv.batch_log), len(srv.bodies)
        again = _label(tmp_path, *args)
        assert again.code == 0 and len(srv.batch_log) == batched and len(srv.bodies) == live  # all cached
    rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text().splitlines()]
    distinct = {(x["prompt"][-1]["content"], x["completion"]) for x in rows}
    assert batched == len(distinct) and len(rows) == 12
    dodged = sum(1 for p, _ in distinct if int(re.search(r"sort: (\d+)", p).group(1)) % 3 == 0)
    assert live == 2 * dodged  # each dodge asked live: the request, then the verdict alone
    for x in rows:
        assert x["label"] == (x["completion"].strip() == "".join(sorted(digits_of(x["prompt"][-1]["content"]))))
    assert key not in "".join(p.read_text() for p in (tmp_path / "lab").rglob("*") if p.is_file())


def test_unsure_samples_go_to_a_judge_when_the_recipe_names_one(tmp_path, monkeypatch):
    """online.unsure_judge: the verifier's unsure samples are asked of that judge (the verifier's reason kept, the
    row marked judged_by); the judge's own no-verdict stays unsure; decided samples are never asked."""
    from judge_server import JudgeServer

    from dllm_align.generate.settings import Completion
    from dllm_align.online import label as label_mod

    outs = ["#### 4", "#### 4 or 5", "#### 4\nOn second thought, it is 7.", "#### 9"]

    def fake_sample(gen, prompts, settings, seeds, batch_size, rank, world):
        return [Completion(ids=[], text=outs[k % 4], raw=[], stopped=True, forwards=0) for k in range(len(prompts))]

    monkeypatch.setattr(label_mod, "_sample", fake_sample)
    key = _judge_env(monkeypatch)
    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps({"id": "q1", "question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    with JudgeServer(key) as srv:
        srv.absolute = lambda first, n: "[[YES]]" if "4 or 5" in first else "I cannot tell."
        r = run_cli(["label", "demo", "-o", tmp_path / "lab", "--rule", "math_answer", "--prompts", src, "--n", "4", *FAST,
                     "--set", f"judge.base_url={srv.url}", "--set", "online.unsure_judge=m"])
        asked = [b for b in srv.bodies]
    assert r.code == 0, r.err
    lab = tmp_path / "lab"
    rows = {x["completion"]: x for x in map(json.loads, (lab / "labelled.jsonl").read_text().splitlines())}
    unsure = [json.loads(x) for x in (lab / "unsure.jsonl").read_text().splitlines()]
    assert rows[outs[1]]["verdict"] == "desirable" and rows[outs[1]]["judged_by"] == "judge:m"
    assert rows[outs[1]]["reason"] == "two_answers" and "judged_by" not in rows[outs[0]] and rows[outs[3]]["label"] is False
    assert [x["completion"] for x in unsure] == [outs[2]] and unsure[0]["reason"] == "revised"
    summary = json.loads((lab / "label_summary.json").read_text())
    assert summary["unsure_judged"] == 1 and summary["unsure"] == 1 and summary["settings"]["unsure_judge"] == "judge:m"
    assert not any("#### 9" in json.dumps(b) for b in asked)  # a decided sample is not asked
    assert "2 unsure sample(s) sent to the judge m: 1 decided" in r.err


def test_the_unjudgeable_warning_comes_before_the_error_that_refers_to_it(tmp_path, monkeypatch):
    from judge_server import JudgeServer

    key = _judge_env(monkeypatch)
    with JudgeServer(key) as srv:
        srv.absolute = lambda first, n: "I would rather not say."
        r = _label(tmp_path, "--rule", "judge:m", "--set", f"judge.base_url={srv.url}")
    assert r.code == 2
    lines = r.err.splitlines()
    warn = next(i for i, x in enumerate(lines) if "got no [[YES]]/[[NO]] verdict" in x)
    err = next(i for i, x in enumerate(lines) if x.startswith("Error: no sample got a verdict"))
    assert warn < err and "warning above" in r.err


# --------------------------------------------------------------------------- hostile input, read where it is read
@pytest.mark.parametrize("rows, words", [
    ([{"id": "q0", "prompt": "Sort: 3 1"}, {"id": "q1", "prompt": None}], ("p.jsonl:2", "empty prompt")),
    ([{"id": "q0", "prompt": "Sort: 3 1"}, {"id": "q1", "prompt": 42}], ("p.jsonl:2", "prompt must be")),
    ([{"id": "q0", "prompt": " \n"}], ("p.jsonl:1", "empty prompt")),
    ([{"id": "q0", "question": None}], ("p.jsonl:1", "question")),
    ([{"id": "q0", "prompt": "Sort: 1"}, {"id": "q0", "prompt": "Sort: 2"}], ("p.jsonl:2", "'q0'", "p.jsonl:1")),
    ([{"id": 5, "prompt": "Sort: 1"}, {"id": "5", "prompt": "Sort: 2"}], ("p.jsonl:2", "'5'")),
    ([{"id": [1], "prompt": "Sort: 1"}], ("p.jsonl:1", "id must be")),
    ([{"id": "q0", "prompt": "7 " * 150_000}], ("p.jsonl:1", "300,000 characters")),
])
def test_prompt_rows_are_refused_by_file_and_line(tmp_path, rows, words):
    from dllm_align.core.errors import UserError
    from dllm_align.online.label import read_prompts

    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as e:
        read_prompts(str(p), None, None)
    assert all(w in e.value.message for w in words), e.value.message


@pytest.mark.parametrize("answer", [None, "", "   ", [4], "#### ", True])
def test_math_answer_rows_without_an_answer_are_refused_before_sampling(tmp_path, answer):
    from dllm_align.core.errors import UserError
    from dllm_align.online.label import read_prompts
    from dllm_align.online.verifiers import get_rule

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "q0", "question": "2+2?", "answer": "#### 4"}) + "\n"
                 + json.dumps({"id": "q1", "question": "3+3?", "answer": answer}) + "\n")
    with pytest.raises(UserError) as e:
        read_prompts(str(p), None, None, get_rule("math_answer"))
    assert e.value.message.startswith(f"{p}:2: answer"), e.value.message


@pytest.mark.parametrize("spec, words", [
    ("nosuch", "unknown verifier 'nosuch'"), ("sortt", "did you mean 'sort'"), ("regex:", "empty pattern"),
    ("regex:(", "not a valid regular expression"), ("", "name a verifier"), ("judge:", "name the judge model"),
    ("../../etc/passwd:f", "package.module:function"),
])
def test_a_rule_spec_is_refused_as_the_recipe_is_read(tmp_path, spec, words):
    from dllm_align.config.recipe import load_recipe
    from dllm_align.core.errors import UserError
    from dllm_align.online.verifiers import check_spec

    with pytest.raises(UserError) as e:
        check_spec(spec, f"--rule {spec}")
    assert e.value.message.startswith(f"--rule {spec}: ") and words in e.value.message
    r = tmp_path / "r.yaml"
    r.write_text("extends: demo_online\nonline:\n  rule: " + json.dumps(spec) + "\n")
    with pytest.raises(UserError) as e:
        load_recipe(str(r))
    assert "online.rule" in e.value.message and words in e.value.message


def test_a_folder_labelled_with_other_settings_is_not_relabelled(tmp_path):
    from dllm_align.core.errors import UserError
    from dllm_align.online.label import SUMMARY, _refuse_relabel

    old = {"--rule": "sort", "--n": 2, "--model": "builtin:tiny", "generate": {"temperature": 1.0}}
    (tmp_path / SUMMARY).write_text(json.dumps({"rows": 4, "settings": old}))
    _refuse_relabel(tmp_path / SUMMARY, dict(old))  # the same settings: a rerun gives the same rows
    with pytest.raises(UserError) as e:
        _refuse_relabel(tmp_path / SUMMARY, dict(old, **{"--rule": r"regex:\d", "--n": 4}))
    assert "--rule" in e.value.message and "--n" in e.value.message
    # a summary written before settings were recorded: its labeller, samples and model still count
    (tmp_path / SUMMARY).write_text(json.dumps({"labeller": "sort", "samples_per_prompt": 2, "model": "builtin:tiny"}))
    with pytest.raises(UserError, match="--rule"):
        _refuse_relabel(tmp_path / SUMMARY, dict(old, **{"--rule": "math_answer"}))


def test_a_refused_label_creates_no_folder_and_a_held_folder_is_refused(tmp_path):
    from dllm_align.core.io import DirLock

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "q0", "prompt": "Sort: 3 1"}) + "\n")
    r = run_cli(["label", "demo", "-o", str(tmp_path / "lab"), "--prompts", str(p), "--rule", "judge:m",
                 "--set", "judge.base_url=not a url"], env={"OPENAI_API_KEY": "sk-test"})
    assert r.code == 2 and "judge.base_url" in r.err and not (tmp_path / "lab").exists()
    with DirLock(tmp_path / "lab", "held"):
        r = run_cli(["label", "demo", "-o", str(tmp_path / "lab"), "--prompts", str(p), "--n", "1", *FAST])
    assert r.code == 2 and "another command is writing" in r.err and not list((tmp_path / "lab").iterdir())


def test_an_online_record_with_nothing_finished_binds_nothing(tmp_path):
    from dllm_align.core.errors import UserError
    from dllm_align.workflows.online import RECORD, _check_settings

    _check_settings(tmp_path, {"rule": "nosuch", "n": 2})
    _check_settings(tmp_path, {"rule": "sort", "n": 2})  # nothing labelled yet: the corrected rerun goes ahead
    assert json.loads((tmp_path / RECORD).read_text())["rule"] == "sort"
    (tmp_path / "round-0").mkdir()
    (tmp_path / "round-0" / "label_summary.json").write_text("{}")
    with pytest.raises(UserError, match="rule"):
        _check_settings(tmp_path, {"rule": "math_answer", "n": 2})
    (tmp_path / RECORD).write_text('{"model": ')
    with pytest.raises(UserError, match="online.json: not the record"):
        _check_settings(tmp_path, {"rule": "sort", "n": 2})


def test_greedy_sampling_of_several_samples_is_refused_before_anything_loads():
    from dllm_align.core.errors import UserError
    from dllm_align.online.label import check_temperature

    check_temperature(0, 1)
    check_temperature(None, 4)
    with pytest.raises(UserError, match="--temperature 0 with --n 4"):
        check_temperature(0, 4)


def test_a_labelling_judge_that_asks_for_an_hour_stops_the_label_run_at_once(tmp_path, monkeypatch):
    """The judge server answers five samples, then 429 with Retry-After: 3600: `label` sends nothing more,
    exits 1 saying when the server asked to be retried and how to go on, writes no rows, and keeps the five
    verdicts; the rerun asks only for the others."""
    from judge_server import JudgeServer

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-label-0123456789")
    with JudgeServer("sk-test-label-0123456789") as srv:
        srv.absolute = lambda first, n: "[[YES]]"
        srv.faults = {("m", "?", "?"): ["ok"] * 5 + ["429-hour"] * 50}
        args = ["--rule", "judge:m", "--set", f"judge.base_url={srv.url}"]
        r = _label(tmp_path, *args)
        assert r.code == 1, r.err
        assert [x["action"] for x in srv.log] == ["ok"] * 5 + ["429-hour"]  # not retried, nothing after it
        (line,) = [x for x in r.err.splitlines() if x.startswith("Error:")]
        assert f"{srv.url} asked to be retried after " in line and "Retry-After: 3600" in line
        assert "run the same command again after that time" in line
        assert not (tmp_path / "lab" / "labelled.jsonl").exists()
        assert len((tmp_path / "lab" / "label_cache.jsonl").read_text().splitlines()) == 5
        srv.faults = {}
        again = _label(tmp_path, *args)
        assert again.code == 0, again.err
        rows = [json.loads(x) for x in (tmp_path / "lab" / "labelled.jsonl").read_text().splitlines()]
        distinct = {(x["prompt"][-1]["content"], x["completion"]) for x in rows}
        assert len(srv.log) == 6 + len(distinct) - 5  # the cached five are not asked again
