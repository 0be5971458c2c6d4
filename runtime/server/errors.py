"""HTTP errors in the OpenAI wire format, and the handlers that make every failure one.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
               "code": "invalid_value"}}

Client input never produces a 500: malformed JSON, wrong types and bad values are 400,
an unknown model 404, a missing or wrong key 401, an oversized body 413, overload 429
(with Retry-After). Only a real server fault is a 500 ("server_error").
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("qserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": type,
                      "param": None if param is None else _printable(param), "code": code}}


def _printable(text: str) -> str:
    """`text` with lone surrogates (from echoed client input) written as \\udXXX escapes,
    so the error itself always encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _loc_to_param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # drop pydantic's union-branch tags such as "str" or "list[int]"
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in
             ("str", "int", "float", "bool", "list", "dict", "function-after")]
    return ".".join(parts) or None


def validation_code(errors: list[dict]) -> str:
    """invalid_type when a value has the wrong JSON type, else invalid_value."""
    kind = errors[0].get("type", "") if errors else ""
    return "invalid_type" if kind.endswith("_type") or kind == "missing" else "invalid_value"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A one-line message and the `param` for pydantic errors."""
    first = errors[0]
    param = _loc_to_param(first.get("loc", ()))
    msgs = []
    for e in errors[:3]:
        where = _loc_to_param(e.get("loc", ())) or "body"
        msg = e.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        msgs.append(f"{where}: {msg}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(msgs) + more, param


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Every error leaves as an OpenAI error object. `on_error(request, status)` is called
    for each (metrics)."""

    def respond(request: Request, status: int, body: dict, headers=None) -> JSONResponse:
        if on_error is not None:
            on_error(request, status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return respond(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        message, param = validation_message(errors)
        return respond(request, 400, error_body(message, param=param,
                                                code=validation_code(errors)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models " \
                      f"and POST /v1/completions, /v1/chat/completions."
        return respond(request, status, error_body(message, _TYPES.get(status, "server_error"),
                                                   code=str(status)), exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return respond(request, 500, error_body(f"internal server error ({type(exc).__name__}); "
                                                "the server logged the details.",
                                                "server_error", code="internal_error"))
