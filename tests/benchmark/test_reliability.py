"""The reliability suite's judgement (on made-up outcomes) and one tiny live soak."""

import json
import random

import pytest

from qserve.runtime.benchmark.reliability import parse_checks
from qserve.runtime.benchmark.reliability_client import RequestOutcome
from qserve.runtime.benchmark.reliability_fuzz import classify_response
from qserve.runtime.benchmark.reliability_overload import judge_rejections, rejection_problem
from qserve.runtime.benchmark.reliability_quantize import temp_dirs
from qserve.runtime.benchmark.reliability_result import (CheckResult, percentiles_ms,
                                                         summary_table, write_json_atomic)
from qserve.runtime.benchmark.reliability_server import (ServeOptions, is_drained,
                                                         openai_error_problem,
                                                         parse_prometheus)
from qserve.runtime.benchmark.reliability_sigterm import (StreamEnd, judge_sigterm,
                                                          stream_verdict)
from qserve.runtime.benchmark.reliability_soak import (SoakConfig, judge_soak, plan_requests,
                                                       run_soak, tally)

ERR = {"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                 "code": "invalid_value"}}


def outcome(**kw) -> RequestOutcome:
    base = dict(index=0, api="chat", stream=True, planned_leave=False)
    return RequestOutcome(**{**base, **kw})


def test_openai_error_shape():
    assert openai_error_problem(ERR) is None
    assert "no top-level" in openai_error_problem({"detail": "Not Found"})
    assert "lacks param, code" in openai_error_problem({"error": {"message": "m", "type": "t"}})
    assert "message is a int" in openai_error_problem(
        {"error": {"message": 3, "type": "t", "param": None, "code": None}})


def test_fuzz_response_classification():
    assert classify_response(500, "application/json", json.dumps(ERR).encode()).startswith(
        "HTTP 500")
    assert classify_response(400, "application/json", json.dumps(ERR).encode()) is None
    assert "not an OpenAI error" in classify_response(
        422, "application/json", b'{"detail": [{"loc": ["body"]}]}')
    assert "not JSON" in classify_response(404, "text/plain", b"Not Found")
    ok_stream = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    assert classify_response(200, "text/event-stream; charset=utf-8", ok_stream) is None
    bad = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "x"}}
    broken = f"data: {json.dumps(bad)}\n\ndata: [DONE]\n\n".encode()
    assert "server error event" in classify_response(200, "text/event-stream", broken)


def test_prometheus_parsing_and_drain():
    text = ("# HELP qserve_kv_blocks_used x\n# TYPE qserve_kv_blocks_used gauge\n"
            "qserve_kv_blocks_used 0\nqserve_num_requests_running 0\n"
            "qserve_num_requests_waiting 0\nqserve_requests_in_flight 0\n"
            'qserve_requests_total{outcome="rejected"} 4\n')
    m = parse_prometheus(text)
    assert m["kv_blocks_used"] == 0 and m['requests_total{outcome="rejected"}'] == 4
    assert is_drained(m)
    assert not is_drained({**m, "kv_blocks_used": 3.0})
    assert not is_drained({k: v for k, v in m.items() if k != "num_requests_running"})


def test_stream_verdicts():
    assert stream_verdict(outcome(status=200, done=True, finish_reason="length")) == "finished"
    assert stream_verdict(outcome(status=200, error_event='{"message": "x"}')) == "error_event"
    # a finish_reason without [DONE] is still a cut-off stream
    assert stream_verdict(outcome(status=200, finish_reason="length", end="eof")) == "truncated"
    assert stream_verdict(outcome(status=200, events=5, end="transport error")) == "truncated"
    assert stream_verdict(outcome(status=503)) == "refused"


def test_sigterm_judgement():
    good = [StreamEnd(0, "finished", 9, 8, "length", True, "done", 0.5, 0.5),
            StreamEnd(1, "error_event", 3, 2, None, True, "", 0.1, 0.1)]
    refused = [{"after_s": 0.3, "outcome": "connection refused"},
               {"after_s": 1.0, "outcome": "503"}]
    res = CheckResult("sigterm")
    judge_sigterm(res, good, refused, 0, 4.0, 30)
    assert res.passed
    res = CheckResult("sigterm")
    cut = good + [StreamEnd(2, "truncated", 4, 4, None, False, "RemoteProtocolError", -0.1,
                            0.4)]
    judge_sigterm(res, cut, refused + [{"after_s": 2.0, "outcome": "200"}], 1, 4.0, 30)
    assert [c.name for c in res.failed] == ["no stream truncated",
                                            "new requests refused after SIGTERM",
                                            "exit code 0 within 30s"]
    assert "[2]" in res.failed[0].detail


def test_overload_judgement():
    fine = outcome(status=429, retry_after="1", error_body=ERR, e2e_s=0.004)
    assert rejection_problem(fine) is None
    assert "without Retry-After" in rejection_problem(outcome(status=429, error_body=ERR))
    assert "status 200" in rejection_problem(outcome(status=200, end="done"))
    res = CheckResult("overload")
    judge_rejections(res, [fine, outcome(status=503, retry_after="2", error_body=ERR,
                                         e2e_s=0.049)])
    assert res.passed
    res = CheckResult("overload")
    judge_rejections(res, [fine, outcome(status=429, retry_after="1", error_body=ERR,
                                         e2e_s=0.080)])
    assert [c.name for c in res.failed] == ["refused within 50 ms"]
    assert "80.0 ms" in res.failed[0].detail


