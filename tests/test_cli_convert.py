"""`dllm-align convert` and `dllm-align data stats|check` through the CLI: exit codes, stderr, outputs."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dllm_align.cli.app import app
from dllm_align.data.load import load_unpaired

runner = CliRunner()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def ultrafeedback_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        user = {"role": "user", "content": f"Prompt number {i}?"}
        rows.append(
            {
                "prompt": user["content"],
                "prompt_id": f"p{i}",
                "chosen": [user, {"role": "assistant", "content": f"good answer {i}"}],
                "rejected": [user, {"role": "assistant", "content": f"bad answer {i}"}],
                "messages": [user, {"role": "assistant", "content": f"good answer {i}"}],
                "score_chosen": 9.0,
                "score_rejected": 2.0,
            }
        )
    return rows


def test_convert_ultrafeedback_pairs(tmp_path):
    N = 6
    src = write_jsonl(tmp_path / "ufb.jsonl", ultrafeedback_rows(N))
    out = tmp_path / "out" / "ufb-unpaired.jsonl"
    r = runner.invoke(app, ["convert", str(src), "--output", str(out)])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    rows = read_jsonl(out)
    assert len(rows) == 2 * N
    assert sum(x["label"] for x in rows) == N and sum(not x["label"] for x in rows) == N
    for i in range(N):
        c, rj = rows[2 * i], rows[2 * i + 1]
        assert c["id"] == f"p{i}:chosen" and rj["id"] == f"p{i}:rejected"
        assert c["pair_id"] == rj["pair_id"] == f"p{i}"
        assert c["prompt"] == rj["prompt"] == [{"role": "user", "content": f"Prompt number {i}?"}]
        assert (c["completion"], c["label"]) == (f"good answer {i}", True)
        assert (rj["completion"], rj["label"]) == (f"bad answer {i}", False)
    assert f"wrote {out}: 12 rows (6 desirable, 6 undesirable)" in r.stderr
    assert "paired layout" in r.stderr
    # the output reads back as the same rows
    assert [x.to_dict() for x in load_unpaired(out, quiet=True)] == rows


def test_convert_shared_rows(shared_data, tmp_path):
    out = tmp_path / "kto.parquet"
    r = runner.invoke(app, ["convert", str(shared_data), "--output", str(out)])
    assert r.exit_code == 0, r.stderr
    rows = load_unpaired(out, quiet=True)
    assert len(rows) == 1500 and sum(x.label for x in rows) == 750
    assert rows[0].id == "1:chosen" and rows[0].pair_id == "1"
    # one file of one class needs --label
    r = runner.invoke(app, ["convert", str(shared_data / "chosen.jsonl"), "--output", str(tmp_path / "c.jsonl")])
    assert r.exit_code == 2 and "--label" in r.stderr
    assert not (tmp_path / "c.jsonl").exists()
    r = runner.invoke(app, ["convert", str(shared_data / "chosen.jsonl"), "--output", str(tmp_path / "c.jsonl"), "--label", "true"])
    assert r.exit_code == 0, r.stderr
    assert all(x["label"] is True for x in read_jsonl(tmp_path / "c.jsonl"))


def kto_file(tmp_path: Path, n_d: int = 750, n_u: int = 750) -> Path:
    rows = [{"id": f"d{i}", "prompt": f"q{i}", "completion": f"good {i}", "label": True} for i in range(n_d)]
    rows += [{"id": f"u{i}", "prompt": f"q{i}", "completion": f"bad {i}", "label": False} for i in range(n_u)]
    return write_jsonl(tmp_path / "kto.jsonl", rows)


def kept_desirable(path: Path) -> set[str]:
    return {x["id"] for x in read_jsonl(path) if x["label"]}


def test_desirable_ratio_is_deterministic(tmp_path):
    src = kto_file(tmp_path)
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / f"{name}.jsonl"
        r = runner.invoke(app, ["convert", str(src), "--output", str(out), "--desirable-ratio", "0.1", "--seed", str(seed)])
        assert r.exit_code == 0, r.stderr
        rows = read_jsonl(out)
        assert sum(x["label"] for x in rows) == 75
        assert sum(not x["label"] for x in rows) == 750
        runs[name] = kept_desirable(out)
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]
    assert "desirable 750 -> 75 (ratio 0.1)" in r.stderr
    # unbalanced classes without weights: the KTO range warning
    assert "outside the KTO paper's recommended [1, 4/3]" in r.stderr


def test_balance_weights_sidecar(tmp_path):
    src = kto_file(tmp_path)
    out = tmp_path / "d10.jsonl"
    r = runner.invoke(app, ["convert", str(src), "--output", str(out), "--desirable-ratio", "0.1", "--balance-weights"])
    assert r.exit_code == 0, r.stderr
    w = json.loads((tmp_path / "d10.weights.json").read_text())
    assert (w["lambda_desirable"], w["lambda_undesirable"]) == (10.0, 1.0)
    assert (w["n_desirable"], w["n_undesirable"]) == (75, 750)
    assert w["lambda_desirable"] * w["n_desirable"] == w["lambda_undesirable"] * w["n_undesirable"]
    assert "outside" not in r.stderr
    from dllm_align.data.imbalance import read_weights_file

    assert read_weights_file(tmp_path / "d10.weights.json") == (10.0, 1.0)


def test_malformed_line_fails_with_line_number_and_writes_nothing(tmp_path):
    good = {"prompt": "q", "completion": "a", "label": True}
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, completion="b")) + "\n" + '{"prompt": "q", "completion": \n', encoding="utf-8")
    out = tmp_path / "out" / "x.jsonl"
    r = runner.invoke(app, ["convert", str(src), "--output", str(out)])
    assert r.exit_code == 2
    first = r.stderr.splitlines()[0]
    assert first.startswith("Error: 1 invalid row in ") and f"{src}:3: malformed JSON" in first
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    # --skip-invalid: the two good rows, and the bad line listed
    r = runner.invoke(app, ["convert", str(src), "--output", str(out), "--skip-invalid"])
    assert r.exit_code == 0, r.stderr
    assert len(read_jsonl(out)) == 2
    assert "skipped 1 invalid row" in r.stderr and f"{src}:3: malformed JSON" in r.stderr


def test_many_problems_listed_and_capped(tmp_path):
    rows = [{"prompt": "q", "completion": f"a{i}", "label": "maybe"} for i in range(30)]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    r = runner.invoke(app, ["convert", str(src), "--output", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 2
    lines = r.stderr.splitlines()
    assert lines[0].startswith("Error: 30 invalid rows in")
    assert any(line.strip() == "... and 10 more" for line in lines)
    assert lines[-1].startswith("Hint:")


def test_convert_argument_errors(tmp_path):
    src = kto_file(tmp_path, 3, 3)
    r = runner.invoke(app, ["convert", str(src), "--output", str(tmp_path / "x.csv")])
    assert r.exit_code == 2 and "must end in .jsonl or .parquet" in r.stderr
    r = runner.invoke(app, ["convert", str(src), "--output", str(src)])
    assert r.exit_code == 2 and "overwrite the input" in r.stderr
    r = runner.invoke(app, ["convert", str(src), "--output", str(tmp_path / "y.jsonl"), "--desirable-ratio", "0"])
    assert r.exit_code == 2
    r = runner.invoke(app, ["convert", "--help"])
    assert r.exit_code == 0 and "dllm-align convert" in r.stdout


# --------------------------------------------------------------------------- data stats / check
def test_data_stats_on_shared_rows(shared_data):
    r = runner.invoke(app, ["data", "stats", str(shared_data), "--json", "--batch-size", "8"])
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert (s["rows"], s["desirable"], s["undesirable"], s["pairs"]) == (1500, 750, 750, 750)
    fed = s["tokens_fed"]
    assert fed["paper"] == s["rows_kept"] * 4096
    assert s["rows_kept"] == 1500 - s["dropped"]
    assert fed["real"] <= fed["none_grouped"] < fed["none_random"] < fed["paper"]
    assert 1 - fed["real"] / fed["none_grouped"] < 0.05  # length grouping: under 5% padding
    q = s["tokens"]["total"]
    assert q["min"] <= q["p50"] <= q["p90"] <= q["p99"] <= q["max"]
    # the table for humans
    r = runner.invoke(app, ["data", "stats", str(shared_data), "--max-length", "2048"])
    assert r.exit_code == 0, r.stderr
    assert "paper: EOS to 2,048" in r.stdout and "none, length-grouped" in r.stdout


def test_data_stats_small_file_by_hand(tmp_path):
    # byte tokenizer: lengths are known exactly
    src = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "q", "completion": "a" * n, "label": n % 2 == 0} for n in (1, 2, 3, 4)])
    r = runner.invoke(app, ["data", "stats", str(src), "--json", "--batch-size", "2", "--max-length", "64"])
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    from dllm_align.models.load import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False)
    p = len(tok(text, add_special_tokens=False)["input_ids"])
    totals = [p + n + 1 for n in (1, 2, 3, 4)]
    assert s["tokens"]["completion"]["max"] == 5 and s["tokens"]["prompt"]["min"] == p
    assert s["tokens_fed"]["real"] == sum(totals)
    assert s["tokens_fed"]["paper"] == 4 * 64
    assert s["tokens_fed"]["none_grouped"] == 2 * totals[3] + 2 * totals[1]


def test_data_check(tmp_path):
    src = kto_file(tmp_path, 2, 1)
    r = runner.invoke(app, ["data", "check", str(src)])
    assert r.exit_code == 0 and "3 valid rows (2 desirable, 1 undesirable)" in r.stdout
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "completion": "", "label": True}])
    r = runner.invoke(app, ["data", "check", str(bad)])
    assert r.exit_code == 2 and "empty completion" in r.stderr


def test_convert_hub_dataset_offline_is_one_line(tmp_path):
    out = tmp_path / "ufb.jsonl"
    r = runner.invoke(app, ["convert", "HuggingFaceH4/ultrafeedback_binarized", "--split", "train_prefs", "--output", str(out)])
    assert r.exit_code == 2
    assert r.stderr.splitlines()[0] == (
        "Error: dataset 'HuggingFaceH4/ultrafeedback_binarized' is not in the local cache "
        "and HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set"
    )
    assert "Traceback" not in r.stderr and not out.exists()
