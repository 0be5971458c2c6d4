"""One HTTP exchange with a backend: a JSON response, or a stream of SSE events.

    body = await call_json(session, backend, "/v1/chat/completions", payload)
    stream = await open_stream(session, backend, path, payload)   # head checked
    async for event in stream: ...                                 # dict per `data:` line
    await stream.aclose()

aiohttp, not httpx, carries the upstream calls: measured through the gateway on loopback,
httpx's client cost about half of the gateway's CPU time per request (its pure-Python
HTTP/1.1 layer), which decides the overhead a gateway adds.

Failures raise UpstreamFailure with an `outcome` for traces and metrics and whether
another attempt may help: connection errors, timeouts, 5xx and 429 may; any other 4xx is
the client's request and is answered as the backend answered it.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from .backend import Backend
from .backoff import parse_retry_after


class UpstreamFailure(Exception):
    def __init__(self, outcome: str, message: str, status: int | None = None,
                 retry_after: float | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.outcome, self.status, self.retry_after, self.body = outcome, status, retry_after, body

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500


def _timeout(backend: Backend, total: bool) -> aiohttp.ClientTimeout:
    """connect: opening the connection; sock_read: any wait for bytes (the response head,
    then each read); total: the whole exchange (JSON calls; streams keep their own)."""
    t = backend.config.timeouts
    return aiohttp.ClientTimeout(total=t.total if total else None, sock_connect=t.connect,
                                 sock_read=t.first_token)


def _failure_from_response(status: int, headers, text: bytes) -> UpstreamFailure:
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "error" not in body:
        body = None
    return UpstreamFailure(f"http_{status}", f"the backend answered HTTP {status}", status,
                           parse_retry_after(headers.get("retry-after")), body)


def _failure_from_exception(e: BaseException) -> UpstreamFailure:
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamFailure("timeout", "the backend did not answer in time")
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamFailure("connect_error", "the backend is unreachable")
    return UpstreamFailure("transport_error", f"the connection to the backend failed "
                                              f"({type(e).__name__})")


async def call_json(session: aiohttp.ClientSession, backend: Backend, path: str,
                    payload: dict) -> dict:
    """The backend's JSON response to `payload` (UpstreamFailure on any failure)."""
    try:
        async with session.post(backend.config.url + path, json=payload,
                                headers=backend.headers(),
                                timeout=_timeout(backend, True)) as resp:
            status, headers, text = resp.status, resp.headers, await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _failure_from_exception(e) from None
    if status != 200:
        raise _failure_from_response(status, headers, text)
    try:
        body = json.loads(text)
    except ValueError:
        raise UpstreamFailure("bad_response", "the backend's response is not JSON",
                              status) from None
    if not isinstance(body, dict):
        raise UpstreamFailure("bad_response", "the backend's response is not an object")
    return body


def _buffered_lines(content: aiohttp.StreamReader) -> list[bytes]:
    """The complete lines received before a stream broke. aiohttp raises its payload error
    on every read once it is set, even while bytes that arrived before the break are still
    buffered; a client must still get each whole event the backend sent, so take them. The
    cut last line, if any, is dropped. (aiohttp offers no public call for this.)"""
    error = getattr(content, "_exception", None)
    if error is None or not hasattr(content, "_read_nowait"):
        return []
    content._exception = None
    try:
        data = content._read_nowait(-1)
    finally:
        content._exception = error
    return [line for line in data.splitlines(keepends=True) if line.endswith(b"\n")]


class UpstreamStream:
    """The events of an open streaming response; `done` once [DONE] arrived."""

    def __init__(self, resp: aiohttp.ClientResponse, deadline: float) -> None:
        self.resp, self.deadline = resp, deadline
        self.done = False
        self._salvaged: list[bytes] = []          # lines that arrived before the break
        self._failure: UpstreamFailure | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        while True:
            if self.done:
                raise StopAsyncIteration
            line = await self._readline()
            if not line:
                raise UpstreamFailure("stream_cut", "the backend's stream ended without "
                                                    "[DONE]")
            if not line.startswith(b"data:"):
                continue          # blank separators, comments (pings), event names
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                event = json.loads(data)
            except ValueError:
                raise UpstreamFailure("bad_response", "the backend sent an event that is not "
                                                      "JSON") from None
            if isinstance(event, dict):
                return event

    async def _readline(self) -> bytes:
        if self._failure is not None:          # the connection broke: what came before it
            if self._salvaged:
                return self._salvaged.pop(0)
            raise self._failure
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            async with asyncio.timeout(remaining):
                return await self.resp.content.readline()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._failure = _failure_from_exception(e)
            if isinstance(e, aiohttp.ClientPayloadError):
                self._salvaged = _buffered_lines(self.resp.content)
            return await self._readline()

    async def aclose(self) -> None:
        """Return the connection to the pool after [DONE]; otherwise close it, which the
        backend sees as the client going away (it aborts the request)."""
        if self.done:
            self.resp.release()
        else:
            self.resp.close()


async def open_stream(session: aiohttp.ClientSession, backend: Backend, path: str,
                      payload: dict) -> UpstreamStream:
    """Send a streaming request and check the response head (UpstreamFailure if it is not
    a 200)."""
    deadline = time.monotonic() + backend.config.timeouts.total
    try:
        resp = await session.post(backend.config.url + path, json=payload,
                                  headers=backend.headers(), timeout=_timeout(backend, False))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise _failure_from_exception(e) from None
    if resp.status != 200:
        try:
            text = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            text = b""
        resp.close()
        raise _failure_from_response(resp.status, resp.headers, text)
    return UpstreamStream(resp, deadline)
