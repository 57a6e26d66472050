"""Reading, layouts, validation, unpairing and the class-imbalance tools (dllm_align.data.rows)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from dllm_align.data import convert
from dllm_align.data import imbalance
from dllm_align.data import load
from dllm_align.data import rows
from dllm_align.data.rows import PairRow, Row, unpair
from dllm_align.data.imbalance import balance_weights, check_weight_ratio, class_counts, read_weights_file, subsample
from dllm_align.data.load import load_paired, load_prompts, load_unpaired
from dllm_align.core.errors import UserError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ultrafeedback_rows(n: int) -> list[dict]:
    """Rows in the layout of HuggingFaceH4/ultrafeedback_binarized (train_prefs)."""
    rows = []
    for i in range(n):
        prompt = f"Question {i}: what is {i} + {i}?"
        user = {"role": "user", "content": prompt}
        rows.append(
            {
                "prompt": prompt,
                "prompt_id": f"pid{i}",
                "chosen": [user, {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}],
                "rejected": [user, {"role": "assistant", "content": f"It is {2 * i + 1}."}],
                "messages": [user, {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}],
                "score_chosen": 8.0,
                "score_rejected": 3.0,
            }
        )
    return rows


def kto_rows(n_d: int, n_u: int) -> list[dict]:
    rows = [{"prompt": f"p{i}", "completion": f"good {i}", "label": True} for i in range(n_d)]
    rows += [{"prompt": f"p{i}", "completion": f"bad {i}", "label": False} for i in range(n_u)]
    return rows


def problems_of(excinfo) -> str:
    return excinfo.value.message


# --------------------------------------------------------------------------- layouts
def test_ultrafeedback_layout_pairs_and_unpairs(tmp_path, capsys):
    f = write_jsonl(tmp_path / "ufb.jsonl", ultrafeedback_rows(4))
    pairs = load_paired(f)
    assert [p.id for p in pairs] == ["pid0", "pid1", "pid2", "pid3"]
    assert pairs[2].prompt == [{"role": "user", "content": "Question 2: what is 2 + 2?"}]
    assert pairs[2].chosen == "2 + 2 = 4." and pairs[2].rejected == "It is 5."
    assert "paired layout" in capsys.readouterr().err
    rows = load_unpaired(f)
    assert len(rows) == 8 and class_counts(rows) == (4, 4)
    assert rows[0] == Row("pid0:chosen", pairs[0].prompt, "0 + 0 = 0.", True, "pid0")
    assert rows[1] == Row("pid0:rejected", pairs[0].prompt, "It is 1.", False, "pid0")


def test_conversation_must_agree_with_prompt_column(tmp_path):
    rows = ultrafeedback_rows(3)
    rows[1]["chosen"][0]["content"] = "a different question"
    rows[2]["rejected"] = [{"role": "user", "content": rows[2]["prompt"]}]  # no assistant reply
    f = write_jsonl(tmp_path / "ufb.jsonl", rows)
    with pytest.raises(UserError) as e:
        load_paired(f)
    msg = problems_of(e)
    assert msg.startswith(f"2 invalid rows in {f}")
    assert f"{f}:2: chosen: the conversation before the reply does not match the prompt column" in msg
    assert f"{f}:3: rejected: the message list has no assistant reply (last message is from 'user')" in msg


def test_system_message_conversation_with_string_prompt(tmp_path):
    row = ultrafeedback_rows(1)[0]
    sys_msg = {"role": "system", "content": "Be brief."}
    row["chosen"] = [sys_msg] + row["chosen"]
    row["rejected"] = [sys_msg] + row["rejected"]
    (pair,) = load_paired(write_jsonl(tmp_path / "u.jsonl", [row]))
    assert pair.prompt[0] == sys_msg and pair.prompt[1]["role"] == "user"


def test_implicit_prompt_from_conversations(tmp_path):
    row = ultrafeedback_rows(1)[0]
    del row["prompt"], row["prompt_id"]
    (pair,) = load_paired(write_jsonl(tmp_path / "u.jsonl", [row]))
    assert pair.prompt == [{"role": "user", "content": "Question 0: what is 0 + 0?"}]
    assert len(pair.id) == 16  # content hash


def test_kto_layout_messages_and_strings(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}], "label": True},
        {"prompt": "hi", "completion": "go away", "label": False},
    ]
    got = load_unpaired(write_jsonl(tmp_path / "k.jsonl", rows))
    assert [r.prompt for r in got] == [[{"role": "user", "content": "hi"}]] * 2
    assert [r.completion for r in got] == ["hello", "go away"]
    assert [r.label for r in got] == [True, False]


def test_shared_rows_read_as_unpaired(shared_data):
    rows = load_unpaired(shared_data)
    assert len(rows) == 1500
    assert class_counts(rows) == (750, 750)
    assert rows[0].id == "1:chosen" and rows[1].id == "1:rejected"
    assert rows[0].pair_id == rows[1].pair_id == "1"
    assert rows[0].prompt == rows[1].prompt
    raw = json.loads((shared_data / "chosen.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert rows[0].prompt == raw["prompt"]
    assert rows[0].completion == raw["completion"][0]["content"]
    assert len({r.id for r in rows}) == 1500


def test_shared_rows_as_pairs_and_single_files(shared_data):
    pairs = load_paired(shared_data)
    assert len(pairs) == 750 and pairs[0].id == "1"
    assert unpair(pairs) == load_unpaired(shared_data)
    rejected = load_unpaired(shared_data / "rejected.jsonl", label=False)
    assert len(rejected) == 750 and not any(r.label for r in rejected)
    assert rejected[0].id == "1"
    assert rejected[0].completion == pairs[0].rejected
    # several multi-turn prompts: the prompt is a conversation ending with a user turn
    assert any(len(p.prompt) > 1 for p in pairs)
    assert all(p.prompt[-1]["role"] == "user" for p in pairs)


def test_label_less_file_needs_label(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "completion": "a"}])
    with pytest.raises(UserError, match="missing column 'label'.*--label true"):
        load_unpaired(f)
    (row,) = load_unpaired(f, label=True)
    assert row.label is True


def test_pair_files_join_reports_orphans(tmp_path):
    d = tmp_path / "pf"
    d.mkdir()
    msgs = lambda s: [{"role": "user", "content": s}]  # noqa: E731
    write_jsonl(d / "chosen.jsonl", [{"id": 1, "prompt": msgs("a"), "completion": "A"}, {"id": 2, "prompt": msgs("b"), "completion": "B"}])
    write_jsonl(d / "rejected.jsonl", [{"id": 1, "prompt": msgs("a"), "completion": "x"}, {"id": 3, "prompt": msgs("c"), "completion": "y"}])
    with pytest.raises(UserError) as e:
        load_paired(d)
    assert f"{d / 'chosen.jsonl'}:2: id '2' has no rejected partner" in e.value.message
    assert f"{d / 'rejected.jsonl'}:2: id '3' has no chosen partner" in e.value.message
    # read as unpaired rows, all rows are kept; only the true pair shares a pair id
    rows = load_unpaired(d)
    assert [(r.id, r.pair_id) for r in rows] == [("1:chosen", "1"), ("1:rejected", "1"), ("2:chosen", None), ("3:rejected", None)]


# --------------------------------------------------------------------------- validation
def test_malformed_json_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "q", "completion": "a", "label": True})
    f.write_text(good + "\n" + good.replace('"a"', '"b"') + "\n{\"prompt\": \"q\", \n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_unpaired(f)
    assert e.value.message.startswith(f"1 invalid row in {f}: {f}:3: malformed JSON")
    assert "\n" not in e.value.message  # one problem: one line


def test_every_kind_of_bad_row_is_reported(tmp_path):
    f = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": "q", "completion": "fine", "label": True}),
        json.dumps({"id": "b", "completion": "no prompt", "label": True}),
        json.dumps({"id": "c", "prompt": "  ", "completion": "x", "label": True}),
        json.dumps({"id": "d", "prompt": "q", "completion": "", "label": False}),
        json.dumps({"id": "e", "prompt": "q", "completion": "x", "label": "yes"}),
        json.dumps({"id": "f", "prompt": "q", "completion": [{"role": "user", "content": "x"}], "label": True}),
        json.dumps({"id": "a", "prompt": "q", "completion": "dup", "label": True}),
        json.dumps([1, 2]),
        json.dumps({"id": "g", "prompt": "q", "completion": "x", "label": 1}),
    ]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    bad_line = b'{"id": "h", "prompt": "caf\xe9", "completion": "x", "label": true}'
    bad_col = bad_line.index(b"\xe9") + 1
    data += bad_line + b"\n"
    f.write_bytes(data)
    with pytest.raises(UserError) as e:
        load_unpaired(f)
    msg = e.value.message
    assert msg.splitlines()[0].startswith(f"9 invalid rows in {f}: {f}:2: missing column 'prompt'")
    for expected in (
        f"{f}:3: empty prompt",
        f"{f}:4: empty completion",
        f"{f}:5: label must be true or false, got \"yes\"",
        f"{f}:6: completion: the message list has no assistant reply",
        f"{f}:7: duplicate id 'a' (first at {f}:1)",
        f"{f}:8: expected a JSON object, got list",
        f"{f}:9: label must be true or false, got 1",
        f"{f}:10: not UTF-8 text (byte 0xe9 at column {bad_col})",
    ):
        assert expected in msg, expected
    assert "skip-invalid" in e.value.hint


def test_skip_invalid_skips_and_lists(tmp_path, capsys):
    rows = kto_rows(3, 0)
    rows[1]["completion"] = ""
    f = write_jsonl(tmp_path / "k.jsonl", rows)
    got = load_unpaired(f, skip_invalid=True)
    assert [r.completion for r in got] == ["good 0", "good 2"]
    err = capsys.readouterr().err
    assert "skipped 1 invalid row" in err and f"{f}:2: empty completion" in err


def test_problem_listing_is_capped(tmp_path):
    f = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "q", "completion": "", "label": True}] * 25)
    with pytest.raises(UserError) as e:
        load_unpaired(f)
    lines = e.value.message.splitlines()
    assert lines[0].startswith("25 invalid rows")
    assert len(lines) == 1 + rows.MAX_LISTED + 1
    assert lines[-1].strip() == "... and 5 more"


def test_forced_format_mismatch_is_one_line(tmp_path):
    f = write_jsonl(tmp_path / "u.jsonl", ultrafeedback_rows(2))
    with pytest.raises(UserError, match="--format unpaired needs column 'completion'") as e:
        load_unpaired(f, format="unpaired")
    assert "look paired" in e.value.hint


def test_unknown_layout(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match="cannot tell the layout from the columns"):
        load_unpaired(f)


# --------------------------------------------------------------------------- ids
def test_hash_ids_are_order_free_and_duplicates_suffixed(tmp_path, capsys):
    rows = kto_rows(3, 3)
    a = load_unpaired(write_jsonl(tmp_path / "a.jsonl", rows))
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    b = load_unpaired(write_jsonl(tmp_path / "b.jsonl", shuffled))
    assert {r.id: r for r in a} == {r.id: r for r in b}
    dup = load_unpaired(write_jsonl(tmp_path / "c.jsonl", rows + [rows[0]]))
    assert dup[-1].id == dup[0].id + "-2"
    assert "1 rows are exact copies" in capsys.readouterr().err


def test_repeated_prompt_id_is_soft(tmp_path, capsys):
    rows = ultrafeedback_rows(2)
    second = json.loads(json.dumps(rows[0]))
    second["rejected"][1]["content"] = "another bad answer"
    f = write_jsonl(tmp_path / "u.jsonl", rows + [second])
    assert [p.id for p in load_paired(f)] == ["pid0", "pid1", "pid0-2"]
    assert "1 pairs repeat an earlier pair's prompt_id" in capsys.readouterr().err
    assert [p.id for p in load_prompts(f)] == ["pid0", "pid1"]
    # an explicit id column is a row id: repeats are errors
    for r in rows + [second]:
        r["id"] = "same"
    with pytest.raises(UserError, match="duplicate id 'same'"):
        load_paired(write_jsonl(tmp_path / "v.jsonl", rows + [second]))


# --------------------------------------------------------------------------- file kinds
def test_parquet_csv_json_gz_and_saved_dataset(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = kto_rows(2, 2)
    expected = load_unpaired(write_jsonl(tmp_path / "ref.jsonl", rows))

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "k.parquet")
    assert load_unpaired(tmp_path / "k.parquet") == expected

    (tmp_path / "k.json").write_text(json.dumps(rows), encoding="utf-8")
    assert load_unpaired(tmp_path / "k.json") == expected
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    (tmp_path / "cols.json").write_text(json.dumps(cols), encoding="utf-8")
    assert load_unpaired(tmp_path / "cols.json") == expected

    with gzip.open(tmp_path / "k.jsonl.gz", "wt", encoding="utf-8") as g:
        g.write("".join(json.dumps(r) + "\n" for r in rows))
    assert load_unpaired(tmp_path / "k.jsonl.gz") == expected

    csv_text = "prompt,completion,label\n" + "".join(f"{r['prompt']},{r['completion']},{str(r['label']).lower()}\n" for r in rows)
    (tmp_path / "k.csv").write_text(csv_text, encoding="utf-8")
    assert load_unpaired(tmp_path / "k.csv") == expected

    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])})
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_unpaired(tmp_path / "saved", split="train") == expected
    assert len(load_unpaired(tmp_path / "saved", split="test")) == 1
    with pytest.raises(UserError, match="several splits"):
        load_unpaired(tmp_path / "saved")
    with pytest.raises(UserError, match="no split 'dev'"):
        load_unpaired(tmp_path / "saved", split="dev")


def test_csv_messages_as_json_text_and_bad_label(tmp_path):
    msgs = json.dumps([{"role": "user", "content": "hi, there"}]).replace('"', '""')
    (tmp_path / "k.csv").write_text(f'prompt,completion,label\n"{msgs}",hello,True\n"{msgs}",bye,maybe\n', encoding="utf-8")
    with pytest.raises(UserError) as e:
        load_unpaired(tmp_path / "k.csv")
    assert f"{tmp_path / 'k.csv'}:3: label must be true or false" in e.value.message
    (row,) = load_unpaired(tmp_path / "k.csv", skip_invalid=True)
    assert row.prompt == [{"role": "user", "content": "hi, there"}]


def test_folder_with_split_files(tmp_path):
    d = tmp_path / "repo"
    (d / "data").mkdir(parents=True)
    write_jsonl(d / "data" / "train-00000-of-00001.jsonl", kto_rows(2, 1))
    write_jsonl(d / "data" / "test-00000-of-00001.jsonl", kto_rows(1, 0))
    assert len(load_unpaired(d, split="train")) == 3
    assert len(load_unpaired(d, split="test")) == 1
    # shards of one split are read together; ids are unique across them
    write_jsonl(d / "data" / "train-00001-of-00002.jsonl", kto_rows(1, 1))
    rows = load_unpaired(d, split="train")
    assert len(rows) == 5 and len({r.id for r in rows}) == 5
    with pytest.raises(UserError, match="several data files"):
        load_unpaired(d / "data")


def test_hub_offline_is_one_line_without_a_connection(connections):
    with pytest.raises(UserError) as e:
        load_unpaired("trl-lib/kto-mix-14k", split="train")
    assert connections == []  # offline means no attempt, not a quick timeout
    assert "not in the local cache" in e.value.message and "HF_DATASETS_OFFLINE" in e.value.message
    assert "\n" not in e.value.message


def test_hub_unreachable_fails_without_retries(monkeypatch, connections):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    with pytest.raises(UserError, match="cannot reach the Hugging Face Hub to load dataset 'HuggingFaceH4/ultrafeedback_binarized'"):
        load_paired("HuggingFaceH4/ultrafeedback_binarized", split="train_prefs")
    assert connections == [("127.0.0.1", 9)]  # one attempt, refused, no retries


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(UserError, match="data not found"):
        load_unpaired(tmp_path / "nope.jsonl")
    (tmp_path / "x.xlsx").write_text("x")
    with pytest.raises(UserError, match="unknown file type"):
        load_unpaired(tmp_path / "x.xlsx")
    (tmp_path / "p.txt").write_text("a prompt\n")
    with pytest.raises(UserError, match="prompts only"):
        load_unpaired(tmp_path / "p.txt")


# --------------------------------------------------------------------------- prompts
def test_load_prompts_text_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("What is 2+2?\n\nName a colour.\nWhat is 2+2?\n", encoding="utf-8")
    prompts = load_prompts(p)
    assert [x.messages for x in prompts] == [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a colour."}],
    ]
    # ids are content hashes: the same prompt has the same id in any file
    (tmp_path / "b.txt").write_text("Name a colour.\n", encoding="utf-8")
    assert load_prompts(tmp_path / "b.txt")[0].id == prompts[1].id


def test_load_prompts_shared_rows(shared_data):
    prompts = load_prompts(shared_data, limit=10)
    assert [p.id for p in prompts] == [str(i) for i in range(1, 11)]
    assert prompts[0].messages[-1]["role"] == "user"
    assert len(load_prompts(shared_data)) == 750
    assert [p.id for p in load_prompts(shared_data / "chosen.jsonl", limit=3)] == ["1", "2", "3"]


def test_load_prompts_layouts(tmp_path):
    u = write_jsonl(
        tmp_path / "u.jsonl",
        [
            {"prompt": "hi", "completion": "hello", "label": True},
            {"prompt": "hi", "completion": "go away", "label": False},
            {"prompt": "bye", "completion": "ciao", "label": True},
        ],
    )
    prompts = load_prompts(u)
    assert [p.messages[0]["content"] for p in prompts] == ["hi", "bye"]
    assert len({p.id for p in prompts}) == 2
    ufb = load_prompts(write_jsonl(tmp_path / "ufb.jsonl", ultrafeedback_rows(3)))
    assert [p.id for p in ufb] == ["pid0", "pid1", "pid2"]
    conv = [{"id": "m1", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    (m,) = load_prompts(write_jsonl(tmp_path / "m.jsonl", conv))
    assert m.id == "m1" and m.messages == [{"role": "user", "content": "q"}]


# --------------------------------------------------------------------------- pairs
def test_unpair_and_repair_roundtrip(tmp_path):
    pairs = [PairRow("a", [{"role": "user", "content": "q"}], "good", "bad"), PairRow("b", [{"role": "user", "content": "r"}], "g2", "b2")]
    rows = unpair(pairs)
    assert [(r.id, r.label, r.pair_id) for r in rows] == [
        ("a:chosen", True, "a"), ("a:rejected", False, "a"), ("b:chosen", True, "b"), ("b:rejected", False, "b"),
    ]
    f = convert.write_rows(rows, tmp_path / "rows.jsonl")
    assert load_paired(f) == pairs
    assert load_unpaired(f) == rows


def test_unpaired_without_pair_ids_cannot_be_paired(tmp_path):
    with pytest.raises(UserError, match="without pair ids cannot be used as pairs"):
        load_paired(write_jsonl(tmp_path / "k.jsonl", kto_rows(2, 2)))


# --------------------------------------------------------------------------- imbalance
def _rows(n_d: int, n_u: int) -> list[Row]:
    m = [{"role": "user", "content": "q"}]
    return [Row(f"d{i}", m, "x", True) for i in range(n_d)] + [Row(f"u{i}", m, "y", False) for i in range(n_u)]


def test_subsample_counts_and_determinism():
    rows = _rows(750, 750)
    a = subsample(rows, desirable_ratio=0.1, seed=0)
    assert class_counts(a) == (75, 750)
    assert a == subsample(rows, desirable_ratio=0.1, seed=0)
    b = subsample(rows, desirable_ratio=0.1, seed=1)
    assert class_counts(b) == (75, 750)
    assert {r.id for r in a if r.label} != {r.id for r in b if r.label}
    # independent of the input order, returned in input order
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    c = subsample(shuffled, desirable_ratio=0.1, seed=0)
    assert {r.id for r in c} == {r.id for r in a}
    assert [r.id for r in c] == [r.id for r in shuffled if r.id in {x.id for x in c}]
    # a smaller ratio keeps a subset of what a larger one keeps
    half = subsample(rows, desirable_ratio=0.5, seed=0)
    assert {r.id for r in a} <= {r.id for r in half}
    assert class_counts(subsample(rows, undesirable_ratio=0.5, seed=0)) == (750, 375)
    assert class_counts(subsample(_rows(5, 5), 0.01, 1.0)) == (1, 5)  # never empties a class
    with pytest.raises(UserError):
        subsample(rows, desirable_ratio=0)


def test_balance_weights_and_kto_range(capsys):
    assert balance_weights(_rows(75, 750)) == (10.0, 1.0)
    assert balance_weights(_rows(750, 375)) == (1.0, 2.0)
    assert balance_weights(_rows(4, 4)) == (1.0, 1.0)
    lD, lU = balance_weights(_rows(75, 750))
    assert lD * 75 == lU * 750
    with pytest.raises(UserError, match="no undesirable rows"):
        balance_weights(_rows(3, 0))
    assert check_weight_ratio(75, 750, 10.0, 1.0)
    assert check_weight_ratio(400, 300, 1.0, 1.0)  # 4/3: the top of the range
    assert capsys.readouterr().err == ""
    assert not check_weight_ratio(75, 750, 1.0, 1.0)
    assert "outside the KTO paper's recommended [1, 4/3]" in capsys.readouterr().err
    assert not check_weight_ratio(100, 300, 1.0, 1.0, warn=False)


def test_weights_file(tmp_path):
    p = tmp_path / "w.json"
    p.write_text(json.dumps({"lambda_desirable": 10, "lambda_undesirable": 1.0}))
    assert read_weights_file(p) == (10.0, 1.0)
    p.write_text(json.dumps({"lambda_desirable": -1, "lambda_undesirable": 1.0}))
    with pytest.raises(UserError, match="'lambda_desirable' must be a positive number"):
        read_weights_file(p)
    assert imbalance.weights_path_for("out/ufb.jsonl") == Path("out/ufb.weights.json")
    assert imbalance.weights_path_for("ufb.parquet") == Path("ufb.weights.json")


def test_rows_from_section(tmp_path):
    from dllm_align.config.schema import DataSection

    f = write_jsonl(tmp_path / "k.jsonl", kto_rows(20, 20))
    sec = DataSection(train=str(f), desirable_ratio=0.5, seed=3)
    rows = load.rows_from_section(sec, quiet=True)
    assert class_counts(rows) == (10, 20)
    assert rows == subsample(load_unpaired(f, quiet=True), 0.5, 1.0, 3)
    with pytest.raises(UserError, match="data.test is not set"):
        load.rows_from_section(sec, "test")
