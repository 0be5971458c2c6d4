"""The gateway's HTTP client against raw TCP servers that misbehave on purpose: pooling,
breaks mid-body (whole events before a break still delivered), timeouts, bad responses."""

import asyncio
import json

import pytest

from qserve.runtime.gateway.backend import Backend
from qserve.runtime.gateway.config import BackendConfig, CircuitConfig, Timeouts
from qserve.runtime.http_client import ConnectError, HttpClient, HttpError
from qserve.runtime.gateway.upstream import UpstreamFailure, call_json, open_stream
from raw_http_server import Cut, RawServer, chunked


def json_reply(obj, extra=b""):
    body = json.dumps(obj).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra +
            b"content-length: %d\r\n\r\n" % len(body) + body)


def backend(url, **timeouts):
    cfg = BackendConfig(name="b", url=url, models=("m",), timeouts=Timeouts(**timeouts))
    return Backend(cfg, CircuitConfig())


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_connections_are_reused_and_close_is_honoured():
    async def go():
        async with RawServer([json_reply({"n": 1}), json_reply({"n": 2}),
                              json_reply({"n": 3}, b"connection: close\r\n"),
                              json_reply({"n": 4})]) as srv:
            client = HttpClient()
            b = backend(srv.url)
            got = [(await call_json(client, b, "/v1/x", {"q": i}))[0]["n"] for i in range(4)]
            await client.close()
            return got, srv.connections, srv.requests
    got, connections, requests = run(go())
    assert got == [1, 2, 3, 4]
    assert connections == 2              # the third answer closed the first connection
    assert requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert requests[0].endswith(b'{"q":0}')


def test_a_kept_alive_connection_closed_unanswered_is_retried_once_on_a_new_one():
    """A server that closes a kept-alive connection when the next request arrives, without
    a byte of answer (llama.cpp's server after a few requests): the request goes once more
    on a new connection. Unanswered on a new connection, or partly answered, it fails."""
    async def go():
        async with RawServer([json_reply({"n": 1}), None, json_reply({"n": 2})]) as srv:
            client = HttpClient()
            first = await client.fetch("POST", srv.url + "/v1/x", b'{"q":0}', timeout=5)
            second = await client.fetch("POST", srv.url + "/v1/x", b'{"q":1}', timeout=5)
            await client.close()
            kept = (first[2], second[2], srv.connections, srv.requests)
        async with RawServer([None]) as srv:
            client = HttpClient()
            with pytest.raises(HttpError, match="closed the connection"):
                await client.fetch("POST", srv.url + "/v1/x", b"{}", timeout=5)
            await client.close()
            fresh = srv.connections
        async with RawServer([json_reply({"n": 1}), Cut(b"HTTP/1.1 200 OK\r\ncontent-")]) as srv:
            client = HttpClient()
            await client.fetch("POST", srv.url + "/v1/x", b"{}", timeout=5)
            with pytest.raises(HttpError, match="closed the connection"):
                await client.fetch("POST", srv.url + "/v1/x", b"{}", timeout=5)
            await client.close()
            partial = (srv.connections, len(srv.requests))
        return kept, fresh, partial
    (first, second, connections, requests), fresh, partial = run(go())
    assert json.loads(first) == {"n": 1} and json.loads(second) == {"n": 2}
    assert connections == 2 and [r[-7:] for r in requests] == [b'{"q":0}', b'{"q":1}', b'{"q":1}']
    assert fresh == 1                    # a new connection's failure is not retried
    assert partial == (1, 2)             # nor one that had begun to answer


