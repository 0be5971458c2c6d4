"""The shared upstream client (runtime/upstream_client/): bounded fetches and sends, SSE
lines read one at a time, failures classified retryable or not. Directly against raw TCP
servers that misbehave on purpose, then through both of its users: the disaggregation
router (fake prefill and decode workers) and the gateway (fake backends), each facing a
backend that closes mid-stream, one that never answers, and a non-retryable 4xx."""

import asyncio
import contextlib
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fake_backend import FakeBackend, ServerThread
from gateway_harness import pair_config, running_gateway
from raw_http_server import Cut, RawServer, chunked

from qserve.runtime.disagg import router_state
from qserve.runtime.disagg.router_app import create_router_app
from qserve.runtime.disagg.router_state import RouterOptions, RouterState
from qserve.runtime.http_client import HttpClient, HttpError
from qserve.runtime.upstream_client import (LineStream, UpstreamFailure, fetch, is_retryable,
                                            send, verdict, within)


def run(coro):
    return asyncio.run(coro)


def json_reply(obj, status=b"200 OK"):
    body = json.dumps(obj).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body)


async def failure_of(coro) -> UpstreamFailure:
    try:
        await coro
    except UpstreamFailure as f:
        return f
    raise AssertionError("no UpstreamFailure")


# --- the helpers themselves -------------------------------------------------------------------

def test_fetch_reads_the_whole_answer_and_names_each_way_it_can_fail():
    async def go():
        client = HttpClient()
        async with RawServer([json_reply({"n": 1}), Cut(json_reply({"n": 2})[:-3]), "hang",
                              json_reply({"n": 3})[:-1] + b"]"]) as srv:
            ok = await fetch(client, "GET", srv.url + "/a", timeout=5, connect_timeout=1)
            cut = await failure_of(fetch(client, "GET", srv.url + "/b", timeout=5,
                                         connect_timeout=1))
            t0 = time.monotonic()
            late = await failure_of(fetch(client, "GET", srv.url + "/c", timeout=0.3,
                                          connect_timeout=1))
            waited = time.monotonic() - t0
            await asyncio.wait_for(srv.eof_seen.wait(), 5)   # the late one's connection closed
            bad = await fetch(client, "GET", srv.url + "/d", timeout=5, connect_timeout=1)
            not_json = await failure_of(_call(bad.json))
        async with RawServer([]) as srv:
            url = srv.url
        refused = await failure_of(fetch(client, "GET", url, timeout=5, connect_timeout=1))
        await client.close()
        return ok, cut, late, waited, bad, not_json, refused

    ok, cut, late, waited, bad, not_json, refused = run(go())
    assert (ok.status, ok.json()) == (200, {"n": 1})
    assert ok.headers["content-type"] == "application/json"
    assert (cut.outcome, cut.status, cut.cause, cut.retryable) == \
        ("transport_error", None, "HttpError", True)
    assert (late.outcome, late.cause, late.retryable) == ("timeout", "TimeoutError", True)
    assert 0.25 < waited < 3
    assert bad.status == 200
    assert (not_json.outcome, not_json.cause) == ("bad_response", "JSONDecodeError")
    assert (refused.outcome, refused.cause, refused.retryable) == \
        ("connect_error", "ConnectError", True)


async def _call(fn):
    return fn()


