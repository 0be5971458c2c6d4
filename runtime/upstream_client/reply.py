"""One request to one backend, bounded in time: its response head, or its whole answer.

    resp = await send(client, "POST", url, body, headers, timeout=120, connect_timeout=2)
    reply = await fetch(client, "GET", url + "/v1/models", timeout=5, connect_timeout=2)
    reply.status, reply.headers, reply.body, reply.json()

Every failure is an UpstreamFailure (failure.py). A response cut short closes its own
connection; a `send` caller owns the response it gets and closes it (HttpResponse.close,
or LineStream.close for a stream) on every path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..http_client import HttpClient, HttpResponse
from .failure import UpstreamFailure
from .timeout import within


@dataclass(frozen=True)
class Reply:
    """A whole answer."""

    status: int
    headers: dict[str, str]    # lower-case names
    body: bytes

    def json(self):
        """The body parsed; UpstreamFailure ("bad_response", `cause` the parser's
        exception class) when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise UpstreamFailure("bad_response", "the backend's response is not JSON",
                                  cause=type(e).__name__) from None


async def send(client: HttpClient, method: str, url: str, body: bytes = b"",
               headers: dict[str, str] | None = None, *, timeout: float | None,
               connect_timeout: float | None) -> HttpResponse:
    """Send a request; its response once the head arrived, within `timeout` s (connecting
    within `connect_timeout` s of that). The body is still to read."""
    async with within(timeout):
        return await client.request(method, url, body, headers, connect_timeout)


async def fetch(client: HttpClient, method: str, url: str, body: bytes = b"",
                headers: dict[str, str] | None = None, *, timeout: float | None,
                connect_timeout: float | None) -> Reply:
    """Send a request and read its whole answer, all of it within `timeout` s."""
    async with within(timeout):
        resp = await client.request(method, url, body, headers, connect_timeout)
        data = await resp.read()
    return Reply(resp.status, resp.headers, data)
