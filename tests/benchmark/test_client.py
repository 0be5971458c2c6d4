"""The load generator's request (`client.send`) against a real loopback socket: a one-shot
asyncio server reads the request and writes a hand-crafted HTTP/1.1 answer in pieces."""

import asyncio
import json

from qserve.runtime.benchmark.client import ClientConfig, send
from qserve.runtime.benchmark.workloads import RequestSpec
from qserve.runtime.http_client import HttpClient


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text}]}


OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _exchange(parts, timeout=5.0, hang=False):
    seen = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        seen.append((head, await reader.readexactly(length)))
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)  # each piece arrives on its own
        if hang:
            await reader.read()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = ClientConfig(f"http://127.0.0.1:{port}", "m", api_key="k", request_timeout=timeout)
    spec = RequestSpec(prompt="hello", prompt_len=5, output_len=3)
    http = HttpClient()
    try:
        return await send(http, cfg, spec), seen[0]
    finally:
        await http.close()
        server.close()
        await server.wait_closed()


def run(parts, **kw):
    return asyncio.run(_exchange(parts, **kw))


def test_a_stream_split_across_pieces_is_timed_and_counted():
    body = chunked(event(text_chunk("a")) + event(text_chunk("b"))[:9], event(text_chunk("b"))[9:],
                   event(text_chunk("")) + event(text_chunk("c")),
                   event({"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3}}),
                   event(b"[DONE]"))
    res, (head, sent) = run([OK, body[:40], body[40:]])
    assert res.success and res.error == ""
    assert res.chunks == 3 and len(res.itl) == 2  # the empty-text chunk is not a token
    assert (res.output_len, res.prompt_len, res.usage_reported) == (3, 6, True)
    assert 0 < res.ttft <= res.e2el
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"authorization: Bearer k" in head and b"connection: close" in head
    assert json.loads(sent) == {"model": "m", "max_tokens": 3, "ignore_eos": True,
                                "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}, "prompt": "hello"}


def test_without_usage_the_text_chunks_are_the_output_count():
    res, _ = run([OK + chunked(event(text_chunk("x")), event(text_chunk("y")), event(b"[DONE]"))])
    assert res.success and (res.output_len, res.usage_reported) == (2, False)


def test_an_error_status_is_a_failed_result_with_its_body():
    body = b'{"error": {"message": "busy"}}'
    res, _ = run([b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n" % len(body)
                  + body])
    assert not res.success and res.error == f"HTTP 429: {body.decode()}"


def test_an_error_event_ends_the_request():
    res, _ = run([OK + chunked(event(text_chunk("x")), event({"error": {"message": "boom"}}))])
    assert not res.success and res.error.startswith("stream error:") and "boom" in res.error


def test_a_stream_that_stops_is_a_timeout_not_a_hang():
    res, _ = run([OK + b"%x\r\n%s\r\n" % (len(event(text_chunk("x"))), event(text_chunk("x")))],
                 timeout=0.3, hang=True)
    assert not res.success and res.error.startswith("TimeoutError")


def test_a_connection_cut_mid_stream_is_a_failed_result():
    res, _ = run([OK + b"40\r\ndata: {\"choi"])
    assert not res.success and res.error.startswith("HttpError")


def test_a_stream_without_text_fails():
    res, _ = run([OK + chunked(event(b"[DONE]"))])
    assert not res.success and res.error == "the stream carried no text"