def test_send_returns_at_the_head_and_within_turns_errors_into_failures():
    async def go():
        client = HttpClient()
        async with RawServer([[b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab", "hang"]]) \
                as srv:
            resp = await send(client, "POST", srv.url, b"{}", timeout=2, connect_timeout=1)
            head = resp.status
            slow = await failure_of(_read_within(resp, 0.2, "no body in time"))
        async with within(1):
            pass
        passed = "no exception"
        try:
            async with within(1):
                raise KeyError("kept")
        except KeyError:
            passed = "KeyError"
        wrapped = await failure_of(_raise_in_within(HttpError("reset by peer")))
        await client.close()
        return head, slow, passed, wrapped

    head, slow, passed, wrapped = run(go())
    assert head == 200
    assert (slow.outcome, str(slow)) == ("timeout", "no body in time")
    assert passed == "KeyError"                      # other exceptions pass through as they are
    assert (wrapped.outcome, wrapped.cause) == ("transport_error", "HttpError")
    assert "reset by peer" in str(wrapped)


async def _read_within(resp, seconds, expired):
    async with within(seconds, expired=expired):
        await resp.read()


async def _raise_in_within(error):
    async with within(5):
        raise error


def test_a_line_stream_hands_out_whole_lines_then_the_break_and_bounds_each_wait():
    async def go():
        client = HttpClient()
        async with RawServer([Cut(chunked(b"data: 1\n\n", b"data: 2\n\nda", end=False))]) as srv:
            resp = await send(client, "GET", srv.url, timeout=2, connect_timeout=1)
            lines = LineStream(resp, read_timeout=2)
            got = [await lines.readline() for _ in range(4)]
            broke = await failure_of(lines.readline())
        async with RawServer([[chunked(b"data: 1\n\n", end=False), "hang"]]) as srv:
            resp = await send(client, "GET", srv.url, timeout=2, connect_timeout=1)
            lines = LineStream(resp, read_timeout=0.2)
            first = await lines.readline()
            await lines.readline()
            stalled = await failure_of(lines.readline())
            await asyncio.wait_for(srv.eof_seen.wait(), 5)    # the stall closed it
        async with RawServer([[chunked(b"data: 1\n\n", end=False), "hang"]]) as srv:
            resp = await send(client, "GET", srv.url, timeout=2, connect_timeout=1)
            lines = LineStream(resp, read_timeout=5, deadline=time.monotonic() - 1)
            past = await failure_of(lines.readline())
            lines.close()                                      # the backend sees it go
            await asyncio.wait_for(srv.eof_seen.wait(), 5)
        async with RawServer([chunked(b"data: 1\n\n", b"data: [DONE]\n\n")]) as srv:
            resp = await send(client, "GET", srv.url, timeout=2, connect_timeout=1)
            lines = LineStream(resp, read_timeout=2)
            whole = []
            while line := await lines.readline():
                whole.append(line)
            lines.close()
        await client.close()
        return got, broke, first, stalled, past, whole

    got, broke, first, stalled, past, whole = run(go())
    assert got == [b"data: 1\n", b"\n", b"data: 2\n", b"\n"]   # not the partial "da"
    assert (broke.outcome, broke.retryable) == ("transport_error", True)
    assert first == b"data: 1\n"
    assert (stalled.outcome, stalled.cause) == ("timeout", "TimeoutError")
    assert past.outcome == "timeout"
    assert whole == [b"data: 1\n", b"\n", b"data: [DONE]\n", b"\n"]


def test_which_failures_another_attempt_may_fix():
    assert is_retryable(None) and is_retryable(500) and is_retryable(503)
    assert is_retryable(429) and not is_retryable(408)
    assert not is_retryable(400) and not is_retryable(404)
    assert is_retryable(408, (408, 429)) and not is_retryable(429, ())
    f4, f5 = UpstreamFailure("http_404", "x", 404), UpstreamFailure("http_502", "x", 502)
    assert not f4.retryable and f5.retryable
    assert verdict(f4) is True           # the client's request: the backend worked
    assert verdict(f5) is False
    assert verdict(UpstreamFailure("timeout", "x")) is False


# --- through the router ---------------------------------------------------------------------

class FakeWorker:
    """A prefill or decode worker as the router sees it: /v1/disagg/info, and a scripted
    /v1/disagg/prefill (prefill) or /v1/completions (decode). Behaviours: ok, 404, 408,
    500, hang (no response head), die (two chunks, then the connection drops)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.script: list[str] = []
        self.requests = 0
        self.cancelled = 0
        self.app = self._build()

    def _next(self) -> str:
        self.requests += 1
        return self.script.pop(0) if self.script else "ok"

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/disagg/info")
        async def info():
            return {"role": self.role, "kv_port": 9 if self.role == "decode" else None,
                    "namespace": "ns", "block_size": 16, "kv_dtype": "bf16",
                    "free_kv_blocks": 1000, "total_kv_blocks": 1000}

        def error(status, message):
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                           "param": "prompt", "code": f"e{status}"}}, status)

        @app.post("/v1/disagg/prefill")
        async def prefill(request: Request):
            await request.json()
            mode = self._next()
            if mode in ("404", "408", "500"):
                return error(int(mode), f"prefill says {mode}")
            return {"prompt_tokens": 12, "cached_tokens": 0, "prefill_s": 0.01,
                    "transfer_s": 0.001, "kv_bytes": 4096}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            mode = self._next()
            if mode == "500":
                return error(500, "decode broke")
            if mode == "hang":
                await asyncio.sleep(3600)
            if not body.get("stream"):
                return {"object": "text_completion", "choices": [{"index": 0, "text": "abc",
                                                                  "finish_reason": "stop"}]}
            return StreamingResponse(self._stream(mode), media_type="text/event-stream")

        return app

    async def _stream(self, mode):
        try:
            for i, word in enumerate(["a", "b", "c", "d"]):
                if mode == "die" and i == 2:
                    raise RuntimeError("decode worker died mid-stream")
                yield f'data: {{"choices": [{{"index": 0, "text": "{word}"}}]}}\n\n'
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@contextlib.contextmanager
def running_router(prefill: list[FakeWorker], decode: list[FakeWorker], **options):
    with contextlib.ExitStack() as stack:
        p = [stack.enter_context(ServerThread(w.app)) for w in prefill]
        d = [stack.enter_context(ServerThread(w.app)) for w in decode]
        state = RouterState(p, d, RouterOptions(**options))
        url = stack.enter_context(ServerThread(create_router_app(state)))
        yield url, state, p, d


REQ = {"model": "tiny", "prompt": "one two three four five six", "max_tokens": 4}


def sse_events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def test_the_router_ends_a_stream_cut_mid_way_with_an_error_event_and_frees_the_worker():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    d.script = ["die"]
    with running_router([p], [d]) as (url, state, _, _):
        r = httpx.post(url + "/v1/completions", json=dict(REQ, stream=True), timeout=30)
        events = sse_events(r)
        assert r.status_code == 200
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        assert json.loads(events[-2])["error"]["code"] == "worker_failed_mid_stream"
        assert events[-1] == "[DONE]"
        assert [w.in_flight for w in state.workers] == [0, 0]
        whole = httpx.post(url + "/v1/completions", json=dict(REQ, stream=True), timeout=30)
        assert sse_events(whole)[-1] == "[DONE]" and "error" not in whole.text
        assert [json.loads(e)["choices"][0]["text"] for e in sse_events(whole)[:-1]] == \
            ["a", "b", "c", "d"]


def test_the_router_answers_a_prefill_workers_4xx_as_it_is_and_retries_a_408():
    ps = [FakeWorker("prefill"), FakeWorker("prefill")]
    d = FakeWorker("decode")
    for w in ps:
        w.script = ["404"]
    with running_router(ps, [d]) as (url, _, p_urls, _):
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=30)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "prefill says 404"
        assert r.json()["error"]["code"] == "e404"
        assert sum(w.requests for w in ps) == 1          # not retried elsewhere
        assert d.requests == 0
        first = p_urls.index(min(p_urls))    # equal trees and loads: the first url is tried
        ps[0].requests = ps[1].requests = 0
        ps[first].script, ps[1 - first].script = ["408"], []
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=30)
        assert r.status_code == 200, r.text
        assert [w.requests for w in ps] == [1, 1]        # the 408 went to the other one
        assert r.headers["x-qserve-prefill"].startswith(p_urls[1 - first] + " ")
        assert r.json()["choices"][0]["text"] == "abc"
        ps[0].script, ps[1].script = ["500"], ["500"]
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == ("no prefill/decode pair could serve the "
                                                "request: prefill worker answered 500; "
                                                "retry shortly.")


def test_the_router_marks_a_decode_worker_that_never_answers_down_and_uses_the_other(
        monkeypatch):
    monkeypatch.setattr(router_state, "POLL_S", 3600.0)   # no poll marks it up again
    p = FakeWorker("prefill")
    ds = [FakeWorker("decode"), FakeWorker("decode")]
    with running_router([p], ds, decode_first_token_s=0.5) as (url, state, _, d_urls):
        first = d_urls.index(min(d_urls))         # equally loaded: the first url is tried
        ds[first].script = ["hang"]
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-qserve-decode"].startswith(d_urls[1 - first] + " ")
        assert [w.requests for w in ds] == [1, 1] and p.requests == 2
        assert [w.healthy for w in state.decode] == [i != first for i in range(2)]
        assert [w.in_flight for w in state.workers] == [0, 0, 0]
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert f'qserve_router_worker_up{{role="decode",worker="{d_urls[first]}"}} 0' in metrics

    monkeypatch.setattr(router_state, "POLL_S", 3600.0)
    ds = [FakeWorker("decode"), FakeWorker("decode")]
    for w in ds:
        w.script = ["hang"]
    with running_router([p], ds, decode_first_token_s=0.3) as (url, state, _, d_urls):
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=30)
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert message.startswith("no prefill/decode pair could serve the request: decode "
                                  "worker http://127.0.0.1:")
        assert message.endswith(" failed (TimeoutError); retry shortly.")
        assert r.json()["error"]["code"] == "no_worker_available"
        assert r.headers["retry-after"] == "1"
        assert [w.requests for w in ds] == [1, 1]
        assert not any(w.healthy for w in state.decode)


# --- through the gateway --------------------------------------------------------------------

def test_the_gateway_ends_a_stream_cut_mid_way_with_an_error_event():
    backends = {"a": FakeBackend("a"), "b": FakeBackend("b")}
    backends["a"].script = ["die"]
    backends["b"].script = ["die"]
    with running_gateway(pair_config(), backends) as (url, _):
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "small", "prompt": "hi", "stream": True})
        events = sse_events(r)
        assert r.status_code == 200
        assert json.loads(events[0])["choices"][0]["text"] == "Hello"
        assert json.loads(events[-2])["error"]["code"] == "upstream_failed_mid_stream"
        assert events[-1] == "[DONE]"
        assert sum(len(b.requests) for b in backends.values()) == 1   # content was sent


def test_the_gateway_answers_a_4xx_as_it_is_and_retries_a_backend_that_never_answers():
    backends = {"a": FakeBackend("a"), "b": FakeBackend("b")}
    backends["a"].script = ["400"]
    backends["b"].script = ["400"]
    with running_gateway(pair_config(), backends) as (url, _):
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "small", "prompt": "hi"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "bad max_tokens"
        assert r.json()["error"]["param"] == "max_tokens"
        assert sum(len(b.requests) for b in backends.values()) == 1   # not retried
        backends["a"].script = ["hang"]
        backends["b"].script = ["hang"]
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "small", "prompt": "hi"})
        assert r.status_code == 200, r.text                 # the first_token timeout (1 s)
        assert sum(len(b.requests) for b in backends.values()) == 4     # then the other
