"""The lines of a streaming response (server-sent events), each read within a time limit.

    lines = LineStream(resp, read_timeout=120.0, deadline=time.monotonic() + 600)
    try:
        while line := await lines.readline():     # b"data: {...}\\n", b"\\n", ...
            yield line                            # to the client, one line at a time
    finally:
        lines.close()        # the client left or the stream broke: the backend sees it go

A relay that is cancelled (its client disconnected; Starlette's StreamingResponse cancels
the generator) runs its `finally`, so the backend's connection is closed and the backend
aborts the request. After the last line the connection goes back to the pool instead.
"""

from __future__ import annotations

import asyncio
import time

from ..http_client import HttpResponse
from .failure import failure_from_exception
from .timeout import within


class LineStream:
    """Lines of `resp`, each within `read_timeout` s and all before `deadline` (monotonic
    s; None: no overall limit). A break or a timeout raises UpstreamFailure; whole lines
    that arrived before a break still come out first."""

    def __init__(self, resp: HttpResponse, read_timeout: float | None,
                 deadline: float | None = None) -> None:
        self.resp = resp
        self.read_timeout = read_timeout
        self.deadline = deadline

    async def readline(self) -> bytes:
        """The next line with its b"\\n"; b"" once the response ended."""
        limit = self.read_timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise failure_from_exception(asyncio.TimeoutError())
            limit = left if limit is None else min(left, limit)
        async with within(limit):
            return await self.resp.readline()

    def close(self) -> None:
        """Drop the connection unless the response ended (then it is pooled)."""
        self.resp.close()