def test_soak_plan_is_seeded_and_mixed():
    cfg = SoakConfig(requests=400, disconnect_rate=0.25, min_tokens=8, max_tokens=12)
    plans = plan_requests(400, cfg, seed=3)
    assert plans == plan_requests(400, cfg, seed=3)
    assert {p.api for p in plans} == {"chat", "completions"}
    assert {p.stream for p in plans} == {True, False}
    assert all(8 <= p.max_tokens <= 12 for p in plans)
    leaving = [p for p in plans if p.leaves]
    assert 60 <= len(leaving) <= 140
    # streams leave after some events, plain requests after a delay, never both
    assert all((p.leave_after_events is not None) == p.stream for p in leaving)
    assert all((p.leave_after_s is not None) == (not p.stream) for p in leaving)
    assert plan_requests(50, SoakConfig(disconnect_rate=0.0), 0)[0].leaves is False


def test_soak_tally_and_judgement():
    done = outcome(status=200, done=True, finish_reason="length", ttft_s=0.1,
                   completion_tokens=8)
    plain = outcome(api="completions", stream=False, status=200, finish_reason="stop",
                    completion_tokens=3)
    left = outcome(planned_leave=True, left=True, status=200, end="left")
    cut = outcome(status=200, end="eof", ttft_s=0.2)
    t = tally([done, plain, left, cut, outcome(stream=False, status=500, error="HTTP 500")])
    assert (t.requests, t.left, t.survivors, t.complete, t.status_5xx) == (5, 1, 4, 2, 1)
    assert t.ttft_s == [0.1, 0.2] and t.completion_tokens == 11
    res = CheckResult("soak")
    judge_soak(res, t, True, "drained", 1000 * 2**20, 1150 * 2**20)
    assert [c.name for c in res.failed] == ["every survivor completes", "no 5xx",
                                            "RSS within 10% of post-warm-up"]
    assert "+15.0%" in res.failed[-1].detail
    res = CheckResult("soak")
    judge_soak(res, tally([done, plain, left]), True, "drained", 1000, 1050)
    assert res.passed


def test_results_table_and_atomic_json(tmp_path):
    ok = CheckResult("fuzz", measurements={"operations": 3, "examples": 40})
    ok.require("no 5xx", True, "0")
    bad = CheckResult("sigterm")
    bad.require("no stream truncated", False, "2 of 8 truncated")
    broken = CheckResult("soak", error="BenchmarkError: server did not start")
    assert ok.passed and not bad.passed and not broken.passed
    assert not CheckResult("empty").passed  # no criterion: nothing was shown
    table = summary_table([ok, bad, broken])
    assert "fuzz                 PASS" in table and "operations=3; examples=40" in table
    assert "failed: no stream truncated: 2 of 8 truncated" in table
    assert "ERROR" in table and "server did not start" in table
    out = tmp_path / "r.json"
    out.write_text("old")
    write_json_atomic(out, {"checks": [bad.to_dict()]})
    assert json.loads(out.read_text())["checks"][0]["passed"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left


def test_helpers():
    assert parse_checks("soak, fuzz,soak") == ["soak", "fuzz"]
    import click

    with pytest.raises(click.BadParameter, match="unknown check"):
        parse_checks("soak,nap")
    assert percentiles_ms([]) == {}
    p = percentiles_ms([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["max"] == pytest.approx(100.0)
    assert p["count"] == 100


def test_temp_dirs_beside_the_output(tmp_path):
    out = tmp_path / "art"
    assert temp_dirs(out) == []
    (tmp_path / ".art.tmp-123").mkdir()
    (tmp_path / ".other.tmp-1").mkdir()
    assert [p.name for p in temp_dirs(out)] == [".art.tmp-123"]


def test_tiny_live_soak(tiny_model_dir, tmp_path):
    """Ten requests, a quarter of the clients leaving, against a real server process."""
    opts = ServeOptions(str(tiny_model_dir), threads=1, log_dir=tmp_path,
                        serve_args=("--dtype", "fp32", "--kv-dtype", "bf16",
                                    "--kv-cache-gib", "0.002", "--max-num-batched-tokens",
                                    "64", "--decode-impl", "eager"), startup_timeout=120)
    cfg = SoakConfig(requests=10, concurrency=4, disconnect_rate=0.25, min_tokens=4,
                     max_tokens=12, warmup=4, seed=random.Random(0).randint(0, 9))
    res = run_soak(opts, cfg, progress=lambda msg: None)
    m = res.measurements
    assert res.error is None
    assert m["requests"] == 10 and m["survivors"] + m["disconnected"] == 10
    assert m["complete"] == m["survivors"] > 0
    assert m["status_5xx"] == 0
    assert m["drain"]["kv_blocks_used"] == 0 and m["drain"]["requests_in_flight"] == 0
    assert m["rss_warm_mib"] > 0 and m["ttft_ms"]["count"] > 0
    assert res.passed, summary_table([res])
