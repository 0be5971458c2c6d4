"""The FastAPI app: OpenAI-compatible routes over one shared AsyncEngine.

    app = create_app(AsyncEngine(LLMEngine.from_model(lm, cfg)), lm.tokenizer, "smollm2-135m",
                     api_key=None, limits=ServerLimits(max_in_flight=128))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes
    POST /v1/completions, /v1/chat/completions    (streaming over SSE, or one JSON body)
    GET  /v1/models, /v1/models/{id}
    GET  /health, /metrics (Prometheus text)
    POST /tokenize, /detokenize; GET /tokenizer_info   (vLLM shapes, for lm-eval)
    GET  /                                           a small chat page

With an API key every /v1 route needs `Authorization: Bearer KEY` (compared in constant
time); the others stay open, as in vLLM. Bodies are parsed here rather than by FastAPI so
that size limits, malformed JSON and type errors all end as OpenAI error objects.
"""

from __future__ import annotations

import hmac
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from ..async_engine import AsyncEngine
from ..tokenizer import Tokenizer
from .chat import chat_prompt_ids, create_chat_completion
from .completions import check_model, create_completion
from .body import parse_body, too_big
from .disagg_routes import DisaggRole, install_disagg_routes
from .errors import ApiError, bad_request, install_error_handlers
from .generation import ServerLimits, ServerState
from .logprobs import token_text
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# the bodies the routes parse themselves (parse_body), declared in /openapi.json
REQUEST_BODIES = {"/v1/completions": CompletionRequest,
                  "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


class _Guard:
    """ASGI middleware: API key on /v1 routes, a full server and the declared body size,
    before any work."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self._refusal(scope)
            if err is not None:
                resp = JSONResponse(err.body(), err.status, headers=err.headers)
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        """What to answer at once, or None: a missing or wrong API key (401), a full server
        (429: before reading or parsing the body, the cheapest answer a burst of extra
        requests can get while the engine keeps the cores busy), a declared body over the
        limit (413)."""
        headers = dict(scope.get("headers") or [])
        key = self.state.api_key
        if key and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode("utf-8"), key.encode("utf-8")):
                return ApiError(401, "missing or incorrect API key: send the header "
                                     "'Authorization: Bearer KEY'.", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        if scope["path"] in GENERATION_PATHS and self.state.full():
            return self.state.overloaded(1)
        length = headers.get(b"content-length")
        try:
            oversize = length is not None and int(length) > self.state.limits.max_body_bytes
        except ValueError:
            oversize = False
        return too_big(self.state.limits.max_body_bytes) if oversize else None


def create_app(async_engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
               api_key: str | None = None, limits: ServerLimits | None = None,
               identity: dict | None = None, disagg: DisaggRole | None = None,
               tool_call_parser: str = "auto") -> FastAPI:
    """identity: the artifact's digests (artifact_identity), shown in every model card
    under "qserve" so that a gateway can pin traces and cache entries to the weights.
    disagg: the prefill/decode role (disagg_routes.py); default both (colocated).
    tool_call_parser: the tool-call format's name (runtime/tools), or "auto" (from the
    chat template)."""
    state = ServerState(async_engine, tokenizer, model_name, limits or ServerLimits(), api_key,
                        tool_call_parser)
    state.disagg = disagg or DisaggRole()
    app = FastAPI(title="qserve", summary="OpenAI-compatible server for qserve models",
                  docs_url="/docs", redoc_url=None)
    app.state.qserve = state

    def on_error(request: Request, status: int) -> None:
        if request.url.path in GENERATION_PATHS and status != 429 and status < 500:
            state.metrics.outcome("invalid")

    install_error_handlers(app, on_error)
    app.add_middleware(_Guard, state=state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, state, CompletionRequest)
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(request, state, ChatCompletionRequest)
        return await create_chat_completion(state, req, request)

    def model_card() -> dict:
        card = {"id": model_name, "object": "model", "created": state.created,
                "owned_by": "qserve", "root": model_name, "max_model_len": state.max_model_len}
        if identity is not None:
            card["qserve"] = dict(identity)
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(state, model_id)
        return model_card()

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            raise ApiError(503, "the engine loop is not running.", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(async_engine.stats(), state.limits.max_in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_body(request, state, TokenizeRequest)
        check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages.", "prompt")
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = chat_prompt_ids(state, req.messages, req.add_generation_prompt)
        strs = [token_text(tokenizer, t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse_body(request, state, DetokenizeRequest)
        check_model(state, req.model)
        vocab = tokenizer.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}), got {bad[:5]}.", "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "pad_token": None, "unk_token": None,
                "eos_token_ids": list(tokenizer.eos_token_ids),
                "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
                "model_max_length": state.max_model_len, "vocab_size": tokenizer.vocab_size}

    install_disagg_routes(app, state)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        page = resources.files(__package__).joinpath("static/chat.html")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document plus the request bodies of REQUEST_BODIES, which it cannot see
    because those routes read the body themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             routes=app.routes)
        models = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_BODIES.items():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            models.update(js.pop("$defs", {}))
            models[model.__name__] = js
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema
