"""judging.py and `dllm-align judge`: exact numbers against a scripted HTTP judge,
faults, resuming after a dead server, secrets, inputs (docs/design.md#judging).

Kill and resume at chosen points: tests/test_reliability_kill.py; the key in every
file and output of failing and killed runs: tests/test_reliability_security.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dllm_align.judge import run as judging

from dllm_align.judge import stats
from dllm_align.judge.client import _retry_after
from dllm_align.cli.app import app
from dllm_align.config.schema import JudgeSection
from judge_server import JudgeServer, answer

runner = CliRunner()
KEY = "sk-test-PLANTED-9f8e7d6c5b4a3210"
REPO = Path(__file__).resolve().parents[1]

# Scripted verdicts (AB order, BA order) of two judges on 8 prompts, and the
# outcomes for model A derived by hand from the two-order rule.
J1 = {
    "p0": ("A", "B"),  # win
    "p1": ("A", "B"),  # win
    "p2": ("B", "A"),  # loss
    "p3": ("A", "A"),  # tie (position bias)
    "p4": ("C", "B"),  # tie (only one order prefers A)
    "p5": ("A", "B"),  # win
    "p6": ("B", "A"),  # loss
    "p7": ("C", "C"),  # tie
}
J2 = {
    "p0": ("A", "B"),  # win
    "p1": ("B", "B"),  # tie
    "p2": ("B", "A"),  # loss
    "p3": ("C", "C"),  # tie
    "p4": ("A", "B"),  # win
    "p5": ("A", "B"),  # win
    "p6": ("A", "B"),  # win
    "p7": ("B", "B"),  # tie
}
IDS = list(J1)
# judge-1: 3 wins, 2 losses, 3 ties -> AWR (3 + 1.5) / 8 = 0.5625
# judge-2: 4 wins, 1 loss, 3 ties   -> AWR (4 + 1.5) / 8 = 0.6875
# MV (both judges must agree): p0 W, p2 L, p5 W, the rest ties -> 2 / 1 / 5 -> (2 + 2.5) / 8 = 0.5625
# kappa, rows judge-1, columns judge-2 (W, L, T):
#   W: p0 WW, p1 WT, p5 WW -> 2 0 1 | L: p2 LL, p6 LW -> 1 1 0 | T: p3 TT, p4 TW, p7 TT -> 1 0 2
#   p_o = 5/8, rows (3, 2, 3), cols (4, 1, 3), p_e = (12 + 2 + 9) / 64 = 23/64
#   kappa = (40/64 - 23/64) / (41/64) = 17/41
OUT1 = [1, 1, -1, 0, 0, 1, -1, 0]
OUT2 = [1, 0, -1, 0, 1, 1, 1, 0]


def write_gen(tmp: Path, ids=IDS, *, model="A", name=None, prompt=lambda i: f"Question {i}?", extra=None) -> Path:
    path = tmp / (name or f"{model.lower()}.jsonl")
    with open(path, "w") as f:
        for i in ids:
            row = {"id": i, "prompt": [{"role": "user", "content": prompt(i)}], "completion": answer(model, i)}
            if model == "B":  # the other layout: string prompt, one-message completion
                row = {"id": i, "prompt": prompt(i), "completion": [{"role": "assistant", "content": answer(model, i)}]}
            row.update(extra or {})
            f.write(json.dumps(row) + "\n")
    return path


def script(server: JudgeServer, model: str, table: dict) -> None:
    for pid, (ab, ba) in table.items():
        server.verdicts[(model, pid, "AB")] = ab
        server.verdicts[(model, pid, "BA")] = ba


def cli(args, key=KEY, **env):
    e = {"OPENAI_API_KEY": key} if key is not None else {}
    e.update(env)
    return runner.invoke(app, ["judge", *[str(a) for a in args]], env=e)


def fast(server: JudgeServer) -> list[str]:
    return ["--base-url", server.url, "--timeout", "0.5", "--retry-delay", "0.01", "--concurrency", "4", "--bootstrap", "1000"]


@pytest.fixture()
def files(tmp_path):
    return write_gen(tmp_path, model="A"), write_gen(tmp_path, model="B")


def all_text_under(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- exact numbers
def test_two_judges_exact_numbers(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        script(srv, "judge-2", J2)
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "judge-1", "--judge", "judge-2", "--json", *fast(srv)])
        assert r.exit_code == 0, r.stderr
        assert len(srv.log) == 32  # 8 prompts x 2 orders x 2 judges, each asked once
        assert set(srv.paths) == {"/v1/chat/completions"}
    res = json.loads(r.stdout)
    assert res == json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["n"] == 8 and res["failed_judgements"] == 0
    j1, j2, mv = res["judges"]["judge-1"], res["judges"]["judge-2"], res["majority_vote"]
    assert (j1["wins"], j1["losses"], j1["ties"], j1["n"], j1["awr"]) == (3, 2, 3, 8, 0.5625)
    assert (j2["wins"], j2["losses"], j2["ties"], j2["n"], j2["awr"]) == (4, 1, 3, 8, 0.6875)
    assert (mv["wins"], mv["losses"], mv["ties"], mv["n"], mv["awr"]) == (2, 1, 5, 8, 0.5625)
    assert res["cohen_kappa"]["value"] == pytest.approx(17 / 41, abs=1e-15)
    # intervals: the documented bootstrap on the hand-derived outcomes, same resamples for every metric
    assert j1["ci90"] == list(stats.awr_ci(OUT1, n_resamples=1000, seed=0))
    assert j2["ci90"] == list(stats.awr_ci(OUT2, n_resamples=1000, seed=0))
    assert mv["ci90"] == list(stats.awr_ci(stats.majority_vote(OUT1, OUT2), n_resamples=1000, seed=0))
    assert res["cohen_kappa"]["ci90"] == list(stats.kappa_ci(OUT1, OUT2, n_resamples=1000, seed=0))
    # per-prompt outcomes
    rows = [json.loads(x) for x in (tmp_path / "out" / "outcomes.jsonl").read_text().splitlines()]
    assert [r_["id"] for r_ in rows] == IDS
    names = {1: "win", -1: "loss", 0: "tie"}
    assert [r_["judges"]["judge-1"]["outcome"] for r_ in rows] == [names[o] for o in OUT1]
    assert [r_["judges"]["judge-2"]["outcome"] for r_ in rows] == [names[o] for o in OUT2]
    assert [r_["majority_vote"] for r_ in rows] == ["win", "tie", "loss", "tie", "tie", "win", "tie", "tie"]
    assert rows[4]["judges"]["judge-1"] == {"AB": "C", "BA": "B", "outcome": "tie"}
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| judge-1 | 56.25 |" in md and "| MV (two judges) | 56.25 |" in md and "| Cohen's kappa | 0.415 |" in md
    assert res["usage"]["judge-1"]["judgements"] == 16


def test_position_biased_judge_gives_all_ties_and_table_in_percent(tmp_path, files):
    a, b = files
    with JudgeServer(KEY, default_verdict="A") as srv:  # always "[[A]]", whatever it is shown
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "biased", *fast(srv)])
    assert r.exit_code == 0, r.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())["judges"]["biased"]
    assert (res["wins"], res["losses"], res["ties"], res["awr"], res["ci90"]) == (0, 0, 8, 0.5, [0.5, 0.5])
    line = next(x for x in r.stdout.splitlines() if x.startswith("│ biased "))
    assert "50.00" in line and "[50.00, 50.00]" in line
    assert "AWR (%)" in r.stdout and "majority" not in r.stdout.lower()


def test_the_server_sees_both_orders_with_the_builtin_template(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        assert cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)]).exit_code == 0
        by_order = {r["order"] for r in srv.log}
        content = srv.contents[0]
    assert by_order == {"AB", "BA"}
    assert "[[A]]" in content and "[[C]]" in content and "Question p" in content
    assert "{prompt}" not in content and "{answer_a}" not in content


# --------------------------------------------------------------------------- faults
def test_faults_are_retried_and_numbers_unchanged(tmp_path, files):
    a, b = files
    with JudgeServer(KEY, slow_seconds=1.2) as srv:
        script(srv, "judge-1", J1)
        srv.faults = {
            ("judge-1", "p0", "AB"): ["429"],           # Retry-After: 1
            ("judge-1", "p1", "AB"): ["500", "503"],
            ("judge-1", "p2", "BA"): ["slow"],          # past the 0.5 s timeout
            ("judge-1", "p3", "AB"): ["drop"],          # connection closed without an answer
            ("judge-1", "p4", "BA"): ["garbage"],       # no verdict: asked again
            ("judge-1", "p5", "AB"): ["429ms", "badjson"],
        }
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "judge-1", "--max-retries", "4", *fast(srv)])
        assert r.exit_code == 0, r.stderr
        actions = {(x["id"], x["order"]): [] for x in srv.log}
        for x in srv.log:
            actions[(x["id"], x["order"])].append(x)
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    j1 = res["judges"]["judge-1"]
    assert (j1["wins"], j1["losses"], j1["ties"], j1["n"], j1["awr"]) == (3, 2, 3, 8, 0.5625)
    assert res["failed_judgements"] == 0
    # every fault cost exactly its extra requests, then the normal answer
    assert [x["action"] for x in actions[("p1", "AB")]] == ["500", "503", "ok"]
    assert [x["action"] for x in actions[("p2", "BA")]] == ["slow", "ok"]
    assert [x["action"] for x in actions[("p3", "AB")]] == ["drop", "ok"]
    assert [x["action"] for x in actions[("p4", "BA")]] == ["garbage", "ok"]
    assert [x["action"] for x in actions[("p5", "AB")]] == ["429ms", "badjson", "ok"]
    assert len(srv.log) == 16 + 8  # 8 injected faults
    # Retry-After: 1 was honoured (the backoff alone would be ~0.01 s)
    t429, tok = actions[("p0", "AB")][0]["t"], actions[("p0", "AB")][1]["t"]
    assert tok - t429 >= 0.95
    assert "retries:" in r.stderr and "http-429 x2" in r.stderr


def test_a_live_reply_cut_off_at_the_token_cap_is_named(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.faults = {("judge-1", "p5", "BA"): ["cutoff", "cutoff"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *fast(srv)])
    assert r.exit_code == 1
    assert "unjudgeable" in r.stderr and "finish_reason 'length': raise --max-tokens" in r.stderr


def test_unparseable_verdict_fails_after_bounded_tries_then_rerun_retries_only_it(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.faults = {("judge-1", "p5", "BA"): ["forever-garbage"], ("judge-1", "p6", "AB"): ["400"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *fast(srv)])
        assert r.exit_code == 1
        assert "Error: 2 judgement(s) failed (1 unjudgeable: no verdict even when asked for it alone)" in r.stderr
        assert "Warning: judgement failed (judge-1, id 'p6', order AB): HTTP 400: context too long" in r.stderr
        asked = srv.requests_for(id="p5", order="BA")
        assert len(asked) == 2  # one re-ask by default, not the same request again and again
        re_asks = [x for x in srv.bodies if len(x["messages"]) == 3]
        assert len(re_asks) == 1 and re_asks[0]["messages"][1]["role"] == "assistant"
        assert "[[A]]" in re_asks[0]["messages"][2]["content"]  # asked differently: for the verdict alone
        assert len(srv.requests_for(id="p6", order="AB")) == 1  # a 400 is not retried
        res = json.loads((out / "results.json").read_text())
        j1 = res["judges"]["judge-1"]
        # p5 (a win) and p6 (a loss) are excluded: 2 wins, 1 loss, 3 ties of n = 6
        assert (j1["wins"], j1["losses"], j1["ties"], j1["n"], j1["failed_prompts"]) == (2, 1, 3, 6, 2)
        assert j1["awr"] == (2 + 1.5) / 6
        assert res["failed_judgements"] == 2 and res["n"] == 8 and res["unjudgeable_judgements"] == 1
        rows = [json.loads(x) for x in (out / "outcomes.jsonl").read_text().splitlines()]
        assert rows[5]["judges"]["judge-1"]["outcome"] is None and "verdict" in rows[5]["judges"]["judge-1"]["error"]
        assert "HTTP 400" in rows[6]["judges"]["judge-1"]["error"]

        srv.faults.clear()
        before = len(srv.log)
        r2 = cli([a, b, "-o", out, "--judge", "judge-1", *fast(srv)])
        assert r2.exit_code == 0, r2.stderr
        assert sorted((x["id"], x["order"]) for x in srv.log[before:]) == [("p5", "BA"), ("p6", "AB")]
    j1 = json.loads((out / "results.json").read_text())["judges"]["judge-1"]
    assert (j1["wins"], j1["losses"], j1["ties"], j1["n"], j1["awr"]) == (3, 2, 3, 8, 0.5625)


def test_retries_run_out_on_a_dead_server(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("m", i, o): ["503"] * 10 for i in IDS for o in ("AB", "BA")}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", "--max-retries", "2", *fast(srv)])
        assert len(srv.log) == 16 * 3
    assert r.exit_code == 1 and "16 judgement(s) failed" in r.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())["judges"]["m"]
    assert res["n"] == 0 and res["awr"] is None


def test_resume_after_a_server_that_dies_halfway_sends_no_request_twice(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.fail_after = 6  # after 6 answers every request gets a 503
        args = [a, b, "-o", out, "--judge", "judge-1", *fast(srv), "--max-retries", "0", "--concurrency", "1"]
        r1 = cli(args)
        assert r1.exit_code == 1 and "10 judgement(s) failed" in r1.stderr
        finished = {(x["id"], x["order"]) for x in srv.log if x["action"] == "ok"}
        assert len(finished) == 6
        srv.fail_after = None
        before = len(srv.log)
        r2 = cli(args)
        assert r2.exit_code == 0, r2.stderr
        second = [(x["id"], x["order"]) for x in srv.log[before:]]
        assert len(second) == 10 and not finished & set(second)
        r3 = cli(args)  # everything cached now: no request at all, the same table
        assert r3.exit_code == 0 and len(srv.log) == before + 10
    assert r2.stdout == r3.stdout
    j1 = json.loads((out / "results.json").read_text())["judges"]["judge-1"]
    assert (j1["wins"], j1["losses"], j1["ties"], j1["n"], j1["awr"]) == (3, 2, 3, 8, 0.5625)


def test_identical_answers_are_one_request_and_a_tie(tmp_path):
    a = write_gen(tmp_path, model="A")
    b = tmp_path / "b.jsonl"
    b.write_text(a.read_text())  # model B answered exactly like model A
    with JudgeServer(KEY) as srv:
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)])
        assert r.exit_code == 0, r.stderr
        assert len(srv.log) == 8  # the AB and BA prompts are the same text: asked once
    assert json.loads((tmp_path / "out" / "results.json").read_text())["judges"]["m"]["ties"] == 8


def test_redirect_is_not_followed(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("m", i, o): ["302"] for i in IDS for o in ("AB", "BA")}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)])
        assert len(srv.log) <= 4
    assert r.exit_code == 2 and "HTTP 302" in r.stderr and "not followed" in r.stderr


# --------------------------------------------------------------------------- secrets
def test_key_never_written_or_printed_even_when_echoed(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY, echo_auth=True) as srv:  # the reply quotes the Authorization header
        r = cli([a, b, "-o", out, "--judge", "m", *fast(srv)])
        assert r.exit_code == 0, r.stderr
    text = all_text_under(out) + r.stdout + r.stderr
    assert KEY not in text and "PLANTED" not in text
    assert "Bearer ***" in (out / "cache.jsonl").read_text()


def test_401_is_one_clear_error_without_retries_or_key(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer("sk-the-right-key") as srv:  # our planted key is wrong; the server echoes it back
        r = cli([a, b, "-o", out, "--judge", "m", "--max-retries", "5", *fast(srv)])
        n_requests = len(srv.log)
    assert r.exit_code == 2
    assert "HTTP 401" in r.stderr and "OPENAI_API_KEY" in r.stderr
    assert n_requests <= 4  # at most the requests already in flight (concurrency 4), none retried
    assert KEY not in r.stderr + r.stdout + all_text_under(out)
    assert "PLANTED" not in r.stderr + all_text_under(out)


def test_connection_refused_fails_cleanly_without_key(tmp_path, files):
    a, b = files
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    out = tmp_path / "out"
    r = cli([a, b, "-o", out, "--judge", "m", "--base-url", f"http://127.0.0.1:{port}/v1", "--max-retries", "1",
             "--retry-delay", "0.01", "--timeout", "0.5"])
    assert r.exit_code == 1
    assert "16 judgement(s) failed" in r.stderr
    assert "connection" in (out / "outcomes.jsonl").read_text().lower()
    assert KEY not in r.stderr + r.stdout + all_text_under(out)


def test_subprocess_error_output_has_no_key(tmp_path, files):
    # the real console script, a 401 that echoes the key: nothing on stdout/stderr or on disk
    a, b = files
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OPENAI_API_KEY=KEY)
    env.pop("DLLM_ALIGN_DEBUG", None)
    with JudgeServer("other") as srv:
        r = subprocess.run([sys.executable, "-m", "dllm_align", "judge", str(a), str(b), "-o", str(tmp_path / "o"),
                            "--judge", "m", "--base-url", srv.url], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("Error:") == 1 and "Traceback" not in r.stderr
    assert KEY not in r.stdout + r.stderr + all_text_under(tmp_path / "o")


def test_missing_key_names_the_variable(tmp_path, files):
    a, b = files
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "gpt-4o-mini", "--api-key-env", "MY_JUDGE_KEY"], key=None)
    assert r.exit_code == 2
    assert "MY_JUDGE_KEY" in r.stderr and "is not set" in r.stderr
    assert not (tmp_path / "out").exists()


def test_no_key_needed_with_empty_api_key_env(tmp_path, files):
    a, b = files
    with JudgeServer(api_key=None) as srv:
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "local", "--api-key-env", "", *fast(srv)], key=None)
    assert r.exit_code == 0, r.stderr


def test_scrubber_removes_whole_and_partial_keys():
    sc = judging.Scrubber(KEY)
    assert sc(f"bad key {KEY}!") == "bad key ***!"
    assert KEY[:12] not in sc(f"Incorrect API key provided: {KEY[:12]}****{KEY[-4:]}")
    assert sc("nothing secret here") == "nothing secret here"
    assert judging.Scrubber(None)("x") == "x"


def test_unknown_model_404_stops_with_exit_2(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("nope", i, o): ["404"] for i in IDS for o in ("AB", "BA")}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "nope", *fast(srv)])
    assert r.exit_code == 2 and "HTTP 404" in r.stderr and "'nope'" in r.stderr


# --------------------------------------------------------------------------- inputs
def test_ids_missing_or_extra_use_the_intersection_or_refuse_with_strict(tmp_path):
    a = write_gen(tmp_path, IDS[:6] + ["only-a"], model="A")
    b = write_gen(tmp_path, IDS[2:] + ["only-b1", "only-b2"], model="B")
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "rule:longer"])
    assert r.exit_code == 0, r.stderr
    assert "3 id(s) of" in r.stderr and "'only-a'" in r.stderr and "4 id(s) of" in r.stderr
    assert json.loads((tmp_path / "out" / "results.json").read_text())["n"] == 4
    r = cli([a, b, "-o", tmp_path / "strict", "--judge", "rule:longer", "--strict"])
    assert r.exit_code == 2 and "missing from" in r.stderr
    assert not (tmp_path / "strict").exists()


def test_different_prompts_for_the_same_id_are_an_error(tmp_path):
    a = write_gen(tmp_path, model="A")
    b = write_gen(tmp_path, model="B", prompt=lambda i: f"Question {i}?" if i != "p3" else "Another question")
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "rule:longer"])
    assert r.exit_code == 2
    assert "different prompts" in r.stderr and "'p3'" in r.stderr and "a.jsonl:4" in r.stderr and "b.jsonl:4" in r.stderr


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"id": "x", "prompt": "q"', "invalid JSON"),
        ('{"prompt": "q", "completion": "c"}', "missing 'id'"),
        ('{"id": "x", "prompt": "q"}', "missing 'completion'"),
        ('{"id": "x", "prompt": 3, "completion": "c"}', "'prompt' must be"),
        ('{"id": "x", "prompt": "q", "completion": [{"role": "user", "content": "c"}]}', "one assistant message"),
        ('{"id": "p0", "prompt": "q", "completion": "c"}', "duplicate id 'p0' (first at"),
        ('[1, 2]', "must be a JSON object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, line, problem):
    a = write_gen(tmp_path, model="A")
    with open(a, "a") as f:
        f.write("\n" + line + "\n")  # a blank line, then the bad row on line 10
    b = write_gen(tmp_path, model="B")
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "rule:longer"])
    assert r.exit_code == 2
    assert f"{a}:10: " in r.stderr and problem in r.stderr
    assert not (tmp_path / "out").exists()


def test_json_list_files_are_read(tmp_path):
    rows = [{"id": i, "prompt": f"Question {i}?", "completion": answer("A", i) + "!" * k} for k, i in enumerate(IDS)]
    a = tmp_path / "a.json"
    a.write_text(json.dumps(rows))
    b = write_gen(tmp_path, model="B")
    run = judging.judge_files(a, b, tmp_path / "out", JudgeSection(judges=["rule:longer"], bootstrap=200))
    # A's answer is longer than B's on every prompt except p0 (equal length)
    j = run.results["judges"]["rule:longer"]
    assert (j["wins"], j["ties"], j["losses"]) == (7, 1, 0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([rows[0], {"id": "z"}]))
    with pytest.raises(judging.UserError, match=r"bad.json: row 2: missing 'prompt'"):
        judging.read_generations(bad)


def test_template_file_is_validated_and_filled_in_one_pass(tmp_path, files):
    a, b = files
    bad = tmp_path / "bad.txt"
    bad.write_text("Judge {prompt} and {answer_a}. Verdict [[A]]/[[B]]/[[C]].")
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", "--template", bad])
    assert r.exit_code == 2 and "{answer_b}" in r.stderr and "missing placeholder" in r.stderr

    good = tmp_path / "good.txt"
    good.write_text("MY TEMPLATE {{json}} {unknown}\nQ: {prompt}\nFirst: {answer_a}\nSecond: {answer_b}\n")
    with JudgeServer(KEY) as srv:
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", "--template", good, *fast(srv)])
        assert r.exit_code == 0, r.stderr
        assert all(c.startswith("MY TEMPLATE {{json}} {unknown}\nQ: Question p") for c in srv.contents)
    assert "{unknown}" in r.stderr  # warned about, sent as written
    # placeholders inside an answer are not substituted again
    assert judging.render("{prompt}|{answer_a}|{answer_b}", "say {answer_b}", "x{prompt}", "y") == "say {answer_b}|x{prompt}|y"


def test_changing_the_template_or_judge_asks_again_but_reusing_it_does_not(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    tpl = tmp_path / "t.txt"
    tpl.write_text("{prompt} {answer_a} {answer_b} [[A]]")
    with JudgeServer(KEY) as srv:
        assert cli([a, b, "-o", out, "--judge", "m", *fast(srv)]).exit_code == 0
        assert cli([a, b, "-o", out, "--judge", "m", *fast(srv)]).exit_code == 0
        assert len(srv.log) == 16
        assert cli([a, b, "-o", out, "--judge", "m", "--template", tpl, *fast(srv)]).exit_code == 0
        assert len(srv.log) == 32
        assert cli([a, b, "-o", out, "--judge", "m", "--judge", "m2", *fast(srv)]).exit_code == 0
        assert len(srv.log) == 48  # only m2's 16 are new


def test_recipe_judge_section_gives_defaults(tmp_path, files):
    a, b = files
    rec = tmp_path / "r.yaml"
    rec.write_text("judge:\n  judges: ['rule:longer', 'rule:exact-match']\n  bootstrap: 300\n  seed: 4\n")
    r = cli([a, b, "-o", tmp_path / "out", "--recipe", rec], key=None)
    # rule:exact-match needs a reference field: a clear input error naming the id
    assert r.exit_code == 2 and "reference" in r.stderr and "'p0'" in r.stderr
    a2 = write_gen(tmp_path, model="A", name="a2.jsonl", extra={"reference": answer("A", "p0")})
    r = cli([a2, b, "-o", tmp_path / "out", "--recipe", rec], key=None)
    assert r.exit_code == 0, r.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["settings"]["bootstrap_resamples"] == 300 and res["settings"]["seed"] == 4
    em = res["judges"]["rule:exact-match"]
    assert (em["wins"], em["losses"], em["ties"]) == (1, 0, 7)  # only A's p0 equals the reference
    assert "cohen_kappa" in res
    r = cli([a, b, "-o", tmp_path / "o3", "--recipe", rec, "--concurrency", "0"], key=None)
    assert r.exit_code == 2 and "--concurrency" in r.stderr
    r = cli([a, b, "-o", tmp_path / "o3", "-j", "x", "-j", "y", "-j", "z"], key=None)
    assert r.exit_code == 2 and "--judge" in r.stderr


# --------------------------------------------------------------------------- rules and parsing
def test_rule_registry_and_module_rules(tmp_path, files):
    a, b = files

    @judging.register_rule("prefer-b-marker", replace=True)
    def prefer_b(prompt, first, second):
        return "A" if "<<B-" in first else "B" if "<<B-" in second else "C"

    run = judging.judge_files(a, b, tmp_path / "out", JudgeSection(judges=["rule:prefer-b-marker"], bootstrap=200))
    assert run.results["judges"]["rule:prefer-b-marker"]["losses"] == 8
    with pytest.raises(ValueError, match="already registered"):
        judging.register_rule("prefer-b-marker", prefer_b)
    judging.register_scorer("len-score", lambda p, ans, ref: -len(ans), replace=True)
    assert "len-score" in judging.rule_names() and "longer" in judging.rule_names()

    mod = tmp_path / "my_rules.py"
    mod.write_text("def first_wins(prompt, a, b):\n    return 'A'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        run = judging.judge_files(a, b, tmp_path / "out2", JudgeSection(judges=["rule:my_rules:first_wins"], bootstrap=200))
    finally:
        sys.path.remove(str(tmp_path))
    assert run.results["judges"]["rule:my_rules:first_wins"]["ties"] == 8  # a position-biased rule
    r = cli([a, b, "-o", tmp_path / "o", "--judge", "rule:longr"], key=None)
    assert r.exit_code == 2 and "did you mean 'rule:longer'" in r.stderr


def test_parse_verdict():
    assert judging.parse_verdict("Analysis...\n[[A]]") == "A"
    assert judging.parse_verdict("Not [[B]] as one might think. Final: [[ C ]]") == "C"
    assert judging.parse_verdict("A is better") is None
    assert judging.parse_verdict("[A]") is None
    assert judging.parse_verdict("") is None


def test_prompt_and_completion_layouts():
    assert judging.prompt_text([{"role": "user", "content": "hi"}]) == "hi"
    assert judging.prompt_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]) == "System: be brief\n\nUser: hi"
    assert judging.prompt_text([{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]) == "hi"
    assert judging.completion_text([{"role": "assistant", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError):
        judging.completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_retry_after_parsing():
    assert _retry_after({"retry-after": "2"}) == 2.0
    assert _retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert _retry_after({}) is None
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < _retry_after({"retry-after": date}) <= 31


def test_help_has_an_example():
    r = runner.invoke(app, ["judge", "--help"])
    assert r.exit_code == 0 and "Example: dllm-align judge" in r.stdout


def test_summarize_outcomes_excludes_unfinished_prompts_per_judge_and_for_the_pair():
    res = judging.summarize_outcomes({"j1": [1, None, -1, 0], "j2": [1, 1, None, 0]}, bootstrap=200)
    j1, j2 = res["judges"]["j1"], res["judges"]["j2"]
    assert (j1["n"], j1["failed_prompts"], j1["awr"]) == (3, 1, 0.5)           # win, loss, tie
    assert (j2["n"], j2["failed_prompts"], j2["awr"]) == (3, 1, (2 + 0.5) / 3)  # win, win, tie
    mv = res["majority_vote"]  # prompts 0 and 3 only: win/win -> win, tie/tie -> tie
    assert (mv["n"], mv["wins"], mv["ties"], mv["awr"]) == (2, 1, 1, 0.75)
    assert res["cohen_kappa"] == {"value": 1.0, "ci90": [1.0, 1.0], "n": 2}


def interrupt_judge(args: list, ready, pause: float) -> tuple[int, str, float]:
    """Run `dllm-align judge ARGS` in a real interpreter, wait until ``ready()``,
    then ``pause`` seconds, send SIGINT; return (exit code, stderr, seconds to exit).

    The child gets SIGINT's default disposition back before it starts: a suite run in the
    background, under nohup or by a runner that ignores SIGINT would otherwise hand the ignored
    signal down, Python would install no KeyboardInterrupt handler, and Ctrl-C would do nothing."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OPENAI_API_KEY=KEY)
    env.pop("DLLM_ALIGN_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "dllm_align", "judge", *[str(x) for x in args]],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(pause)
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        return proc.returncode, err, time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_works_when_the_suite_was_launched_with_sigint_ignored(tmp_path, files):
    """What `nohup`, `cmd &` in a script, or a CI runner does to the suite must not change the outcome."""
    a, b = files
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as such a launcher leaves it
    try:
        with JudgeServer(KEY) as srv:
            srv.hold_after = 0  # every request hangs
            code, err, _ = interrupt_judge([a, b, "-o", tmp_path / "out", "--judge", "m", "--base-url", srv.url, "--timeout", "60"],
                                           srv.held.is_set, 0.3)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and "Interrupted" in err


def test_ctrl_c_exits_130_at_once_and_keeps_the_cache(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.hold_after = 3  # then every request hangs (the timeout is 60 s)
        code, err, elapsed = interrupt_judge([a, b, "-o", tmp_path / "out", "--judge", "m", "--base-url", srv.url, "--timeout", "60",
                                              "--concurrency", "4"], srv.held.is_set, 0.3)
        n_held = len(srv.requests_for(action="held"))
    assert code == 130 and "Interrupted" in err
    assert elapsed < 20  # requests in flight are cut, not waited for (their timeout is 60 s)
    assert n_held <= 4  # no new request after Ctrl-C
    assert len((tmp_path / "out" / "cache.jsonl").read_text().splitlines()) == 3


def test_a_full_disk_never_leaves_results_without_outcomes(tmp_path, files, monkeypatch):
    """results.json is the run's record of being done: it is written last, so a write that fails on a full
    disk leaves no results.json pointing at per-prompt outcomes that are not there."""
    import errno

    real = judging.atomic_write_json

    def full_disk(path, obj, *a, **k):
        if Path(path).name == "results.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj, *a, **k)

    monkeypatch.setattr(judging, "atomic_write_json", full_disk)
    a, b = files
    with pytest.raises(OSError):
        judging.judge_files(a, b, tmp_path / "out", JudgeSection(judges=["rule:longer"], bootstrap=200))
    assert (tmp_path / "out" / "outcomes.jsonl").is_file() and not (tmp_path / "out" / "results.json").exists()
