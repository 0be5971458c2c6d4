"""A request body, read and checked before any model work: size, JSON, text, schema.

    req = await parse_body(request, state, ChatCompletionRequest)   # or raises ApiError

- larger than the limit: 413, counted while reading (a missing or false Content-Length
  does not get past it);
- not JSON, or not a JSON object: 400 `invalid_json`;
- a string anywhere (a key or a value) holding a lone UTF-16 surrogate (`"\\ud800"` is
  legal JSON but not Unicode text, and no tokenizer takes it): 400 `invalid_text`, naming
  where it is;
- not what the pydantic model declares: 400 with the field as `param`.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from fastapi import Request
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ValidationError

from .errors import ApiError, bad_request, validation_code, validation_message

if TYPE_CHECKING:   # the gateway reads bodies too, without the engine (and torch)
    from .generation import ServerState

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # a JSON escape of one


def too_big(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes; send a smaller one "
                         f"(the server's --max-body-mib sets the limit).",
                    code="request_too_large")


def find_lone_surrogate(data) -> tuple[str, str] | None:
    """(JSON path, the offending character as an escape) of the first string that holds a
    lone surrogate, or None. Walks dicts and lists iteratively (bodies may nest deeply)."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            m = _SURROGATE.search(value)
            if m:
                return path or "body", f"\\u{ord(m.group()):04x}"
        elif isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                stack.append((k, sub))
                stack.append((v, sub))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


async def parse_body(request: Request, state: ServerState, model: type[BaseModel]):
    """The body as `model`, or an ApiError (413, 400) that says what is wrong."""
    _, req = await read_body(request, state.limits.max_body_bytes, model)
    return req


async def _read_raw(request: Request, limit: int) -> bytes:
    """The body's bytes, read from the ASGI messages directly (Request.stream's async
    generator cost measurable time per request in the gateway)."""
    if hasattr(request, "_body"):             # read already
        if len(request._body) > limit:
            raise too_big(limit)
        return request._body
    if getattr(request, "_stream_consumed", False):
        raise RuntimeError("the request body was consumed already")
    chunks, size = [], 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_big(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_body(request: Request, limit: int, model: type[BaseModel]):
    """(the body as a JSON dict, the body as `model`), or an ApiError (413, 400) that says
    what is wrong. The dict keeps fields `model` ignores (a proxy forwards them)."""
    raw = await _read_raw(request, limit)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON ({e}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}.",
                          code="invalid_json")
    # a lone surrogate can only come from a \\u escape (UTF-8 bytes cannot encode one)
    bad = find_lone_surrogate(data) if _SURROGATE_ESCAPE.search(raw) else None
    if bad is not None:
        path, char = bad
        raise ApiError(400, f"{path}: the string holds a lone UTF-16 surrogate ({char}), "
                            f"which is not Unicode text; send valid UTF-8 (pair the "
                            f"surrogate or remove it).", param=path,
                       code="invalid_text")
    try:
        return data, model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        message, param = validation_message(errors)
        status = 413 if any(err.get("type") == "too_long" for err in errors) else 400
        raise ApiError(status, message, param, "too_many_items" if status == 413
                       else validation_code(errors)) from None
