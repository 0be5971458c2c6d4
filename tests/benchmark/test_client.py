"""The load generator's request (`client.send`) against a raw loopback server
(tests/raw_http_server.py) that answers with hand-crafted HTTP/1.1, in pieces."""

import asyncio
import json

from qserve.runtime.benchmark.client import ClientConfig, send
from qserve.runtime.benchmark.workloads import RequestSpec
from qserve.runtime.http_client import HttpClient
from raw_http_server import Cut, RawServer, chunked


def event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text}]}


def run(reply, timeout=5.0):
    """(send's result, the raw request the server got) for one request answered by `reply`."""
    async def go():
        async with RawServer([reply]) as server:
            cfg = ClientConfig(server.url, "m", api_key="k", request_timeout=timeout)
            http = HttpClient()
            try:
                res = await send(http, cfg, RequestSpec(prompt="hello", prompt_len=5,
                                                        output_len=3))
            finally:
                await http.close()
            return res, server.requests[0]
    return asyncio.run(go())


def test_a_stream_split_across_pieces_is_timed_and_counted():
    reply = chunked(event(text_chunk("a")) + event(text_chunk("b"))[:9],
                    event(text_chunk("b"))[9:], event(text_chunk("")) + event(text_chunk("c")),
                    event({"choices": [], "usage": {"prompt_tokens": 6,
                                                    "completion_tokens": 3}}),
                    event(b"[DONE]"))
    split = len(reply) // 2
    res, request = run([reply[:split], reply[split:]])
    assert res.success and res.error == ""
    assert len(res.itl) == 2  # three text chunks: the empty-text one is not a token
    assert (res.output_len, res.prompt_len, res.usage_reported) == (3, 6, True)
    assert 0 < res.ttft <= res.e2el
    head, _, sent = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"authorization: Bearer k" in head and b"connection: close" in head
    assert json.loads(sent) == {"model": "m", "max_tokens": 3, "ignore_eos": True,
                                "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}, "prompt": "hello"}


def test_without_usage_the_text_chunks_are_the_output_count():
    res, _ = run(chunked(event(text_chunk("x")), event(text_chunk("y")), event(b"[DONE]")))
    assert res.success and (res.output_len, res.usage_reported) == (2, False)


def test_an_error_status_is_a_failed_result_with_its_body():
    body = b'{"error": {"message": "busy"}}'
    res, _ = run(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n" % len(body)
                 + body)
    assert not res.success and res.error == f"HTTP 429: {body.decode()}"


def test_an_error_event_ends_the_request():
    res, _ = run(chunked(event(text_chunk("x")), event({"error": {"message": "boom"}})))
    assert not res.success and res.error.startswith("stream error:") and "boom" in res.error


def test_a_stream_that_stops_is_a_timeout_not_a_hang():
    res, _ = run([chunked(event(text_chunk("x")), end=False), "hang"], timeout=0.3)
    assert not res.success and res.error.startswith("TimeoutError")


def test_a_connection_cut_mid_stream_is_a_failed_result():
    res, _ = run(Cut(chunked(event(text_chunk("x")), end=False) + b"40\r\ndata: {\"choi"))
    assert not res.success and res.error.startswith("HttpError")


def test_a_stream_without_text_fails():
    res, _ = run(chunked(event(b"[DONE]")))
    assert not res.success and res.error == "the stream carried no text"


def test_the_servers_ttft_prediction_is_kept_beside_the_measured_one():
    """The disaggregation router sends its TTFT prediction as x-qserve-predicted-ttft-ms;
    the result keeps it in seconds (None without one, or with a header that is no number)."""
    body = chunked(event(text_chunk("a")), event(b"[DONE]"))
    with_header = body.replace(b"\r\n\r\n", b"\r\nx-qserve-predicted-ttft-ms: 812.5\r\n\r\n", 1)
    res, _ = run(with_header)
    assert res.success and res.predicted_ttft == 0.8125
    res, _ = run(body.replace(b"\r\n\r\n", b"\r\nx-qserve-predicted-ttft-ms: soon\r\n\r\n", 1))
    assert res.success and res.predicted_ttft is None
    assert run(body)[0].predicted_ttft is None
