"""The gateway against scripted backends: routing, retries, fallbacks, circuit breakers,
streams that fail before and after content, timeouts, disconnects, auth, rate limits,
the cache, traces and metrics."""

import json
import time

import httpx
import pytest
from gateway_harness import FakeBackend, pair_config, running_gateway

CHAT = {"model": "small", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8}


def sse(resp: httpx.Response) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(events) -> str:
    return "".join((e["choices"][0]["delta"].get("content") or "")
                   for e in events if isinstance(e, dict) and e.get("choices"))


def test_a_request_is_proxied_to_the_groups_model_with_route_headers(two_backends):
    with running_gateway(pair_config(), two_backends) as (url, state):
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, model="fast"))
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "Hello, world."
        group, backend = r.headers["x-qserve-route"].split("/")
        assert group == "small" and backend in ("a", "b")
        assert r.headers["x-qserve-route-reason"] == "alias fast -> small"
        assert r.headers["x-request-id"].startswith("gw-")
        assert float(r.headers["x-qserve-gateway-overhead-ms"]) >= 0
        sent = two_backends[backend].requests[0]
        assert sent["model"] == "m" and sent["messages"] == CHAT["messages"]


def test_a_500_is_retried_on_the_other_backend(two_backends):
    two_backends["a"].script = ["500"]
    two_backends["b"].script = ["500"]
    with running_gateway(pair_config(), two_backends, trace_path=None) as (url, state):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        # both failed once, then the third attempt (a retry, after backoff) succeeded
        assert len(two_backends["a"].requests) + len(two_backends["b"].requests) == 3
        text = state.metrics.render(state.backends.values(), state.clock())
        assert 'qserve_gateway_backend_requests_total{backend="a",outcome="http_500"} 1' in text
        assert 'qserve_gateway_backend_requests_total{backend="b",outcome="http_500"} 1' in text


def test_a_4xx_from_the_backend_is_answered_as_is_and_not_retried(two_backends):
    two_backends["a"].script = ["400"]
    two_backends["b"].script = ["400"]
    with running_gateway(pair_config(), two_backends) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 400
        assert r.json()["error"] == {"message": "bad max_tokens", "type": "invalid_request_error",
                                     "param": "max_tokens", "code": "invalid_value"}
        assert len(two_backends["a"].requests) + len(two_backends["b"].requests) == 1


def test_429_retry_after_is_honoured_and_a_long_one_falls_back_to_another_group():
    backends = {"a": FakeBackend("a", retry_after="0.2"), "big": FakeBackend("big", model="L")}
    cfg = {"backends": [{"name": "a", "models": ["m"]}, {"name": "big", "models": ["L"]}],
           "groups": [{"name": "small", "backends": ["a"], "model": "m",
                       "fallbacks": ["large"]},
                      {"name": "large", "backends": ["big"], "model": "L"}],
           "retries": {"max_attempts": 2, "base_delay": 0.0, "max_retry_after": 1}}
    with running_gateway(cfg, backends) as (url, _):
        backends["a"].script = ["429"]
        t = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers["x-qserve-route"] == "small/a"
        assert time.monotonic() - t >= 0.2         # waited out Retry-After
        backends["a"].retry_after = "30"            # longer than max_retry_after
        backends["a"].script = ["429"]
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers["x-qserve-route"] == "large/big"
        assert backends["big"].requests[-1]["model"] == "L"
        backends["a"].script = ["429"]
        backends["big"].script = ["429"]
        backends["big"].retry_after = "30"
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["code"] == "upstream_rate_limited"
        assert r.headers["retry-after"] == "30"


def test_the_circuit_opens_after_repeated_failures_and_the_gateway_answers_503():
    backends = {"a": FakeBackend("a")}
    cfg = {"backends": [{"name": "a", "models": ["m"]}],
           "groups": [{"name": "small", "backends": ["a"], "model": "m"}],
           "retries": {"max_attempts": 2, "base_delay": 0.0},
           "circuit": {"failures": 2, "window": 60, "cooldown": 30}}
    with running_gateway(cfg, backends) as (url, state):
        backends["a"].script = ["500", "500"]
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"
        assert state.backends["a"].breaker.state == "open"
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available"
        assert r.headers["retry-after"] == "1"
        assert len(backends["a"].requests) == 2       # the open circuit sent nothing
        metrics = httpx.get(url + "/metrics").text
        assert 'qserve_gateway_circuit_state{backend="a"} 2' in metrics
        assert httpx.get(url + "/health").status_code == 503


def test_a_backend_that_hangs_times_out_and_the_request_moves_on(two_backends):
    two_backends["a"].script = ["hang"]
    two_backends["b"].script = ["hang"]
    cfg = pair_config()
    for b in cfg["backends"]:
        b["timeouts"] = {"first_token": 0.3, "total": 0.5}
    with running_gateway(cfg, two_backends) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, stream=True), timeout=10)
        assert r.status_code == 200 and streamed_text(sse(r)) == "Hello, world."


