"""judge_batch.py and `judge --batch`: the Batch API against the local fake server.

Exact numbers through a batch; faults at every endpoint (429, 500, dropped
connections), partial errors, an expired and a failed batch, each failed
request retried live or in a new batch and never one that is cached; a run
killed at every stage (before upload, after upload, after create, while
polling, while downloading) continues its own batch and sends no request twice.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from judge_server import JudgeServer
from reliability import run_cli, run_killed
from test_judging import J1, KEY, cli, fast, interrupt_judge, script, write_gen


@pytest.fixture()
def files(tmp_path):
    return write_gen(tmp_path, model="A"), write_gen(tmp_path, model="B")


def batch_args(srv: JudgeServer, *extra) -> list:
    return [*fast(srv), "--batch", "--batch-poll", "0.01", *extra]


def exact(out: Path) -> tuple:
    j = json.loads((out / "results.json").read_text())["judges"]["judge-1"]
    return j["wins"], j["losses"], j["ties"], j["n"], j["awr"]


def uploaded_keys(srv: JudgeServer) -> list[list[str]]:
    return [[json.loads(x)["custom_id"] for x in data.decode().splitlines()] for _, data in srv.uploads]


def test_batch_gives_the_exact_numbers_without_live_requests(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        assert srv.log == []  # no live chat request
        assert sorted(collections.Counter(srv.batch_log).values()) == [1] * 16
        assert len(srv.uploads) == 1 and len(srv.batches) == 1
        # rerun: everything cached, nothing uploaded or created again
        r2 = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r2.exit_code == 0 and len(srv.uploads) == 1 and len(srv.batches) == 1 and srv.log == []
    assert exact(out) == (3, 2, 3, 8, 0.5625)
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["mode"] == "batch" and res["usage"]["judge-1"]["batch"] == 16
    state = json.loads((out / "batch_state.json").read_text())
    assert [x["status"] for x in state["batches"]] == ["done"]
    # the request file as uploaded: model, messages, parameters; one line per distinct judgement
    line = json.loads((out / "batches" / "batch-0001.input.jsonl").read_text().splitlines()[0])
    assert line["method"] == "POST" and line["url"] == "/v1/chat/completions"
    assert set(line["body"]) == {"model", "messages", "temperature", "max_tokens"}


def test_batch_faults_and_partial_errors_are_retried_live_and_counted_exactly(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.route_faults = {"files.create": ["429", "500"], "batches.create": ["drop"], "batches.retrieve": ["500", "429", "drop"],
                            "files.content": ["drop", "500"], "files.list": ["429"], "batches.list": ["500"]}
        srv.batch_faults = {("judge-1", "p2", "AB"): ["error"], ("judge-1", "p3", "BA"): ["500"], ("judge-1", "p4", "AB"): ["garbage"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        faults_seen = [x for x in srv.api_log if x[1] != "ok"]
        live = sorted((x["id"], x["order"]) for x in srv.log)
        uploads, creates = len(srv.uploads), len(srv.batches)
        batch_counts = collections.Counter(srv.batch_log)
    assert len(faults_seen) == 10  # every injected fault happened, and was retried
    assert uploads == 1 and creates == 1  # a dropped create was looked up, not repeated
    assert live == [("p2", "AB"), ("p3", "BA"), ("p4", "AB")]  # exactly the three that failed inside the batch
    assert sorted(batch_counts.values()) == [1] * 16
    assert exact(out) == (3, 2, 3, 8, 0.5625)
    assert "3 failed" in r.stderr and "Retrying 3 judgement(s) that failed in the batch live" in r.stderr
    usage = json.loads((out / "results.json").read_text())["usage"]["judge-1"]
    assert (usage["batch"], usage["live"]) == (13, 3)


def test_an_upload_and_a_create_that_time_out_after_the_server_acted_are_not_repeated(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.route_faults = {"files.create": ["act-then-hang"], "batches.create": ["act-then-hang"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv), "--timeout", "1"])
        assert r.exit_code == 0, r.stderr
        assert len(srv.uploads) == 1 and len(srv.batches) == 1  # found on the retry, not made again
        assert sorted(collections.Counter(srv.batch_log).values()) == [1] * 16
    assert exact(out) == (3, 2, 3, 8, 0.5625)


def test_an_expired_batch_continues_in_a_new_batch_with_only_the_missing_requests(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.expire_after = 10  # the first batch answers 10 of 16, then expires
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv, "--batch-failed", "batch")])
        assert r.exit_code == 0, r.stderr
        first, second = uploaded_keys(srv)
        statuses = [x["status"] for x in srv.batches.values()]
        assert srv.log == []
        assert sorted(collections.Counter(srv.batch_log).values()) == [1] * 16
    assert len(first) == 16 and len(second) == 6 and not set(second) & set(first[:10])
    assert statuses == ["expired", "completed"]
    assert exact(out) == (3, 2, 3, 8, 0.5625)
    assert "batch_expired" in (out / "batches" / "batch-0001.errors.jsonl").read_text()


def test_a_failed_batch_is_retried_live(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.fail_batches = 1
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        assert len(srv.log) == 16 and srv.batch_log == []
    assert "failed" in r.stderr and "the batch failed validation" not in r.stdout
    assert exact(out) == (3, 2, 3, 8, 0.5625)


def test_requests_still_failing_after_the_last_batch_round_are_reported(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_faults = {("judge-1", "p5", "AB"): ["error", "error"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv, "--batch-failed", "batch")])
        assert r.exit_code == 0, r.stderr  # the second round answered it
        srv.batch_faults = {("judge-1", "p6", "BA"): ["error"] * 5}
        before = len(srv.batch_log)
        r = cli([a, b, "-o", tmp_path / "o2", "--judge", "judge-1", *batch_args(srv, "--batch-failed", "batch")])
        assert r.exit_code == 1 and "1 judgement(s) failed" in r.stderr  # 3 rounds, 3 errors
        assert srv.batch_log[before:].count(("judge-1", "p6", "BA")) == 3 and len(srv.batch_log) - before == 16 + 2
    rows = [json.loads(x) for x in (tmp_path / "o2" / "outcomes.jsonl").read_text().splitlines()]
    assert "server_error" in rows[6]["judges"]["judge-1"]["error"]


# --------------------------------------------------------------------------- kill and rerun at every stage
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted batch run: the numbers every killed-and-rerun run must end with."""
    root = tmp_path_factory.mktemp("batch_straight")
    a, b = write_gen(root, model="A"), write_gen(root, model="B")
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        r = run_cli(["judge", a, b, "-o", root / "out", "--judge", "judge-1", *batch_args(srv), "--json"], env={"OPENAI_API_KEY": KEY})
        assert r.code == 0, r.err
    return {"a": a, "b": b, "results": json.loads(r.out)}


