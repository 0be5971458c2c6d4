"""One streaming POST over a plain HTTP/1.1 connection (asyncio streams, no HTTP library).

The load generator shares the CPU with the server it measures (on a 2-core machine, with
the engine's threads): every millisecond it spends per chunk is taken from the server
and shows up in the server's ITL. A general HTTP client costs ~0.8 ms of CPU per
streamed chunk in Python (measured against the echo backend); this one parses only what
a streaming completion needs (status line, headers, chunked or length-delimited or
close-delimited body, lines) and costs a fraction of that.

    async with SseConnection.post(url, body_bytes, headers, timeout_s) as conn:
        if conn.status != 200:
            text = await conn.read_body()
        async for line in conn.lines():      # str, without the line ending
            ...

One connection per request (`Connection: close`): the request's own TCP handshake on
loopback is ~0.1 ms, nothing against a streamed completion. `timeout_s` bounds the whole
request; when it runs out the connection is closed and the read raises TimeoutError.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import urlsplit


class HttpProtocolError(ValueError):
    """The server's answer is not HTTP/1.1 this client can read."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path: str  # with the query, e.g. /v1/completions
    tls: bool

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HttpProtocolError(f"{url!r} is not an http:// or https:// URL")
        tls = parts.scheme == "https"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port or (443 if tls else 80), path, tls)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"


class SseConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers  # lower-cased names; a repeated header keeps its last value
        self._reader = reader
        self._writer = writer
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._remaining = int(length) if length is not None and not self._chunked else None
        self._done = False

    # -- opening ---------------------------------------------------------------------
    @classmethod
    def post(cls, url: str, body: bytes, headers: dict[str, str] | None = None,
             timeout_s: float = 600.0) -> "_Opened":
        return _Opened(url, body, headers or {}, timeout_s)

    @classmethod
    async def _open(cls, endpoint: Endpoint, body: bytes,
                    headers: dict[str, str]) -> "SseConnection":
        reader, writer = await asyncio.open_connection(
            endpoint.host, endpoint.port, ssl=ssl.create_default_context() if endpoint.tls
            else None, limit=1 << 20)
        head = [f"POST {endpoint.path} HTTP/1.1", f"Host: {endpoint.host_header}",
                "Content-Type: application/json", "Accept: text/event-stream",
                f"Content-Length: {len(body)}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        try:
            await writer.drain()
            status_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
            parts = status_line.split(" ", 2)
            if (len(parts) < 2 or not parts[0].startswith("HTTP/1.")
                    or not (parts[1].isascii() and parts[1].isdigit())):
                raise HttpProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
            fields: dict[str, str] = {}
            while True:
                line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
                if not line:
                    break
                name, sep, value = line.partition(":")
                if not sep:
                    raise HttpProtocolError(f"malformed header line: {line[:80]!r}")
                fields[name.strip().lower()] = value.strip()
            length = fields.get("content-length")
            if length is not None and not (length.isascii() and length.isdigit()):
                raise HttpProtocolError(f"bad Content-Length {length[:40]!r}")
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, int(parts[1]), fields)

    def close(self) -> None:
        self._writer.close()

    # -- the body ----------------------------------------------------------------------
    async def _next_piece(self) -> bytes:
        """The next piece of the body as it arrives (b"" at its end)."""
        if self._done:
            return b""
        r = self._reader
        if self._chunked:
            size_line = await r.readline()
            if not size_line:
                raise HttpProtocolError("the connection closed inside a chunked body")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while (await r.readline()).strip():  # trailers, up to the blank line
                    pass
                self._done = True
                return b""
            try:
                piece = await r.readexactly(size + 2)  # the data and its CRLF
            except asyncio.IncompleteReadError:
                raise HttpProtocolError("the connection closed inside a chunk") from None
            return piece[:-2]
        if self._remaining is not None:
            if self._remaining == 0:
                self._done = True
                return b""
            piece = await r.read(min(self._remaining, 1 << 16))
            if not piece:
                raise HttpProtocolError("the connection closed before Content-Length bytes")
            self._remaining -= len(piece)
            return piece
        piece = await r.read(1 << 16)  # delimited by the connection's close
        if not piece:
            self._done = True
        return piece

    async def read_body(self) -> bytes:
        out = bytearray()
        while piece := await self._next_piece():
            out += piece
        return bytes(out)

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as text (UTF-8), each without its line ending."""
        pending = b""
        while piece := await self._next_piece():
            pending += piece
            if b"\n" not in piece:
                continue
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")


class _Opened:
    """`async with SseConnection.post(...) as conn`: opens, bounds the whole exchange by
    the timeout, and closes the connection on the way out."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str], timeout_s: float):
        self._endpoint = Endpoint.parse(url)
        self._body, self._headers, self._timeout_s = body, headers, timeout_s
        self._conn: SseConnection | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    async def __aenter__(self) -> SseConnection:
        task = asyncio.current_task()
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire, task)
        try:
            self._conn = await SseConnection._open(self._endpoint, self._body, self._headers)
        except asyncio.CancelledError:
            self._cancel_timer()
            if self._timed_out:
                self._uncancel()
                raise TimeoutError(f"no answer within {self._timeout_s:g} s") from None
            raise
        except BaseException:
            self._cancel_timer()
            raise
        return self._conn

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self._cancel_timer()
        if self._conn is not None:
            self._conn.close()
        if exc_type is asyncio.CancelledError and self._timed_out:
            self._uncancel()
            raise TimeoutError(f"the stream did not end within {self._timeout_s:g} s") from None
        return False

    def _expire(self, task: asyncio.Task | None) -> None:
        self._timed_out = True
        if task is not None:
            task.cancel()

    @staticmethod
    def _uncancel() -> None:
        # the cancellation was this timer's own, now a TimeoutError: take it back (3.11+)
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):
            task.uncancel()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