def test_a_stream_that_fails_before_content_is_replaced_transparently(two_backends):
    with running_gateway(pair_config(), two_backends) as (url, state):
        for mode in ("error_event", "die_before", "hang_stream", "500"):
            two_backends["a"].script = [mode if mode != "die_before" else "500"]
            two_backends["b"].script = [mode if mode != "die_before" else "500"]
            r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, stream=True),
                           timeout=10)
            events = sse(r)
            assert r.status_code == 200, mode
            assert streamed_text(events) == "Hello, world." and events[-1] == "[DONE]", mode
            assert not any("error" in e for e in events if isinstance(e, dict)), mode
            # one model's text: the role chunk once, no second stream spliced in
            assert sum(1 for e in events if isinstance(e, dict) and e["choices"]
                       and e["choices"][0]["delta"].get("role")) == 1


def test_a_stream_that_dies_after_content_ends_with_an_error_event(two_backends):
    with running_gateway(pair_config(), two_backends) as (url, _):
        two_backends["a"].script = ["die"]
        two_backends["b"].script = ["die"]
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, stream=True), timeout=10)
        events = sse(r)
        assert r.status_code == 200
        assert streamed_text(events) == "Hello,"          # the two words sent before it died
        assert events[-2]["error"]["code"] == "upstream_failed_mid_stream"
        assert events[-1] == "[DONE]"
        total = len(two_backends["a"].requests) + len(two_backends["b"].requests)
        assert total == 1                                  # never retried after content


def test_usage_is_passed_on_only_when_the_client_asks(two_backends):
    with running_gateway(pair_config(), two_backends) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, stream=True))
        assert not any(e.get("usage") for e in sse(r) if isinstance(e, dict))
        r = httpx.post(url + "/v1/chat/completions",
                       json=dict(CHAT, stream=True, stream_options={"include_usage": True}))
        usage = [e["usage"] for e in sse(r) if isinstance(e, dict) and e.get("usage")]
        assert usage == [{"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}]


def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_request():
    backends = {"a": FakeBackend("a", words=["w"] * 50, delay=0.05)}
    cfg = {"backends": [{"name": "a", "models": ["m"]}],
           "groups": [{"name": "small", "backends": ["a"], "model": "m"}]}
    with running_gateway(cfg, backends) as (url, state):
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json=dict(CHAT, stream=True)) as r:
            for line in r.iter_lines():
                if '"w"' in line:
                    break
        deadline = time.monotonic() + 5
        while backends["a"].cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backends["a"].cancelled == 1 and backends["a"].completed == 0
        deadline = time.monotonic() + 5
        while state.backends["a"].outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.backends["a"].outstanding == 0


def test_bad_requests_get_the_same_error_objects_as_qserve_serve(two_backends):
    with running_gateway(pair_config(), two_backends) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, max_tokens="5"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert r.json()["error"]["code"] == "invalid_type"
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, model="gpt-9"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "small" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, messages=[]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert len(two_backends["a"].requests) + len(two_backends["b"].requests) == 0


def test_keys_are_required_and_limited_to_their_models(two_backends):
    cfg = pair_config(keys=[{"name": "team", "key_env": "K1", "models": ["fast"]}])
    cfg["groups"].append({"name": "other", "backends": ["a"], "model": "m"})
    with running_gateway(cfg, two_backends, environ={"K1": "sk-team-1"}) as (url, _):
        ok = {"Authorization": "Bearer sk-team-1"}
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 401
        assert httpx.post(url + "/v1/chat/completions", json=CHAT,
                          headers={"Authorization": "Bearer sk-team-2"}).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, model="fast"), headers=ok)
        assert r.status_code == 200
        r = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, model="other"), headers=ok)
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
        ids = [m["id"] for m in httpx.get(url + "/v1/models", headers=ok).json()["data"]]
        assert ids == ["fast"]


def test_rate_limits_answer_429_with_retry_after_and_openai_headers(two_backends):
    cfg = pair_config(keys=[{"name": "team", "key_env": "K1",
                             "limits": {"requests_per_minute": 2}}])
    with running_gateway(cfg, two_backends, environ={"K1": "sk"}) as (url, _):
        h = {"Authorization": "Bearer sk"}
        r1 = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=h)
        assert r1.headers["x-ratelimit-limit-requests"] == "2"
        assert r1.headers["x-ratelimit-remaining-requests"] == "1"
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=h).status_code == 200
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=h)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert 'rate_limited_total{key="team",limit="requests"} 1' in \
            httpx.get(url + "/metrics").text


def test_deterministic_requests_are_served_from_the_cache_streamed_or_not(two_backends):
    cfg = pair_config(cache={"enabled": True})
    with running_gateway(cfg, two_backends) as (url, _):
        body = dict(CHAT, temperature=0)
        r1 = httpx.post(url + "/v1/chat/completions", json=dict(body, stream=True))
        assert r1.headers["x-qserve-cache"] == "miss"
        r2 = httpx.post(url + "/v1/chat/completions", json=body)
        assert r2.headers["x-qserve-cache"] == "hit"
        assert r2.json()["choices"][0]["message"]["content"] == "Hello, world."
        r3 = httpx.post(url + "/v1/chat/completions", json=dict(body, stream=True))
        assert r3.headers["x-qserve-cache"] == "hit"
        assert streamed_text(sse(r3)) == "Hello, world." and sse(r3)[-1] == "[DONE]"
        sampled = httpx.post(url + "/v1/chat/completions", json=dict(CHAT, temperature=0.8))
        assert "x-qserve-cache" not in sampled.headers
        assert len(two_backends["a"].requests) + len(two_backends["b"].requests) == 2