@pytest.mark.parametrize("stage, uploads_before, batches_before", [
    ("batch_before_upload", 0, 0),
    ("batch_after_upload", 1, 0),   # uploaded, the file id not yet recorded
    ("batch_after_create", 1, 1),   # created, the batch id not yet recorded
    ("batch_polling", 1, 1),        # running on the server
    ("batch_downloading", 1, 1),    # results downloaded, not yet cached
])
def test_a_run_killed_at_each_batch_stage_continues_its_own_batch(tmp_path, straight, stage, uploads_before, batches_before):
    a, b = straight["a"], straight["b"]
    out = tmp_path / "out"
    env = {"OPENAI_API_KEY": KEY}
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_polls = 3
        args = ["judge", a, b, "-o", out, "--judge", "judge-1", *batch_args(srv), "--json"]
        k = run_killed(args, f"kill_at:{stage}", env=env)
        assert k.code == -9, k.err
        assert (len(srv.uploads), len(srv.batches)) == (uploads_before, batches_before)
        assert not (out / "cache.jsonl").exists()
        r = run_cli(args, env=env)
        assert r.code == 0, r.err
        assert len(srv.uploads) == 1 and len(srv.batches) == 1  # its own batch, continued
        assert sorted(collections.Counter(srv.batch_log).values()) == [1] * 16  # no request twice
        assert srv.log == []
    res = json.loads(r.out)
    assert res["judges"] == straight["results"]["judges"]
    assert len((out / "cache.jsonl").read_text().splitlines()) == 16


