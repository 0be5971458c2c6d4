"""A fast OpenAI-compatible backend for gateway benchmarks: it answers at once (or streams
`--tokens` chunks `--itl-ms` apart) without a model, so what a benchmark measures in front
of it is the gateway's own cost.

    python -m qserve.runtime.benchmark.echo_backend --port 9001 [--tokens 16 --itl-ms 5]

Plain ASGI (no framework) to keep its own per-request cost small and steady.
"""

from __future__ import annotations

import argparse
import asyncio
import json


def _app(tokens: int, itl_s: float, model: str):
    models = json.dumps({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "echo"}]}).encode()

    async def read_body(receive) -> bytes:
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        return body

    async def send_json(send, status: int, payload: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET":
            if path == "/health":
                return await send_json(send, 200, b'{"status":"ok"}')
            if path == "/v1/models":
                return await send_json(send, 200, models)
            return await send_json(send, 404, b'{"error":{"message":"no route"}}')
        body = json.loads(await read_body(receive) or b"{}")
        chat = path.endswith("/chat/completions")
        words = [f" w{i}" for i in range(tokens)]
        if not body.get("stream"):
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            out = {"id": "echo", "object": "chat.completion" if chat else "text_completion",
                   "created": 0, "model": body.get("model"), "choices": [choice],
                   "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                             "total_tokens": 8 + tokens}}
            return await send_json(send, 200, json.dumps(out).encode())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        head = {"id": "echo", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0, "model": body.get("model")}
        for i, w in enumerate(words):
            if itl_s and i:
                await asyncio.sleep(itl_s)
            c = ({"index": 0, "delta": {"content": w}, "finish_reason": None} if chat else
                 {"index": 0, "text": w, "finish_reason": None})
            data = json.dumps({**head, "choices": [c]})
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                        "more_body": True})
        c = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat else
             {"index": 0, "text": "", "finish_reason": "length"})
        tail = f"data: {json.dumps({**head, 'choices': [c]})}\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail.encode()})

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--model", default="echo")
    a = p.parse_args(argv)
    uvicorn.run(_app(a.tokens, a.itl_ms / 1000, a.model), host="127.0.0.1", port=a.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
