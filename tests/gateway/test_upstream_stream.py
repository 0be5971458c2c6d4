"""UpstreamStream over a broken connection: every whole event that arrived before the
break reaches the client, then the failure."""

import asyncio
import time

import aiohttp
import pytest
from aiohttp.streams import StreamReader

from runtime.gateway.upstream import UpstreamFailure, UpstreamStream


class _Protocol:                   # what StreamReader asks of its connection
    _reading_paused = False

    def pause_reading(self, **_):
        pass

    def resume_reading(self, **_):
        pass


class _Response:
    def __init__(self, content):
        self.content = content


async def _read_all(data: bytes, error: BaseException | None):
    content = StreamReader(_Protocol(), 2 ** 16, loop=asyncio.get_running_loop())
    content.feed_data(data)
    if error is None:
        content.feed_eof()
    else:
        content.set_exception(error)        # the break lands before the reader wakes
    stream = UpstreamStream(_Response(content), time.monotonic() + 5)
    events = []
    try:
        async for event in stream:
            events.append(event["n"])
    except UpstreamFailure as f:
        return events, f.outcome
    return events, None


def test_events_buffered_before_a_break_are_delivered_then_the_failure():
    data = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: {"n": 3'     # the third one is cut
    events, outcome = asyncio.run(_read_all(data, aiohttp.ClientPayloadError("cut")))
    assert events == [1, 2]
    assert outcome == "transport_error"


def test_a_stream_without_done_is_a_cut_stream():
    events, outcome = asyncio.run(_read_all(b'data: {"n": 1}\n\n', None))
    assert (events, outcome) == ([1], "stream_cut")


def test_a_stream_with_done_ends_cleanly():
    events, outcome = asyncio.run(_read_all(b'data: {"n": 1}\n\ndata: [DONE]\n\n', None))
    assert (events, outcome) == ([1], None)


@pytest.mark.parametrize("data", [b"", b'data: {"n'])
def test_a_break_with_no_whole_event_buffered_raises_at_once(data):
    events, outcome = asyncio.run(_read_all(data, aiohttp.ClientPayloadError("cut")))
    assert (events, outcome) == ([], "transport_error")
