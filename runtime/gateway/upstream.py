"""One HTTP exchange with a backend: a JSON response, or a stream of SSE events.

    body, raw = await call_json(client, backend, "/v1/chat/completions", payload)
    stream = await open_stream(client, backend, path, payload)    # head checked
    async for event in stream: ...                                 # dict per `data:` line
    await stream.aclose()

`client` is the gateway's HttpClient (http_client.py): its cost per request decides much
of the overhead a gateway adds (httpx's pure-Python client took about half of the
gateway's CPU time per request; aiohttp's a quarter more than HttpClient).

Failures raise UpstreamFailure with an `outcome` for traces and metrics and whether
another attempt may help: connection errors, timeouts, 5xx and 429 may; any other 4xx is
the client's request and is answered as the backend answered it.
"""

from __future__ import annotations

import asyncio
import json
import time

from .. import telemetry
from .backend import Backend
from .backoff import parse_retry_after
from ..http_client import ConnectError, HttpClient, HttpError


class UpstreamFailure(Exception):
    def __init__(self, outcome: str, message: str, status: int | None = None,
                 retry_after: float | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.outcome, self.status, self.retry_after, self.body = outcome, status, retry_after, body

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500


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
    if isinstance(e, asyncio.TimeoutError):
        return UpstreamFailure("timeout", "the backend did not answer in time")
    if isinstance(e, ConnectError):
        return UpstreamFailure("connect_error", "the backend is unreachable")
    return UpstreamFailure("transport_error", f"the connection to the backend failed ({e})")


def _post(client: HttpClient, backend: Backend, path: str, payload: dict):
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    headers = telemetry.inject({"content-type": "application/json", **backend.headers()})
    return client.request("POST", backend.config.url + path, body, headers,
                          connect_timeout=backend.config.timeouts.connect)


async def call_json(client: HttpClient, backend: Backend, path: str,
                    payload: dict) -> tuple[dict, bytes]:
    """The backend's JSON response to `payload` and its bytes (UpstreamFailure on any
    failure). Timeouts: the response head within `first_token`, all of it within `total`."""
    t = backend.config.timeouts
    try:
        async with asyncio.timeout(t.total):
            async with asyncio.timeout(t.first_token):
                resp = await _post(client, backend, path, payload)
            text = await resp.read()
    except (HttpError, asyncio.TimeoutError) as e:  # the response closed itself
        raise _failure_from_exception(e) from None
    if resp.status != 200:
        raise _failure_from_response(resp.status, resp.headers, text)
    try:
        body = json.loads(text)
    except ValueError:
        raise UpstreamFailure("bad_response", "the backend's response is not JSON",
                              resp.status) from None
    if not isinstance(body, dict):
        raise UpstreamFailure("bad_response", "the backend's response is not an object")
    return body, text


class UpstreamStream:
    """The events of an open streaming response; `done` once [DONE] arrived. Each wait for
    the next line is bounded by the backend's `first_token` timeout and the whole stream
    by `total`. After a break, the whole events that arrived before it still come out."""

    def __init__(self, resp, backend: Backend, deadline: float) -> None:
        self.resp, self.deadline = resp, deadline
        self.read_timeout = backend.config.timeouts.first_token
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        while True:
            if self.done:
                raise StopAsyncIteration
            remaining = min(self.deadline - time.monotonic(), self.read_timeout)
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                async with asyncio.timeout(remaining):
                    line = await self.resp.readline()
            except (HttpError, asyncio.TimeoutError) as e:
                raise _failure_from_exception(e) from None
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

    async def aclose(self) -> None:
        """After [DONE] the connection goes back to the pool once the body has ended;
        before, it is closed, which the backend sees as the client going away (it aborts
        the request)."""
        self.resp.close()


async def open_stream(client: HttpClient, backend: Backend, path: str,
                      payload: dict) -> UpstreamStream:
    """Send a streaming request and check the response head (UpstreamFailure if it is not
    a 200)."""
    t = backend.config.timeouts
    deadline = time.monotonic() + t.total
    resp = None
    try:
        async with asyncio.timeout(min(t.first_token, t.total)):
            resp = await _post(client, backend, path, payload)
            if resp.status != 200:
                text = await resp.read()
    except (HttpError, asyncio.TimeoutError) as e:
        if resp is None:
            raise _failure_from_exception(e) from None
        text = b""  # the error body was cut short (the response closed itself)
    if resp.status != 200:
        raise _failure_from_response(resp.status, resp.headers, text)
    return UpstreamStream(resp, backend, deadline)
