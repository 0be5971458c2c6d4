"""The gateway's FastAPI app: OpenAI-compatible routes in front of the backends.

    state = GatewayState(load_config("gateway.yaml"), "gateway.yaml")
    uvicorn.run(create_gateway_app(state), host="127.0.0.1", port=8080)

Routes
    POST /v1/chat/completions, /v1/completions   (streaming or not; model may be "auto")
    GET  /v1/models                             the groups, aliases and "auto" a key may use
    GET  /health, /metrics (Prometheus text)

A request is checked in the order that spends least on a bad one: API key (401), body
(the same 400/413 OpenAI error objects as `qserve serve`), model (404, or 403 when the key
may not use it), input guardrails (400 when an entity is blocked), rate limits (429 with
Retry-After and x-ratelimit-* headers); then the cache and the proxy. Every response
carries x-request-id and x-qserve-gateway-overhead-ms; routed ones x-qserve-route (and
x-qserve-difficulty for model "auto"). SIGHUP reloads the config without dropping streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hmac
import itertools
import logging
import secrets
import signal
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import telemetry
from ..server.body import read_body
from ..server.errors import ApiError, error_body, install_error_handlers
from ..server.protocol import ChatCompletionRequest, CompletionRequest
from .config import ApiKey
from .disconnect import ClientGone, unless_disconnected
from .guardrails import GuardrailBlocked, RequestGuard
from .payload import estimate_tokens, is_chat, map_text
from .exchange import Exchange
from .proxy import Proxy
from .rate_limiter import RateLimited, TooLarge
from .response_cache import cache_key
from .semantic_cache import semantic_query
from .routing import UnknownModel
from .state import GatewayState
from .trace import Trace

log = logging.getLogger("qserve.gateway")


def _authenticate(state: GatewayState, request: Request) -> ApiKey | None:
    """The caller's key (None when the gateway has no keys), or a 401. Every configured
    key is compared, in constant time, so timing does not tell which prefix matched."""
    keys = state.config.keys
    if not keys:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given_b = given.strip().encode("utf-8")
    match = None
    for k in keys:
        if hmac.compare_digest(given_b, k.key.encode("utf-8")) and scheme.lower() == "bearer":
            match = k
    if match is None:
        raise ApiError(401, "missing or incorrect API key: send the header "
                            "'Authorization: Bearer KEY'.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return match


def _may_use(key: ApiKey | None, model: str | None, group: str | None) -> bool:
    """Whether `key` may send `model` (which resolves to `group`): a key with a models list
    may use the names on it and every alias of a group on it."""
    return key is None or key.models is None or model in key.models or group in key.models


class _RequestId:
    """The gateway's front ASGI layer: an id and an arrival time for every request
    (request.state.id, .t0), and the x-request-id and x-qserve-gateway-overhead-ms headers on every response
    (the proxy sets the latter to the time spent before the upstream call; for answers the
    gateway gives itself it is the whole time).

    It runs before FastAPI (see _GatewayApp), and the generation routes (`fast`: path ->
    handler) are called from here directly rather than through FastAPI's telemetry and
    body-limit layers, router, dependency solving and exception middlewares, which cost a
    measurable share of the gateway's per-request time; their errors become the same
    OpenAI error objects. Request ids: a random per-process prefix and a counter (a uuid4
    per request cost more than the rest of this layer)."""

    def __init__(self, app, clock, fast: dict | None = None) -> None:
        self.app, self.clock, self.fast = app, clock, fast or {}
        self._ids = itertools.count()
        self._prefix = f"gw-{secrets.token_hex(4)}"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = self.clock()
        rid = None
        for k, v in scope.get("headers") or []:
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:128]
        rid = rid or f"{self._prefix}{next(self._ids):08x}"
        scope.setdefault("state", {}).update(id=rid, t0=t0)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=self._headers(message.get("headers"), rid, t0))
            await send(message)

        handler = self.fast.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send_with_headers)
        try:
            response = await handler(Request(scope, receive))
        except ApiError as e:
            response = JSONResponse(e.body(), e.status, headers=e.headers)
        except Exception as e:
            log.exception("internal error on POST %s", scope["path"])
            response = JSONResponse(error_body(f"internal server error ({type(e).__name__}); "
                                               "the gateway logged the details.",
                                               "server_error", code="internal_error"), 500)
        if type(response) in (Response, JSONResponse) and not response.background:
            # a whole body: sent here, without the response object's own ASGI call
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": self._headers(response.raw_headers, rid, t0)})
            await send({"type": "http.response.body", "body": response.body})
            return
        if type(response) is StreamingResponse and not response.background:
            with contextlib.suppress(ClientGone):     # the relay's finally closed upstream
                await unless_disconnected(receive, _stream(response, send_with_headers))
            return
        await response(scope, receive, send_with_headers)

    def _headers(self, headers, rid: str, t0: float) -> list:
        """`headers` with x-request-id and, unless the proxy set it, the overhead."""
        headers = list(headers or ())
        headers.append((b"x-request-id", rid.encode("latin-1")))
        if not any(k.lower() == b"x-qserve-gateway-overhead-ms" for k, _ in headers):
            ms = (self.clock() - t0) * 1000
            headers.append((b"x-qserve-gateway-overhead-ms", f"{ms:.3f}".encode()))
        return headers


async def _stream(response: StreamingResponse, send) -> None:
    """A streaming response's ASGI messages (its own call would also watch for the
    client's disconnect, with an anyio task group; unless_disconnected does that here)."""
    body = response.body_iterator
    try:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})
        async for chunk in body:
            if not isinstance(chunk, (bytes, memoryview)):
                chunk = chunk.encode(response.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:    # cancelled between chunks: close the relay now (its finally frees upstream)
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()


class _GatewayApp(FastAPI):
    """FastAPI behind the front layer: the server calls `front` for every HTTP request,
    which answers the generation routes itself and hands the rest to FastAPI."""

    front: _RequestId | None = None

    async def __call__(self, scope, receive, send):
        if self.front is not None and scope["type"] == "http":
            return await self.front(scope, receive, send)
        return await super().__call__(scope, receive, send)


def create_gateway_app(state: GatewayState) -> FastAPI:
    proxy = Proxy(state)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        # everything loaded so far lives as long as the process: keep it out of the
        # collector's generations, so a full collection does not pause a request
        gc.freeze()
        refresh = asyncio.get_running_loop().create_task(state.refresh_versions())
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP,
                                    lambda: loop.create_task(state.reload()))
        yield
        refresh.cancel()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGHUP)
        await state.close()

    app = _GatewayApp(title="qserve gateway", summary="OpenAI-compatible LLM gateway",
                  docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.gateway = state
    install_error_handlers(app)

    async def generate(request: Request, path: str, model_cls) -> object:
        trace = Trace(request.state.id, time.time(), path)
        # the request's span (runtime/telemetry.py; None while tracing is off), under the
        # client's traceparent; the proxy ends it once the answer is out
        span = telemetry.start_span(f"gateway POST {path}", {"http.route": path},
                                    parent=telemetry.extract(request.headers), kind="server")
        try:
            with telemetry.current(span):
                return await admit(request, path, model_cls, trace, span)
        except ApiError as e:
            if trace.total_ms is None:    # refused before reaching the proxy
                trace.status, trace.error = e.status, e.message
                trace.total_ms = round((state.clock() - request.state.t0) * 1000, 3)
                state.metrics.inc("requests_total", "-", str(e.status))
                state.tracer.write(trace)
                telemetry.end(span, {"http.response.status_code": e.status})
            raise

    async def admit(request: Request, path: str, model_cls, trace: Trace, span) -> object:
        t0 = request.state.t0
        key = _authenticate(state, request)
        trace.key = key.name if key else None
        data, _ = await read_body(request, state.config.limits.max_body_bytes, model_cls)
        model = data.get("model")
        try:
            route = state.router.resolve(model, data.get("messages"),
                                         data.get("prompt") if isinstance(data.get("prompt"),
                                                                          str) else None)
        except UnknownModel:
            raise ApiError(404, f"the model {model!r} does not exist here; GET /v1/models "
                                f"lists {', '.join(state.router.model_names())}.",
                           param="model", code="model_not_found") from None
        if not _may_use(key, model, route.chain[0]):
            raise ApiError(403, f"the key {key.name!r} may not use model {model!r}; it may use "
                                f"{', '.join(key.models)}.", param="model",
                           code="model_not_allowed")
        trace.model, trace.route, trace.stream = model, route.reason, bool(data.get("stream"))
        headers = {"x-qserve-route-reason": route.reason}
        if route.difficulty is not None:
            trace.difficulty = route.difficulty.score
            headers["x-qserve-difficulty"] = (f"{route.difficulty.target} "
                                              f"score={route.difficulty.score:.3f}")
            state.metrics.inc("auto_route_total", route.difficulty.target)
        policy = state.config.guardrails
        guard = RequestGuard(policy) if policy is not None else None
        body = {k: v for k, v in data.items() if k != "model"}
        if guard is not None:
            try:
                with telemetry.span("gateway.guardrails"):
                    body = map_text(body, guard.check_input)
            except GuardrailBlocked as g:
                state.metrics.guardrail_actions(guard.actions)
                raise ApiError(400, str(g), code="pii_blocked") from None
        grant = None
        if key is not None:
            tokens = estimate_tokens(body, state.config.limits.default_max_tokens)
            try:
                grant = state.limiter.admit(key.name, tokens, state.clock())
            except RateLimited as r:
                state.metrics.inc("rate_limited_total", key.name, r.limit)
                wait = max(1, int(r.retry_after + 0.999))
                raise ApiError(429, str(r), code="rate_limit_exceeded",
                               headers={**r.headers, "Retry-After": str(wait)}) from None
            except TooLarge as e:
                raise ApiError(400, str(e), param="max_tokens", code="tokens_exceed_limit") \
                    from None
            headers.update(grant.headers)
        if state.config.trace.zero_retention is False:
            trace.request = {k: body[k] for k in ("messages", "prompt") if k in body}
        ckey = squery = None  # None: not cached (cache off, or a request it never keeps)
        if state.config.cache.enabled or state.config.cache.semantic.enabled:
            versions = sorted(state.backends[b].version(state.router.groups[route.chain[0]].model)
                              .key for b in state.router.groups[route.chain[0]].backends)
            keyed = dict(body, model=route.chain[0])
            if state.config.cache.enabled:
                ckey = cache_key(path, keyed, "|".join(versions))
            if state.config.cache.semantic.enabled and state.embedder is not None:
                squery = semantic_query(path, keyed, "|".join(versions),
                                        state.config.cache.semantic)
        stream_options = data.get("stream_options") or {}
        ex = Exchange(request.state.id, path, is_chat(path), body, bool(data.get("stream")),
                      bool(stream_options.get("include_usage")), route, guard, grant, trace, t0,
                      ckey, headers, semantic=squery, span=span)
        try:
            return await proxy.handle(request, ex)
        except BaseException:
            proxy.finish(ex)
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", CompletionRequest)

    app.front = _RequestId(functools.partial(FastAPI.__call__, app), state.clock,
                           fast={"/v1/chat/completions": chat_completions,
                                 "/v1/completions": completions})

    @app.get("/v1/models")
    async def models(request: Request):
        key = _authenticate(state, request)
        names = [n for n in state.router.model_names()
                 if _may_use(key, n, state.router.names.get(n))]
        created = int(time.time())
        data = []
        for n in names:
            group = state.router.names.get(n)
            card = {"id": n, "object": "model", "created": created, "owned_by": "qserve-gateway"}
            if group is not None:
                card["group"] = group
                card["backends"] = list(state.router.groups[group].backends)
            data.append(card)
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        now = state.clock()
        up = [b.name for b in state.backends.values() if b.breaker.available(now)]
        if not up:
            return JSONResponse({"status": "degraded", "backends_available": []}, 503)
        return {"status": "ok", "backends_available": up}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(state.backends.values(), state.clock())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