def test_each_request_leaves_one_trace_line_pinned_to_the_artifact(two_backends, tmp_path):
    traces = tmp_path / "t.jsonl"
    with running_gateway(pair_config(), two_backends, trace_path=traces) as (url, _):
        two_backends["a"].script = ["500"]
        two_backends["b"].script = ["500"]
        httpx.post(url + "/v1/chat/completions", json=CHAT)
        httpx.post(url + "/v1/chat/completions", json=dict(CHAT, model="nope"))
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    assert [r["status"] for r in rows] == [200, 404]
    t = rows[0]
    assert t["retries"] == 2 and [a["outcome"] for a in t["attempts"]] == ["http_500",
                                                                          "http_500", "ok"]
    assert t["artifact_digest"] == "d-" + t["backend"]
    assert t["gate_report_digest"] == "g-d-" + t["backend"]
    assert t["request"]["messages"] == CHAT["messages"] and t["response"] == "Hello, world."
    assert t["prompt_tokens"] == 7 and t["completion_tokens"] == 4
    assert t["total_ms"] >= t["queue_ms"] >= 0


def test_zero_retention_traces_hold_no_text(two_backends, tmp_path):
    traces = tmp_path / "t.jsonl"
    cfg = pair_config(trace={"zero_retention": True})
    with running_gateway(cfg, two_backends, trace_path=traces) as (url, _):
        httpx.post(url + "/v1/chat/completions", json=CHAT)
        httpx.post(url + "/v1/chat/completions", json=dict(CHAT, stream=True))
    raw = traces.read_text()
    assert "Say hello" not in raw and "Hello, world" not in raw
    rows = [json.loads(line) for line in raw.splitlines()]
    assert len(rows) == 2 and all(r["request"] is None and r["response"] is None for r in rows)


def test_the_openai_client_works_through_the_gateway(two_backends):
    openai = pytest.importorskip("openai")
    with running_gateway(pair_config(), two_backends) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = client.chat.completions.create(model="fast", messages=CHAT["messages"])
        assert got.choices[0].message.content == "Hello, world."
        stream = client.chat.completions.create(model="fast", messages=CHAT["messages"],
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            "Hello, world."
        comp = client.completions.create(model="small", prompt="Hi", max_tokens=4)
        assert comp.choices[0].text == "Hello, world."
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=CHAT["messages"])
        assert [m.id for m in client.models.list().data] == ["fast", "small"]


def test_a_new_artifact_behind_the_same_backend_gets_new_cache_keys_and_traces(tmp_path):
    backends = {"a": FakeBackend("a", artifact_digest="d1")}
    cfg = {"backends": [{"name": "a", "models": ["m"]}],
           "groups": [{"name": "small", "backends": ["a"], "model": "m"}],
           "cache": {"enabled": True}}
    traces = tmp_path / "t.jsonl"
    body = dict(CHAT, temperature=0)
    with running_gateway(cfg, backends, trace_path=traces, version_refresh_s=0.2) as (url, _):
        assert httpx.post(url + "/v1/chat/completions", json=body).headers["x-qserve-cache"] \
            == "miss"
        assert httpx.post(url + "/v1/chat/completions", json=body).headers["x-qserve-cache"] \
            == "hit"
        backends["a"].artifact_digest = "d2"       # the backend now serves other weights
        time.sleep(0.6)                             # a version refresh or two
        assert httpx.post(url + "/v1/chat/completions", json=body).headers["x-qserve-cache"] \
            == "miss"
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    # the hit names the artifact that made the cached answer
    assert [(r["cache"], r["artifact_digest"]) for r in rows] == [
        ("miss", "d1"), ("hit", "d1"), ("miss", "d2")]
    assert rows[1]["backend"] is None and rows[1]["group"] == "small"


def test_a_backend_down_at_start_is_probed_when_it_first_answers():
    from fake_backend import ServerThread, free_port

    port = free_port()
    backends = {"a": FakeBackend("a", artifact_digest="d-late")}
    cfg = {"backends": [{"name": "a", "models": ["m"], "url": f"http://127.0.0.1:{port}"}],
           "groups": [{"name": "small", "backends": ["a"], "model": "m"}],
           "circuit": {"cooldown": 0.5}}
    with running_gateway(cfg, {}) as (url, state):      # the backend is not up yet
        assert state.backends["a"].breaker.state == "open"
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 503
        with ServerThread(backends["a"].app, port=port):
            time.sleep(1.1)                             # past the cooldown and 1 s
            r = httpx.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert state.backends["a"].versions["m"].artifact_digest == "d-late"
