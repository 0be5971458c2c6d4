"""The bound around every wait on a backend: a time limit, and one exception for all the
ways the wait can fail.

    async with within(2.0):                 # seconds; None: no limit
        resp = await client.request(...)    # an HttpError or the limit passing ...
    # ... leaves the block as UpstreamFailure ("transport_error", "connect_error", "timeout")

A response whose wait is cut short closes itself (http_client.py), so leaving the block by
an exception never leaves a half-read connection in the pool.
"""

from __future__ import annotations

import asyncio

from ..http_client import HttpError
from .failure import UpstreamFailure, failure_from_exception


class within:
    """`async with within(seconds):` the block runs for at most `seconds`; HttpError and
    TimeoutError (the limit's or the block's own) leave it as UpstreamFailure, any other
    exception as it is. `expired`: the failure's message for a timeout (the "timeout"
    outcome either way)."""

    __slots__ = ("_timeout", "_expired")

    def __init__(self, seconds: float | None, expired: str | None = None) -> None:
        self._timeout = asyncio.timeout(seconds)
        self._expired = expired

    async def __aenter__(self) -> within:
        await self._timeout.__aenter__()
        return self

    async def __aexit__(self, kind, exc, tb) -> bool | None:
        try:
            suppressed = await self._timeout.__aexit__(kind, exc, tb)
        except asyncio.TimeoutError as e:          # this limit passed
            raise self._failure(e) from None
        if isinstance(exc, (HttpError, asyncio.TimeoutError)):
            raise self._failure(exc) from None
        return suppressed

    def _failure(self, e: BaseException) -> UpstreamFailure:
        if self._expired is not None and isinstance(e, asyncio.TimeoutError):
            return UpstreamFailure("timeout", self._expired, cause=type(e).__name__)
        return failure_from_exception(e)
