"""One HTTP exchange with a backend: a JSON response, or a stream of SSE events.

    body = await call_json(client, backend, "/v1/chat/completions", payload)
    stream = await open_stream(client, backend, path, payload)   # head checked
    async for event in stream: ...                               # dict per `data:` line
    await stream.aclose()

Failures raise UpstreamFailure with an `outcome` for traces and metrics and whether
another attempt may help: connection errors, timeouts, 5xx and 429 may; any other 4xx is
the client's request and is answered as the backend answered it.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

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


def _timeout(backend: Backend) -> httpx.Timeout:
    t = backend.config.timeouts
    return httpx.Timeout(connect=t.connect, read=t.first_token, write=t.first_token,
                         pool=t.connect)


def _failure_from_response(resp: httpx.Response, text: bytes) -> UpstreamFailure:
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "error" not in body:
        body = None
    return UpstreamFailure(f"http_{resp.status_code}",
                           f"the backend answered HTTP {resp.status_code}", resp.status_code,
                           parse_retry_after(resp.headers.get("retry-after")), body)


def _failure_from_exception(e: Exception) -> UpstreamFailure:
    if isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)):
        return UpstreamFailure("timeout", "the backend did not answer in time")
    if isinstance(e, httpx.ConnectError):
        return UpstreamFailure("connect_error", "the backend is unreachable")
    return UpstreamFailure("transport_error", f"the connection to the backend failed "
                                              f"({type(e).__name__})")


async def call_json(client: httpx.AsyncClient, backend: Backend, path: str,
                    payload: dict) -> dict:
    """The backend's JSON response to `payload` (UpstreamFailure on any failure)."""
    try:
        async with asyncio.timeout(backend.config.timeouts.total):
            resp = await client.post(backend.config.url + path, json=payload,
                                     headers=backend.headers(), timeout=_timeout(backend))
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        raise _failure_from_exception(e) from None
    if resp.status_code != 200:
        raise _failure_from_response(resp, resp.content)
    try:
        body = resp.json()
    except ValueError:
        raise UpstreamFailure("bad_response", "the backend's response is not JSON",
                              resp.status_code) from None
    if not isinstance(body, dict):
        raise UpstreamFailure("bad_response", "the backend's response is not an object")
    return body


class UpstreamStream:
    """The events of an open streaming response; `done` once [DONE] arrived."""

    def __init__(self, resp: httpx.Response, cm, deadline: float) -> None:
        self.resp, self._cm, self.deadline = resp, cm, deadline
        self.done = False
        self._lines = resp.aiter_lines()

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                async with asyncio.timeout(remaining):
                    line = await self._lines.__anext__()
            except StopAsyncIteration:
                if self.done:
                    raise
                raise UpstreamFailure("stream_cut", "the backend's stream ended without "
                                                    "[DONE]") from None
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                raise _failure_from_exception(e) from None
            if not line.startswith("data:"):
                continue          # blank separators, comments (pings), event names
            data = line[5:].strip()
            if data == "[DONE]":
                self.done = True
                continue
            try:
                event = json.loads(data)
            except ValueError:
                raise UpstreamFailure("bad_response", "the backend sent an event that is not "
                                                      "JSON") from None
            if isinstance(event, dict):
                return event

    async def aclose(self) -> None:
        await self._cm.__aexit__(None, None, None)


async def open_stream(client: httpx.AsyncClient, backend: Backend, path: str,
                      payload: dict) -> UpstreamStream:
    """Send a streaming request and check the response head (UpstreamFailure if it is not
    a 200 event stream)."""
    deadline = time.monotonic() + backend.config.timeouts.total
    cm = client.stream("POST", backend.config.url + path, json=payload,
                       headers=backend.headers(), timeout=_timeout(backend))
    try:
        async with asyncio.timeout(backend.config.timeouts.first_token):
            resp = await cm.__aenter__()
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        raise _failure_from_exception(e) from None
    if resp.status_code != 200:
        try:
            text = await resp.aread()
        except httpx.HTTPError:
            text = b""
        await cm.__aexit__(None, None, None)
        raise _failure_from_response(resp, text)
    return UpstreamStream(resp, cm, deadline)
