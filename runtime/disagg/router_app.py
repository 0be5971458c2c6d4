"""`qserve router`: the OpenAI API in front of prefill and decode workers.

    app = create_router_app(RouterState(["http://127.0.0.1:8001"], ["http://127.0.0.1:8002"]))

Routes
    POST /v1/chat/completions, /v1/completions   through the workers (router.py)
    GET  /health      200 while a prefill and a decode worker are up, else 503
    GET  /v1/models   a decode worker's list
    GET  /metrics     Prometheus text: rejections, KV bytes and transfers, worker gauges

Each route is one call of a Router (router.py), which holds what a request's path does:
pick a prefill and a decode worker, admit or refuse the request by its predicted TTFT and
TPOT, prefill remotely or locally, relay the decode worker's answer, retry on another
worker. The app's lifespan starts the router (its workers' first read and the poll that
keeps their health current) and closes it.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..server.errors import install_error_handlers
from ..server.protocol import ChatCompletionRequest, CompletionRequest
from .router import KV_HEADER, Router
from .router_state import RouterState

__all__ = ["KV_HEADER", "create_router_app"]


def create_router_app(state: RouterState) -> FastAPI:
    """The router's FastAPI app over `state` (started and closed by the app's lifespan)."""
    router = Router(state)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="qserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.router = router

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(request, "/v1/completions", CompletionRequest)

    @app.get("/health")
    async def health():
        return router.health()

    @app.get("/v1/models")
    async def models():
        return await router.models()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router.metrics())

    return app
