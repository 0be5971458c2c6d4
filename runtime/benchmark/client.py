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

from ..http_client import HttpClient, HttpError
from .errors import BenchmarkError
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
    # the server's own TTFT prediction, seconds, where it sends one (the disaggregation
    # router's x-qserve-predicted-ttft-ms), to set beside the measured ttft
    predicted_ttft: float | None = None


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


async def send(http: HttpClient, cfg: ClientConfig, spec: RequestSpec) -> RequestResult:
    """Send one streaming request; never raises for server-side failures (they are results).
    It goes through the project's own HTTP/1.1 client (runtime/http_client: httptools'
    parser), not a general one, so that the load generator takes as little CPU as it can
    from the server it measures (httpx cost ~0.8 ms of CPU per streamed chunk here, this
    ~0.3 ms). `cfg.request_timeout` bounds the whole request."""
    res = RequestResult(False, spec.prompt_len, 0, spec.output_len)
    # a connection per request: servers end keep-alive connections on their own terms
    # (llama.cpp's after a few requests), and a request sent on one being closed fails
    # for no fault of the server; a loopback handshake is ~0.1 ms against a whole stream
    headers = {"content-type": "application/json", "accept": "text/event-stream",
               "connection": "close"}
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    body = json.dumps(request_body(cfg, spec)).encode()
    res.start = time.perf_counter()
    chunks = 0
    try:
        async with asyncio.timeout(cfg.request_timeout):
            chunks = await _stream(http, cfg.base_url + APIS[cfg.api], body, headers, res)
    except TimeoutError:
        res.error = f"TimeoutError: no end of the stream within {cfg.request_timeout:g} s"
    except (HttpError, json.JSONDecodeError, UnicodeDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    if res.error:
        return res
    res.e2el = time.perf_counter() - res.start
    if not res.usage_reported:
        res.output_len = chunks
    if chunks == 0:
        res.error = "the stream carried no text"
        return res
    res.success = True
    return res


async def _stream(http: HttpClient, url: str, body: bytes, headers: dict[str, str],
                  res: RequestResult) -> int:
    """Read the SSE stream into `res` (TTFT, ITL, usage); the number of chunks that
    carried text. res.error for a failure the server reports (an HTTP error status or an
    error event)."""
    resp = await http.request("POST", url, body, headers)
    chunks = 0
    try:
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            res.error = f"HTTP {resp.status}: {text[:300]}"
            return chunks
        predicted = resp.headers.get("x-qserve-predicted-ttft-ms")
        if predicted is not None:
            try:
                res.predicted_ttft = float(predicted) / 1e3
            except ValueError:
                pass  # not a number: no prediction to compare
        last = res.start
        while line := await resp.readline():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = f"stream error: {str(chunk['error'])[:300]}"
                return chunks
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
    finally:
        resp.close()  # pooled when the response is complete, dropped when cut short
    return chunks


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
