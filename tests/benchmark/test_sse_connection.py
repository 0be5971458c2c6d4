"""SseConnection against a real loopback socket: a tiny asyncio server reads the request
and writes a hand-crafted HTTP/1.1 answer, piece by piece."""

import asyncio
import time

import pytest

from qserve.runtime.benchmark.sse_connection import Endpoint, HttpProtocolError, SseConnection

EVENTS = ['data: {"a": 1}', "", "data: [DONE]", ""]  # what every body below carries


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def exchange(parts, *, read="lines", path="/v1/completions", body=b"{}",
                   headers=None, timeout_s=5.0, hang=False):
    """POST to a one-shot server that answers with `parts` (written with a short pause
    between them, so each arrives in its own read) and then closes, or with `hang` waits
    until the client closes. Returns (status, headers, lines or body, raw request)."""
    seen, served = [], asyncio.Event()

    async def handle(reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            seen.append(head + await reader.readexactly(length))
            for i, part in enumerate(parts):
                if i:
                    await asyncio.sleep(0.01)
                writer.write(part)
                await writer.drain()
            if hang:
                await reader.read()  # until the client gives up and closes
        finally:
            writer.close()
            served.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with SseConnection.post(f"http://127.0.0.1:{port}{path}", body, headers,
                                      timeout_s) as conn:
            if read == "lines":
                got = [line async for line in conn.lines()]
            else:
                got = await conn.read_body()
        return conn.status, conn.headers, got, seen[0]
    finally:
        await asyncio.wait_for(served.wait(), 1)
        server.close()
        await server.wait_closed()


def run(parts, **kw):
    return asyncio.run(exchange(parts, **kw))


OK_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_chunked_lines_split_across_awkward_chunk_boundaries():
    body = [
        b"5;foo=bar\r\ndata:\r\n",                  # a chunk extension; a line split mid-way
        b'6\r\n {"a":\r\n',
        b'4\r\n 1}\r\r\n',                          # the CR here, its LF in the next chunk
        b"9\r\n\n\r\ndata: \r\n",                   # two line ends in one chunk
        b"C\r\n[DONE]\r\n\r\nxy\r\n",              # a last line without a line end
        b"0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n",  # trailers after the 0 chunk
    ]
    status, headers, lines, _ = run([OK_CHUNKED, *body])
    assert status == 200
    assert headers["transfer-encoding"] == "chunked"
    assert lines == ['data: {"a": 1}', "", "data: [DONE]", "", "xy"]


def test_chunked_lines_with_all_pieces_in_one_write():
    text = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    _, _, lines, _ = run([OK_CHUNKED + chunked(text[:3], text[3:20], text[20:])])
    assert lines == EVENTS


def test_content_length_body_lines():
    text = b'data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(text)
    _, headers, lines, _ = run([head + text[:7], text[7:24], text[24:]])
    assert headers["content-length"] == str(len(text))
    assert lines == EVENTS


def test_close_delimited_body_lines():
    text = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    _, headers, lines, _ = run([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + text[:9],
                                text[9:]])
    assert "content-length" not in headers and "transfer-encoding" not in headers
    assert lines == EVENTS


ERROR = b'{"error": {"message": "slow down", "code": 429}}'


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_error_status_and_body(framing):
    if framing == "chunked":
        answer = (b"HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: Chunked\r\n"
                  b"Retry-After: 3\r\nX-Mixed-Case: Keep Value\r\n\r\n"
                  + chunked(ERROR[:10], ERROR[10:]))
    else:
        answer = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n"
                  b"Retry-After: 3\r\nX-Mixed-Case: Keep Value\r\n\r\n%s" % (len(ERROR), ERROR))
    status, headers, body, _ = run([answer], read="body")
    assert status == 429
    assert body == ERROR
    assert headers["retry-after"] == "3"
    assert headers["x-mixed-case"] == "Keep Value"  # names lower-cased, values untouched
    assert all(name == name.lower() for name in headers)


def test_the_request_sent():
    body = '{"prompt": "héllo", "stream": true}'.encode()
    _, _, _, request = run([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"],
                           path="/v1/completions?x=1&y=2", body=body,
                           headers={"Authorization": "Bearer sk-test"})
    head, _, sent_body = request.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "POST /v1/completions?x=1&y=2 HTTP/1.1"
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert fields["Host"].startswith("127.0.0.1:")  # a non-default port is kept
    assert fields["Content-Length"] == str(len(body))
    assert fields["Authorization"] == "Bearer sk-test"
    assert fields["Connection"] == "close"
    assert sent_body == body


def test_host_header_omits_default_ports_only():
    assert Endpoint.parse("http://example.com/x").host_header == "example.com"
    assert Endpoint.parse("http://example.com:80/x").host_header == "example.com"
    assert Endpoint.parse("https://example.com:443/x").host_header == "example.com"
    assert Endpoint.parse("https://example.com:80/x").host_header == "example.com:80"
    assert Endpoint.parse("http://example.com:8000/x").host_header == "example.com:8000"
    assert Endpoint.parse("http://[::1]:8000/x").host_header == "[::1]:8000"


def test_timeout_after_headers_raises_timeout_error_and_leaves_task_uncancelled():
    async def main():
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await exchange([OK_CHUNKED], timeout_s=0.3, hang=True)
        elapsed = time.monotonic() - start
        await asyncio.sleep(0)  # would raise CancelledError if the cancel were left pending
        return elapsed, asyncio.current_task().cancelling()

    elapsed, cancelling = asyncio.run(main())
    assert 0.25 < elapsed < 1.0
    assert cancelling == 0


def test_garbage_status_line():
    with pytest.raises(HttpProtocolError, match="status line"):
        run([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"])


def test_malformed_header_line():
    with pytest.raises(HttpProtocolError, match="header line"):
        run([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"])


def test_close_inside_chunk_data_raises_protocol_error():
    # the chunk announces 16 bytes, 4 arrive
    with pytest.raises(HttpProtocolError, match="closed inside a chunk"):
        run([OK_CHUNKED + b"5\r\ndata:\r\n10\r\nabcd"])


def test_close_between_chunks_raises_protocol_error():
    with pytest.raises(HttpProtocolError, match="closed inside a chunked body"):
        run([OK_CHUNKED + b"5\r\ndata:\r\n"])


def test_close_before_content_length_raises_protocol_error():
    with pytest.raises(HttpProtocolError, match="Content-Length"):
        run([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ndata: x\n"])


def test_endpoint_parse():
    assert Endpoint.parse("http://localhost:8000/v1/completions") == \
        Endpoint("localhost", 8000, "/v1/completions", False)
    assert Endpoint.parse("http://localhost") == Endpoint("localhost", 80, "/", False)
    assert Endpoint.parse("https://api.example.com/v1/chat?a=1&b=2") == \
        Endpoint("api.example.com", 443, "/v1/chat?a=1&b=2", True)
    assert Endpoint.parse("https://h:8443?x=y") == Endpoint("h", 8443, "/?x=y", True)
    assert Endpoint.parse("HTTP://Host.Example:81/p") == Endpoint("host.example", 81, "/p", False)


@pytest.mark.parametrize("url", ["ftp://x", "localhost:8000", "http://", "//host/p"])
def test_endpoint_parse_rejects(url):
    with pytest.raises(HttpProtocolError):
        Endpoint.parse(url)


@pytest.mark.parametrize("length", [b"lots", b"-5", "\u00b2".encode()])
def test_bad_content_length_is_a_protocol_error(length):
    with pytest.raises(HttpProtocolError, match="Content-Length"):
        run([b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\nabc"])
