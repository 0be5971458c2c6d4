"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

A chunk counts as output when it carries text (`choices[0].text` for completions,
`choices[0].delta.content` for chat); the first such chunk gives TTFT and every later
gap is one ITL sample. The output token count is the usage chunk's `completion_tokens`
(asked for with `stream_options.include_usage`) where the server sends it, else the
number of text chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from .errors import BenchmarkError
from .sse_connection import HttpProtocolError, SseConnection
from .workloads import RequestSpec

APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    success: bool
    prompt_len: int  # usage.prompt_tokens if reported, else the workload's count
    output_len: int  # usage.completion_tokens if reported, else text chunks
    expected_output_len: int  # max_tokens sent
    start: float = 0.0  # perf_counter() when sent, seconds
    ttft: float = 0.0  # seconds to the first text chunk
    e2el: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    usage_reported: bool = False
    error: str = ""


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    api: str = "completions"  # a key of APIS
    temperature: float = 0.0
    api_key: str | None = None
    request_timeout: float = 600.0


def request_body(cfg: ClientConfig, spec: RequestSpec) -> dict:
    body = {"model": cfg.model, "max_tokens": spec.output_len, "ignore_eos": True,
            "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def chunk_text(chunk: dict) -> str:
    """The text a streamed completions or chat chunk adds ("" for none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    text = first.get("text")
    if text is None:
        text = (first.get("delta") or {}).get("content")
    return text or ""


async def send(cfg: ClientConfig, spec: RequestSpec) -> RequestResult:
    """Send one streaming request; never raises for server-side failures (they are results).
    It goes over its own lean connection (sse_connection), not a general HTTP client, so
    that the load generator takes as little CPU as it can from the server it measures."""
    res = RequestResult(False, spec.prompt_len, 0, spec.output_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    body = json.dumps(request_body(cfg, spec)).encode()
    res.start = last = time.perf_counter()
    chunks = 0
    try:
        async with SseConnection.post(cfg.base_url + APIS[cfg.api], body, headers,
                                      cfg.request_timeout) as r:
            if r.status != 200:
                text = (await r.read_body()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {text[:300]}"
                return res
            async for line in r.lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:300]}"
                    return res
                if chunk_text(chunk):
                    if chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.output_len = int(usage["completion_tokens"])
                    res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
                    res.usage_reported = True
    except (OSError, TimeoutError, asyncio.IncompleteReadError, HttpProtocolError,
            json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2el = time.perf_counter() - res.start
    if not res.usage_reported:
        res.output_len = chunks
    if chunks == 0:
        res.error = "the stream carried no text"
        return res
    res.success = True
    return res


def resolve_model(base_url: str, model: str | None, api_key: str | None = None) -> str:
    """`model` if given, else the first id of the server's /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise BenchmarkError(f"cannot reach {base_url}: {e}. Is the server running? "
                             "Check --endpoint.") from None
    if model:
        return model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchmarkError(f"{base_url}/v1/models answered {r.status_code} without a model "
                             "id; pass --model NAME") from None
