"""A scriptable OpenAI-compatible backend for gateway tests, and uvicorn in a thread.

    backend = FakeBackend("b1", words=["Hello", " world"])
    backend.script = ["500", "ok"]        # the next requests' behaviours, then "ok"
    with ServerThread(backend.app) as url: ...

Behaviours: ok, 500, 429 (Retry-After: retry_after), 400, hang (no response head),
hang_stream (a head, then nothing), die (a few chunks, then the connection drops),
error_event (an error event before any content), slow (sleep `delay` s per chunk).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class FakeBackend:
    def __init__(self, name: str, words: list[str] | None = None, model: str = "m",
                 artifact_digest: str | None = None, retry_after: str = "1",
                 delay: float = 0.0) -> None:
        self.name, self.model = name, model
        self.words = words or ["Hello", ",", " world", "."]
        self.artifact_digest = artifact_digest
        self.retry_after, self.delay = retry_after, delay
        self.script: list[str] = []
        self.requests: list[dict] = []     # bodies received
        self.cancelled = 0                 # streams whose client went away mid-way
        self.completed = 0
        self.app = self._build()

    def _next(self) -> str:
        return self.script.pop(0) if self.script else "ok"

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            card = {"id": self.model, "object": "model", "created": 1, "owned_by": "test"}
            if self.artifact_digest:
                card["qserve"] = {"artifact_digest": self.artifact_digest,
                                  "gate_report_digest": "g-" + self.artifact_digest}
            return {"object": "list", "data": [card]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.requests.append(body)
            mode = self._next()
            if mode == "500":
                return JSONResponse({"error": {"message": "boom", "type": "server_error",
                                               "param": None, "code": "internal"}}, 500)
            if mode == "429":
                return JSONResponse({"error": {"message": "slow down",
                                               "type": "rate_limit_error", "param": None,
                                               "code": "busy"}}, 429,
                                    headers={"Retry-After": self.retry_after})
            if mode == "400":
                return JSONResponse({"error": {"message": "bad max_tokens",
                                               "type": "invalid_request_error",
                                               "param": "max_tokens", "code": "invalid_value"}},
                                    400)
            if mode == "hang":
                await asyncio.sleep(3600)
            text = "".join(self.words)
            if not body.get("stream"):
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": "stop"}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": "stop"}
                self.completed += 1
                return {"id": "x", "object": "chat.completion" if chat else "text_completion",
                        "created": 1, "model": body.get("model"), "choices": [choice],
                        "usage": {"prompt_tokens": 7, "completion_tokens": len(self.words),
                                  "total_tokens": 7 + len(self.words)}}
            return StreamingResponse(self._stream(body, chat, mode),
                                     media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, False)

        return app

    async def _stream(self, body: dict, chat: bool, mode: str):
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": "s", "object": obj, "created": 1, "model": body.get("model")}

        def chunk(text=None, finish=None, role=False):
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                c = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [c]})}\n\n"

        try:
            if chat:
                yield chunk(role=True, text="")
            if mode == "error_event":
                yield 'data: {"error": {"message": "engine failed", "type": "server_error"}}\n\n'
                yield "data: [DONE]\n\n"
                return
            if mode == "hang_stream":
                await asyncio.sleep(3600)
            for i, w in enumerate(self.words):
                if mode == "die" and i == 2:
                    raise RuntimeError("backend died mid-stream")
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield chunk(text=w)
            yield chunk(finish="stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": len(self.words),
                         "total_tokens": 7 + len(self.words)}
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error", lifespan="on",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.server.force_exit = True   # a scripted hang must not hold the test up
        self.thread.join(timeout=10)
