"""Work for a client that is cancelled when the client disconnects.

    try:
        result = await unless_disconnected(receive, work())
    except ClientGone:
        ...                    # the client left; `work` was cancelled (its finally blocks ran)

The server (uvicorn, ASGI spec 2.3) does not cancel a request's task when its client goes,
and Starlette's StreamingResponse watches for it with an anyio task group per response,
which cost measurable time to first token; one watcher task does the same.
"""

from __future__ import annotations

import asyncio


class ClientGone(Exception):
    """The client disconnected while the gateway waited on a backend or streamed."""


async def unless_disconnected(receive, coro):
    """Run `coro` in this task; cancel it and raise ClientGone if the client disconnects
    first. `receive`: the request's ASGI receive, called after the body is read, so the
    next message can only be the disconnect. (The work runs in this task: a task of its
    own as well, and asyncio.wait over both, cost a measurable share of the gateway's
    time per request.)"""
    this = asyncio.current_task()
    left = False

    async def gone():
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        this.cancel()

    watch = asyncio.get_running_loop().create_task(gone())
    try:
        return await coro
    except asyncio.CancelledError:
        if left and this.uncancel() == 0:      # our cancel, not the server's
            raise ClientGone from None
        raise
    finally:
        watch.cancel()