def test_whole_events_before_a_break_are_delivered_then_the_failure():
    async def go():
        reply = Cut(chunked(b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\ndata: {"n"', end=False))
        async with RawServer([reply]) as srv:
            client = HttpClient()
            stream = await open_stream(client, backend(srv.url), "/s", {})
            events = []
            with pytest.raises(UpstreamFailure) as e:
                async for event in stream:
                    events.append(event["n"])
            await stream.aclose()
            await client.close()
            return events, e.value.outcome
    assert run(go()) == ([1, 2], "transport_error")


def test_a_stream_that_ends_without_done_is_cut_and_one_with_done_is_not():
    async def go(done):
        tail = [b"data: [DONE]\n\n"] if done else []
        async with RawServer([chunked(b'data: {"n": 1}\n\n', *tail)]) as srv:
            client = HttpClient()
            stream = await open_stream(client, backend(srv.url), "/s", {})
            events, outcome = [], None
            try:
                async for event in stream:
                    events.append(event["n"])
            except UpstreamFailure as f:
                outcome = f.outcome
            await stream.aclose()
            await client.close()
            return events, outcome
    assert run(go(False)) == ([1], "stream_cut")
    assert run(go(True)) == ([1], None)


def test_a_body_without_length_ends_at_eof():
    async def go():
        reply = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"n": 5}'
        async with RawServer([reply]) as srv:
            client = HttpClient()
            body, raw = await call_json(client, backend(srv.url), "/x", {})
            await client.close()
            return body, raw
    assert run(go()) == ({"n": 5}, b'{"n": 5}')


def test_errors_and_retry_after_come_back_as_upstream_failures():
    async def go():
        err = json.dumps({"error": {"message": "slow down"}}).encode()
        reply = (b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: %d\r\n\r\n"
                 % len(err) + err)
        async with RawServer([reply, None, b"HTTP/1.1 2x0 nonsense\r\n\r\n"]) as srv:
            client = HttpClient()
            out = []
            for _ in range(3):
                try:
                    await call_json(client, backend(srv.url), "/x", {})
                except UpstreamFailure as f:
                    out.append((f.outcome, f.status, f.retry_after, f.body))
            await client.close()
            return out
    limited, closed, malformed = run(go())
    assert limited == ("http_429", 429, 3.0, {"error": {"message": "slow down"}})
    assert closed[0] == "transport_error" and malformed[0] == "transport_error"


def test_a_refused_connection_is_a_connect_error():
    async def go():
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        client = HttpClient()
        with pytest.raises(ConnectError):
            await client.request("GET", f"http://127.0.0.1:{port}/")
        with pytest.raises(UpstreamFailure) as e:
            await call_json(client, backend(f"http://127.0.0.1:{port}"), "/x", {})
        return e.value.outcome
    assert run(go()) == "connect_error"


def test_a_backend_that_never_answers_times_out_and_sees_the_client_leave():
    async def go():
        async with RawServer(["hang"]) as srv:
            client = HttpClient()
            with pytest.raises(UpstreamFailure) as e:
                await call_json(client, backend(srv.url, first_token=0.2), "/x", {})
            await asyncio.wait_for(srv.eof_seen.wait(), 5)   # the connection was closed
            await client.close()
            return e.value.outcome
    assert run(go()) == "timeout"


def test_closing_a_response_mid_body_drops_the_connection():
    async def go():
        async with RawServer([chunked(b"data: 1\n\n", end=False), json_reply({"n": 2})]) as srv:
            client = HttpClient()
            resp = await client.request("GET", srv.url + "/")
            assert await resp.readline() == b"data: 1\n"
            resp.close()
            with pytest.raises(HttpError):
                await resp.readline()
            await asyncio.wait_for(srv.eof_seen.wait(), 5)
            resp2 = await client.request("GET", srv.url + "/")    # a new connection
            data = await resp2.read()
            await client.close()
            return data, srv.connections
    data, connections = run(go())
    assert json.loads(data) == {"n": 2} and connections == 2


def test_header_values_with_line_breaks_are_refused():
    async def go():
        async with RawServer([json_reply({})]) as srv:
            client = HttpClient()
            with pytest.raises(HttpError):
                await client.request("GET", srv.url + "/", headers={"x": "a\r\nevil: 1"})
            await client.close()
    run(go())


def test_fetch_returns_the_whole_answer_and_a_cut_or_late_one_never_reaches_the_pool():
    """`HttpClient.fetch`: status, headers and body under one timeout; a body cut short
    raises HttpError and a timeout mid-body TimeoutError, and both drop their connection,
    so the next fetch opens a new one and reads a clean answer."""
    late = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345"  # then nothing
    async def go():
        async with RawServer([json_reply({"n": 1}, b"x-a: b\r\n"), Cut(late[:-2]), late,
                              json_reply({"n": 2})]) as srv:
            client = HttpClient()
            status, headers, body = await client.fetch("GET", srv.url + "/", timeout=5)
            assert (status, headers["x-a"], json.loads(body)) == (200, "b", {"n": 1})
            with pytest.raises(HttpError):
                await client.fetch("GET", srv.url + "/", timeout=5)
            with pytest.raises(TimeoutError):
                await client.fetch("GET", srv.url + "/", timeout=0.3)
            got = await client.fetch("GET", srv.url + "/", timeout=5)
            await client.close()
            return got, srv.connections
    (status, _, body), connections = run(go())
    assert status == 200 and json.loads(body) == {"n": 2}
    assert connections == 3  # the cut and the late answer each cost their connection
