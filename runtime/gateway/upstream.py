"""One HTTP exchange with a backend: a JSON response, or a stream of SSE events.

    body, raw = await call_json(client, backend, "/v1/chat/completions", payload)
    stream = await open_stream(client, backend, path, payload)    # head checked
    async for event in stream: ...                                 # dict per `data:` line
    await stream.aclose()

`client` is the gateway's HttpClient (http_client.py): its cost per request decides much
of the overhead a gateway adds (httpx's pure-Python client took about half of the
gateway's CPU time per request; aiohttp's a quarter more than HttpClient).

The waits, the line reading and the failures are the shared upstream client's
(runtime/upstream_client/): failures raise UpstreamFailure with an `outcome` for traces
and metrics and whether another attempt may help: connection errors, timeouts, 5xx and
429 may; any other 4xx is the client's request and is answered as the backend answered it.
"""

from __future__ import annotations

import json
import time

from .. import telemetry
from ..http_client import HttpClient
from ..upstream_client import (LineStream, UpstreamFailure, failure_from_response, send,
                               within)
from .backend import Backend

__all__ = ["UpstreamFailure", "UpstreamStream", "call_json", "open_stream"]


def _post(client: HttpClient, backend: Backend, path: str, payload: dict, timeout: float):
    """The response head of POST `path` within `timeout` s."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    headers = telemetry.inject({"content-type": "application/json", **backend.headers()})
    return send(client, "POST", backend.config.url + path, body, headers, timeout=timeout,
                connect_timeout=backend.config.timeouts.connect)


async def call_json(client: HttpClient, backend: Backend, path: str,
                    payload: dict) -> tuple[dict, bytes]:
    """The backend's JSON response to `payload` and its bytes (UpstreamFailure on any
    failure). Timeouts: the response head within `first_token`, all of it within `total`."""
    t = backend.config.timeouts
    async with within(t.total):
        resp = await _post(client, backend, path, payload, t.first_token)
        text = await resp.read()
    if resp.status != 200:
        raise failure_from_response(resp.status, resp.headers, text)
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
        self.resp = resp
        self.lines = LineStream(resp, backend.config.timeouts.first_token, deadline)
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        while True:
            if self.done:
                raise StopAsyncIteration
            line = await self.lines.readline()
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
        self.lines.close()


async def open_stream(client: HttpClient, backend: Backend, path: str,
                      payload: dict) -> UpstreamStream:
    """Send a streaming request and check the response head (UpstreamFailure if it is not
    a 200)."""
    t = backend.config.timeouts
    deadline = time.monotonic() + t.total
    resp = None
    try:
        async with within(min(t.first_token, t.total)):
            resp = await _post(client, backend, path, payload, None)
            if resp.status != 200:
                text = await resp.read()
    except UpstreamFailure:
        if resp is None:
            raise
        text = b""  # the error body was cut short (the response closed itself)
    if resp.status != 200:
        raise failure_from_response(resp.status, resp.headers, text)
    return UpstreamStream(resp, backend, deadline)
