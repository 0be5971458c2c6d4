"""Overload answers 429 at once and leaks nothing; a client leaving mid-stream frees KV."""

import asyncio
import json
import time

from qserve.runtime.server import ServerLimits, create_app

from conftest import assert_error, client_for, run

LONG = {"prompt": [3, 4, 5, 6], "max_tokens": 120, "ignore_eos": True, "temperature": 0}


async def _wait_idle(engine, state, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not engine.engine.has_unfinished and state.metrics.in_flight == 0
                and engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server did not go idle")


def test_overload_rejects_at_once_and_recovers(engine, lm):
    app = create_app(engine, lm.tokenizer, "tiny", limits=ServerLimits(max_in_flight=2,
                                                                       retry_after_s=3))
    state = app.state.qserve

    async def main():
        async with client_for(app) as c:
            running = [asyncio.create_task(c.post("/v1/completions", json=LONG))
                       for _ in range(2)]
            while state.metrics.in_flight < 2:
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            rejected = await c.post("/v1/completions", json={**LONG, "stream": True})
            batch = await c.post("/v1/completions", json={**LONG, "prompt": [[3], [4]]})
            chat = await c.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "x"}]})
            dt = time.monotonic() - t0
            done = await asyncio.gather(*running)
            await _wait_idle(engine, state)
            after = await c.post("/v1/completions", json={**LONG, "max_tokens": 3})
            metrics = (await c.get("/metrics")).text
            return rejected, batch, chat, dt, done, after, metrics

    rejected, batch, chat, dt, done, after, metrics = run(main())
    for r in (rejected, batch, chat):
        assert_error(r, 429, code="server_overloaded")
        assert r.headers["retry-after"] == "3"
    assert dt < 2.0  # answered at once, not queued behind the running requests
    assert [r.status_code for r in done] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in done)
    assert after.status_code == 200
    # refused before their bodies were read (the server was full): one each, even the
    # request of two prompts
    assert 'qserve_requests_total{outcome="rejected"} 3' in metrics
    assert "qserve_requests_in_flight 0" in metrics


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]}


async def _request_then_leave(app, path: str, body: dict, leave) -> list[dict]:
    """Drive the ASGI app directly: send `body`, and disconnect once `leave(messages)` is
    true (messages: what the app has sent so far). Returns the messages the app sent."""
    raw = json.dumps(body).encode()
    sent_body = False
    messages: list[dict] = []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        while not leave(messages):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)

    await asyncio.wait_for(app(_scope(path), receive, send), timeout=30)
    return messages


def _body(messages: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")


async def _stream_then_leave(app, path: str, body: dict, events_before_leaving: int) -> str:
    """A streamed request whose client disconnects after a few SSE events; the text."""
    messages = await _request_then_leave(
        app, path, body, lambda sent: _body(sent).count(b"data: ") >= events_before_leaving)
    return _body(messages).decode()


def test_client_disconnect_aborts_and_frees_blocks(app, engine):
    state = app.state.qserve
    blocks = engine.engine.blocks

    async def main():
        long = {**LONG, "max_tokens": 400, "prompt": list(range(3, 60)), "stream": True}
        text = await _stream_then_leave(app, "/v1/completions", long, 3)
        chat = {"messages": [{"role": "user", "content": "The quick brown fox"}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}
        chat_text = await _stream_then_leave(app, "/v1/chat/completions", chat, 3)
        await _wait_idle(engine, state)
        return text, chat_text

    text, chat_text = run(main())
    assert "[DONE]" not in text and "[DONE]" not in chat_text
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not engine.engine.requests
    assert state.metrics.requests["abort"] == 2
    assert state.metrics.in_flight == 0


def test_many_concurrent_streams_all_correct(app, reference):
    from qserve.runtime.sampling_params import SamplingParams

    prompts = [[3 + i, 7, 11 + 2 * i, 40 + i] for i in range(10)]
    expected = [o.text for o in reference.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]

    async def one(c, p):
        r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True,
                                                  "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(ch["choices"][0]["text"] for ch in chunks)

    async def main():
        async with client_for(app) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert run(main()) == expected


def test_non_streamed_request_is_aborted_when_its_client_leaves(app, engine):
    """The engine stops a non-streamed request whose client has gone and frees its blocks,
    rather than generating to max_tokens for no one."""
    state = app.state.qserve
    blocks = engine.engine.blocks
    generated = []

    def running_a_while():
        # leave once the request holds KV blocks and has produced a few tokens
        used = blocks.num_blocks - blocks.num_free_blocks
        generated.append(state.metrics.generation_tokens)
        return used > 0 and state.metrics.generation_tokens >= 3

    async def main():
        out = []
        for path, body in (
                ("/v1/completions", {**LONG, "max_tokens": 400, "prompt": list(range(3, 60))}),
                ("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "The quick brown fox"}],
                  "max_tokens": 400, "ignore_eos": True})):
            state.metrics.generation_tokens = 0
            out.append(await _request_then_leave(app, path, body,
                                                 lambda _sent: running_a_while()))
            await _wait_idle(engine, state)
        return out

    sent = run(main())
    for messages in sent:
        start = next(m for m in messages if m["type"] == "http.response.start")
        assert start["status"] == 499  # nobody reads it; what the access log shows
    assert state.metrics.requests["abort"] == 2
    assert state.metrics.generation_tokens < 400  # stopped long before max_tokens
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not engine.engine.requests
    assert state.metrics.in_flight == 0


def test_a_request_without_max_tokens_stops_at_the_server_default(engine, lm):
    app = create_app(engine, lm.tokenizer, "tiny", limits=ServerLimits(max_tokens_default=7))

    async def main():
        async with client_for(app) as c:
            chat = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "ignore_eos": True})
            null = await c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": None,
                                                        "ignore_eos": True})
            asked = await c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 9,
                                                         "ignore_eos": True})
            return chat, null, asked

    chat, null, asked = run(main())
    assert chat.json()["usage"]["completion_tokens"] == 7
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert null.json()["usage"]["completion_tokens"] == 7
    assert asked.json()["usage"]["completion_tokens"] == 9  # a request's own limit wins
