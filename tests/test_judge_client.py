"""judge_client.py: the openai SDK over the guarded httpx2 transport.

Transport faults as a class: every response has a total
deadline and a size cap, Ctrl-C always stops, errors name the URL actually
requested, a failed first request leaves no cache file. And the SDK's
ambient settings (OPENAI_CUSTOM_HEADERS, OPENAI_ORG_ID, OPENAI_API_KEY for a
server without a key, proxies) never reach the request.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from dllm_align.judge import client as judge_client
from dllm_align.core.errors import UserError
from judge_server import JudgeServer
from test_judging import IDS, J1, KEY, cli, fast, interrupt_judge, script, write_gen



@pytest.fixture()
def files(tmp_path):
    return write_gen(tmp_path, model="A"), write_gen(tmp_path, model="B")


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["judges"]


# --------------------------------------------------------------------------- deadline, size cap
@pytest.mark.parametrize("fault", ["endless", "slowheaders"])
def test_a_response_that_never_ends_is_cut_at_the_deadline_and_retried(tmp_path, files, fault):
    a, b = files
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.faults = {("judge-1", "p0", "AB"): [fault], ("judge-1", "p1", "BA"): [fault]}
        t = time.monotonic()
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "judge-1", *fast(srv), "--timeout", "1"])
        elapsed = time.monotonic() - t
        acts = [x["action"] for x in srv.requests_for(id="p0", order="AB")]
    assert r.exit_code == 0, r.stderr
    assert acts == [fault, "ok"]  # cut, then asked again
    assert "timeout x2" in r.stderr
    assert elapsed < 15  # two 1 s deadlines, not the server's 60 s stream
    j = _results(tmp_path / "out")["judge-1"]
    assert (j["wins"], j["losses"], j["ties"]) == (3, 2, 3)


def test_an_enormous_body_is_not_read_past_the_cap(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("m", "p0", "AB"): ["huge"]}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv), "--timeout", "20"])
    assert r.exit_code == 1, r.stderr
    assert "larger than 8 MiB" in r.stderr and "1 judgement(s) failed" in r.stderr
    assert len(srv.requests_for(id="p0", order="AB")) == 1  # not asked again: it would be as large again


def test_ctrl_c_stops_a_body_that_never_ends(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("m", i, o): ["endless"] for i in IDS for o in ("AB", "BA")}
        code, err, elapsed = interrupt_judge([a, b, "-o", tmp_path / "out", "--judge", "m", "--base-url", srv.url, "--timeout", "120",
                                              "--concurrency", "4"], lambda: len(srv.log) >= 4, 0.5)  # the bodies are streaming
    assert code == 130 and "Interrupted" in err
    assert elapsed < 20  # the body is cut, not read until the 120 s timeout
    assert not (tmp_path / "out" / "cache.jsonl").exists()


# --------------------------------------------------------------------------- messages and files
def test_errors_show_the_url_actually_requested(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("nope", i, o): ["404"] for i in IDS for o in ("AB", "BA")}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "nope", *fast(srv)])
    assert r.exit_code == 2
    assert f"HTTP 404 from {srv.url}/chat/completions " in r.stderr
    assert "/v1/v1" not in r.stderr


def test_a_wrong_base_path_names_the_path_that_was_asked_for(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv), "--base-url", srv.url + "/v1"])
    assert r.exit_code == 2
    assert f"{srv.url}/v1/chat/completions" in r.stderr and "no route /v1/v1/chat/completions" in r.stderr


@pytest.mark.parametrize("fault, code", [("401", 2), ("400", 1)])
def test_a_failed_first_request_leaves_no_cache_file(tmp_path, files, fault, code):
    a, b = files
    with JudgeServer(KEY if fault != "401" else "sk-other") as srv:
        srv.faults = {("m", i, o): [fault] for i in IDS for o in ("AB", "BA")}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)])
    assert r.exit_code == code, r.stderr
    assert not (tmp_path / "out" / "cache.jsonl").exists()


# --------------------------------------------------------------------------- the key and the environment
def test_a_key_is_never_sent_over_plain_http_to_another_host():
    with pytest.raises(UserError, match="unencrypted"):
        judge_client.check_base_url("http://judge.example.com/v1", has_key=True)
    assert judge_client.check_base_url("http://judge.example.com/v1/", has_key=True, allow_plain_http=True) == "http://judge.example.com/v1"
    assert judge_client.check_base_url("http://judge.example.com/v1", has_key=False)  # no key: nothing to leak
    for local in ("http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1", "http://127.0.0.2/v1"):
        assert judge_client.check_base_url(local, has_key=True)
    assert judge_client.check_base_url("https://api.openai.com/v1", has_key=True)


def test_plain_http_to_another_host_is_refused_before_any_request(tmp_path, files):
    a, b = files
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", "--base-url", "http://judge.example.com/v1"])
    assert r.exit_code == 2 and "unencrypted" in r.stderr and "--allow-plain-http" in r.stderr
    assert not (tmp_path / "out").exists()


def test_ambient_sdk_settings_never_reach_the_server(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        env = {"OPENAI_CUSTOM_HEADERS": "Authorization: Bearer sk-ambient\nX-Leak: 1", "OPENAI_ORG_ID": "org-ambient",
               "OPENAI_PROJECT_ID": "proj-ambient", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)], **env)
        assert r.exit_code == 0, r.stderr
        heads = [{k.lower(): v for k, v in h.items()} for h in srv.headers]
    assert len(heads) == 16
    assert all(h["authorization"] == f"Bearer {KEY}" for h in heads)
    assert not any("x-leak" in h or "openai-organization" in h or "openai-project" in h for h in heads)


def test_a_server_without_a_key_gets_no_key_even_if_openai_api_key_is_set(tmp_path, files):
    a, b = files
    with JudgeServer(api_key=None) as srv:
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "local", "--api-key-env", "", *fast(srv)],
                key=KEY, OPENAI_ADMIN_KEY="sk-admin-ambient")
        assert r.exit_code == 0, r.stderr
        assert all("authorization" not in {k.lower() for k in h} for h in srv.headers)


def test_the_environment_proxy_is_used_only_when_asked(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as target, JudgeServer(None) as proxy:
        env = {"HTTP_PROXY": proxy.url.removesuffix("/v1"), "http_proxy": proxy.url.removesuffix("/v1"), "NO_PROXY": "", "no_proxy": ""}
        r = cli([a, b, "-o", tmp_path / "o1", "--judge", "m", *fast(target)], **env)
        assert r.exit_code == 0 and proxy.paths == [] and len(target.log) == 16
        r = cli([a, b, "-o", tmp_path / "o2", "--judge", "m", *fast(target), "--env-proxy", "--concurrency", "1"], **env)
        # the proxy (a plain judge server) gets the absolute URL, answers 404, and the run stops
        assert r.exit_code == 2 and proxy.paths and proxy.paths[0].startswith(target.url)
        assert len(target.log) == 16


def test_off_base_url_requests_are_refused_by_the_transport():
    stop = threading.Event()
    client = judge_client.ChatClient("http://127.0.0.1:9/v1", None, stop=stop, max_retries=0)
    try:
        with pytest.raises(judge_client.FatalApiError, match="outside --base-url"):
            client.call(lambda sdk: sdk.with_options(base_url="http://127.0.0.1:9/other/").models.list(), "a list of models")
    finally:
        client.close()


# --------------------------------------------------------------------------- reasoning models
def test_reasoning_models_work_through_max_completion_tokens(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.reasoning_models = {"o-judge"}
        script(srv, "o-judge", J1)
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "o-judge", *fast(srv)])
        assert r.exit_code == 1 and "--max-completion-tokens" in r.stderr  # the hint on a 400 about max_tokens
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "o-judge", *fast(srv), "--max-completion-tokens", "4000", "--no-temperature"])
        assert r.exit_code == 0, r.stderr
        last = srv.bodies[-16:]
    assert all(x["max_completion_tokens"] == 4000 and "max_tokens" not in x and "temperature" not in x for x in last)
    j = _results(tmp_path / "out")["o-judge"]
    assert (j["wins"], j["losses"], j["ties"]) == (3, 2, 3)
    settings = json.loads((tmp_path / "out" / "results.json").read_text())["settings"]
    assert settings["max_completion_tokens"] == 4000 and settings["temperature"] is None and settings["max_tokens"] is None


@pytest.mark.parametrize("fault, asked", [("429-hour", "Retry-After: 3600: a wait of 3,600 s"), ("429-year", "a wait of 31,5")])
def test_a_server_asking_for_hours_is_not_asked_again(tmp_path, files, fault, asked):
    """Every request answered 429 with Retry-After an hour (or an HTTP date a year) ahead: the judge sends no
    request after the first such answer (it waited judge.retry_after_max per request and retry before: ten
    minutes for 80 judgements), and exits 1 saying when the server asked to be retried and how to go on."""
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.faults = {("m", i, o): [fault] * 20 for i in IDS for o in ("AB", "BA")}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv), "--max-retries", "6"])
        sent = list(srv.log)
    assert r.exit_code == 1, r.stderr
    assert 1 <= len(sent) <= 4 and all(x["action"] == fault for x in sent)  # the requests in flight at most, none retried
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert f"{srv.url} asked to be retried after " in line and asked in line and "judge.retry_after_max 60 s" in line
    assert "run the same command again after that time" in line
    assert "Hint: 0 of 16 judgements are in" in r.stderr
    assert r.stdout == "" and not (tmp_path / "out" / "results.json").exists()


def test_requests_in_flight_finish_and_are_kept_when_a_server_asks_for_an_hour(tmp_path, files):
    """Four requests in flight; one is answered "come back in an hour", the other three answer slowly: those
    three finish and are cached, nothing else is sent, and the rerun asks only for the 13 others."""
    a, b = files
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "m", J1)
        srv.long_wait_after = 4  # the 429 leaves once all four requests have arrived
        srv.faults = {("m", "p0", "AB"): ["429-hour"], ("m", "p0", "BA"): ["slow"], ("m", "p1", "AB"): ["slow"], ("m", "p1", "BA"): ["slow"]}
        r = cli([a, b, "-o", out, "--judge", "m", *fast(srv), "--timeout", "10"])
        assert r.exit_code == 1, r.stderr
        assert sorted((x["id"], x["order"], x["action"]) for x in srv.log) == [
            ("p0", "AB", "429-hour"), ("p0", "BA", "slow"), ("p1", "AB", "slow"), ("p1", "BA", "slow")]
        cached = [json.loads(x) for x in (out / "cache.jsonl").read_text().splitlines()]
        assert sorted((c["id"], c["order"]) for c in cached) == [("p0", "BA"), ("p1", "AB"), ("p1", "BA")]
        assert "Hint: 3 of 16 judgements are in" in r.stderr
        again = cli([a, b, "-o", out, "--judge", "m", *fast(srv)])  # the server answers now
        assert again.exit_code == 0, again.stderr
        assert len(srv.log) == 4 + 13  # only the judgements not cached
    j = _results(out)["m"]
    assert (j["wins"], j["losses"], j["ties"]) == (3, 2, 3)


def test_retry_after_cap_is_bounded_and_documented():
    from dllm_align.config.schema import JudgeSection

    assert JudgeSection().retry_after_max == 60.0
    with pytest.raises(Exception):
        JudgeSection(retry_after_max=float("inf"))


def test_a_reply_from_another_model_than_asked_is_said_once(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.answer_as = {"m": "cheap-model"}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)])
    assert r.exit_code == 0, r.stderr
    assert r.stderr.count("answered as 'cheap-model'") == 1 and "for model 'm'" in r.stderr


def test_a_dated_snapshot_of_the_asked_model_is_the_same_model(tmp_path, files):
    a, b = files
    with JudgeServer(KEY) as srv:
        srv.answer_as = {"m": "m-2024-07-18"}
        r = cli([a, b, "-o", tmp_path / "out", "--judge", "m", *fast(srv)])
    assert r.exit_code == 0 and "answered as" not in r.stderr