def test_a_live_run_refuses_while_a_batch_of_the_same_folder_is_unfinished(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    env = {"OPENAI_API_KEY": KEY}
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_polls = 3
        args = ["judge", a, b, "-o", out, "--judge", "judge-1", *fast(srv)]
        assert run_killed(args + ["--batch", "--batch-poll", "0.01"], "kill_at:batch_polling", env=env).code == -9
        r = run_cli(args, env=env)  # without --batch
        assert r.code == 2 and "batch-0001" in r.err and "--batch" in r.err
        assert srv.log == []  # nothing was asked live
        r = run_cli(args + ["--batch", "--batch-poll", "0.01"], env=env)
        assert r.code == 0, r.err
        r = run_cli(args, env=env)  # all cached: the live run has nothing to ask
        assert r.code == 0 and srv.log == []
    assert exact(out) == (3, 2, 3, 8, 0.5625)


def test_two_judges_get_one_batch_each_and_large_sets_are_split(tmp_path, files, monkeypatch):
    from dllm_align.judge import batch as judge_batch

    a, b = files
    out = tmp_path / "out"
    monkeypatch.setattr(judge_batch, "MAX_REQUESTS", 10)
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        r = cli([a, b, "-o", out, "--judge", "judge-1", "--judge", "judge-2", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        models = [{json.loads(x)["body"]["model"] for x in data.decode().splitlines()} for _, data in srv.uploads]
        sizes = [len(data.decode().splitlines()) for _, data in srv.uploads]
        assert sorted(collections.Counter(srv.batch_log).values()) == [1] * 32
    assert models == [{"judge-1"}, {"judge-1"}, {"judge-2"}, {"judge-2"}] and sizes == [10, 6, 10, 6]
    assert exact(out) == (3, 2, 3, 8, 0.5625)


def test_ctrl_c_while_polling_stops_at_once_and_the_rerun_collects_the_same_batch(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_polls = 10_000  # still running when Ctrl-C comes
        args = [a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)]
        code, err, elapsed = interrupt_judge(args, lambda: ("batches.retrieve", "ok") in srv.api_log, 0.3)
        assert code == 130 and "Interrupted" in err and elapsed < 20  # not the next poll (up to 300 s away)
        srv.batch_polls = 1
        r = cli(args)
        assert r.exit_code == 0, r.stderr
        assert len(srv.uploads) == 1 and len(srv.batches) == 1 and srv.log == []
    assert "Continuing batch-0001" in r.stderr
    assert exact(out) == (3, 2, 3, 8, 0.5625)


def test_result_file_oddities_are_counted_exactly(tmp_path, files):
    """One id answered twice with different verdicts is taken from neither answer (first-wins had moved
    the counts from 3/2/3 to 2/1/5) and put into one new batch, never asked live; the same answer twice is
    one answer; an error line beside a good answer is no failure; a reply cut off at the token cap says so."""
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_faults = {("judge-1", "p1", "AB"): ["dup-conflict"], ("judge-1", "p2", "BA"): ["dup-same"],
                            ("judge-1", "p3", "AB"): ["error-then-ok"], ("judge-1", "p5", "BA"): ["cutoff"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        live = sorted((x["id"], x["order"]) for x in srv.log)
        second = uploaded_keys(srv)[1:]
    assert live == [("p5", "BA")]  # the cut-off reply, retried live; nothing else
    state = json.loads((out / "batch_state.json").read_text())["batches"]
    assert len(state) == 2 and second == [[k for k in state[1]["keys"]]] and list(state[1]["keys"].values()) == [["judge-1", "p1", "AB"]]
    assert "2 failed" in r.stderr and "answered more than once with different verdicts" in r.stderr
    assert "Submitting the 1 request(s) whose results conflicted in one new batch (not asked live)" in r.stderr
    assert exact(out) == (3, 2, 3, 8, 0.5625)  # the script's numbers, unmoved


@pytest.mark.parametrize("batch_failed", ["live", "batch"])
def test_a_result_file_that_conflicts_for_every_id_is_decided_by_one_new_batch(tmp_path, files, batch_failed):
    """Every id answered twice with conflicting verdicts, in every batch the server runs: the ids go into one
    new batch, and what conflicts there too fails with the reason (exit 1); nothing is asked live, and no third
    batch is made (before: 142 live retries, 17 of 80 judgements failed after 150 s)."""
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_faults = {("judge-1", i, o): ["dup-conflict"] * 5 for i in J1 for o in ("AB", "BA")}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv, "--batch-failed", batch_failed)])
        assert srv.log == [] and len(srv.batches) == 2, r.stderr
        assert sorted(uploaded_keys(srv)[0]) == sorted(uploaded_keys(srv)[1])  # all 16 requests, once more
    assert r.exit_code == 1 and "16 judgement(s) failed" in r.stderr, r.stderr
    rows = [json.loads(x) for x in (out / "outcomes.jsonl").read_text().splitlines()]
    err = rows[0]["judges"]["judge-1"]["error"]
    assert "answers this request 2 times with different verdicts" in err and "; in the new batch: batch " in err


def test_conflicting_results_settled_by_the_new_batch_give_the_exact_numbers(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_faults = {("judge-1", i, o): ["dup-conflict"] for i in J1 for o in ("AB", "BA")}  # the first batch only
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        assert srv.log == [] and len(srv.batches) == 2
    assert exact(out) == (3, 2, 3, 8, 0.5625)


def test_a_reply_cut_off_at_the_token_cap_is_named(tmp_path, files):
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.batch_faults = {("judge-1", "p5", "BA"): ["cutoff"] * 3}  # in every batch round
        cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv, "--batch-failed", "batch")])
    rows = [json.loads(x) for x in (out / "outcomes.jsonl").read_text().splitlines()]
    err = next(r_["judges"]["judge-1"].get("error", "") for r_ in rows if r_["id"] == "p5")
    assert "finish_reason 'length'" in err and "--max-tokens" in err


def test_a_batch_the_server_no_longer_knows_is_resubmitted_on_the_next_run(tmp_path, files):
    """A 404 for a batch (expired or deleted on the server) answered every rerun with the same 404 and no
    hint; now the run says what happened and how to go on, and the rerun submits a new batch."""
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.route_faults = {"batches.retrieve": ["404"]}
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code != 0 and "no longer knows batch" in r.stderr and "run the same command again" in r.stderr
        r = cli([a, b, "-o", out, "--judge", "judge-1", *batch_args(srv)])
        assert r.exit_code == 0, r.stderr
        assert len(srv.batches) == 2  # the lost one, and its replacement
    assert exact(out) == (3, 2, 3, 8, 0.5625)
