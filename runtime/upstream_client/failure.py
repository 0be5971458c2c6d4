"""A failed exchange with a backend, and whether another attempt may do better.

    try:
        ...
    except UpstreamFailure as f:
        f.outcome        # "timeout" | "connect_error" | "transport_error" | "http_503" | ...
        f.retryable      # no answer, a 5xx or a 429: another attempt (or backend) may help
        f.cause          # the exception class behind it ("TimeoutError", "ConnectError")

A status other than a 5xx or a listed 4xx is the backend's answer to the client's own
request: it goes back to the client as the backend wrote it, and says nothing against the
backend.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Mapping

from ..http_client import ConnectError
from .retry_after import parse_retry_after

RETRYABLE_4XX = (429,)     # a 4xx that another attempt may get past (rate limited)


def is_retryable(status: int | None, retry_4xx: Collection[int] = RETRYABLE_4XX) -> bool:
    """Whether another attempt may get a better answer than `status` (None: no answer came:
    unreachable, timed out, cut short). A 5xx and the statuses in `retry_4xx` may."""
    return status is None or status >= 500 or status in retry_4xx


class UpstreamFailure(Exception):
    """An attempt on a backend failed: `outcome` names how (traces and metrics), `status`
    the HTTP status when the backend answered one, `retry_after` its Retry-After (s),
    `body` its OpenAI error object, `cause` the exception class behind a failure that got
    no answer."""

    def __init__(self, outcome: str, message: str, status: int | None = None,
                 retry_after: float | None = None, body: dict | None = None,
                 cause: str | None = None) -> None:
        super().__init__(message)
        self.outcome, self.status, self.retry_after, self.body = outcome, status, retry_after, body
        self.cause = cause

    @property
    def retryable(self) -> bool:
        return is_retryable(self.status)


def failure_from_exception(e: BaseException) -> UpstreamFailure:
    """The failure for an exchange that raised `e` (an HttpError or a timeout)."""
    cause = type(e).__name__
    if isinstance(e, asyncio.TimeoutError):
        return UpstreamFailure("timeout", "the backend did not answer in time", cause=cause)
    if isinstance(e, ConnectError):
        return UpstreamFailure("connect_error", "the backend is unreachable", cause=cause)
    return UpstreamFailure("transport_error", f"the connection to the backend failed ({e})",
                           cause=cause)


def failure_from_response(status: int, headers: Mapping[str, str],
                          text: bytes) -> UpstreamFailure:
    """The failure for a non-200 answer; `body` is its error object when it sent one."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "error" not in body:
        body = None
    return UpstreamFailure(f"http_{status}", f"the backend answered HTTP {status}", status,
                           parse_retry_after(headers.get("retry-after")), body)
