"""`qserve router`: the OpenAI API in front of prefill and decode workers.

    app = create_router_app(RouterState(["http://127.0.0.1:8001"], ["http://127.0.0.1:8002"]))

A request's path: pick a prefill worker (KV-cache aware: the worker whose approximate
prefix tree holds the longest prefix of the prompt, unless load is imbalanced, SGLang's
rule; selection.py) and a decode worker (least loaded with enough free KV blocks);
predict TTFT and TPOT and refuse at once (429/503 with Retry-After) a request that would
miss the SLO, before any prefill work (admission.py); ask the prefill worker to compute
the prompt and ship its KV to the decode worker's receiver; then send the request to the
decode worker with `x-qserve-kv-request-id` and relay its answer (streamed or not). With
local prefill on (`LocalPrefillPolicy`), a short prompt skips the prefill worker and the
decode worker computes it (selection.prefill_locally).

Faults: a prefill worker that fails is replaced (the next one computes the prompt); a
decode worker that fails before sending anything is replaced too (the prompt is prefilled
again for the new one; the prefill worker's prefix cache makes that cheap). Once bytes of
the answer reached the client, a failure ends the stream with an error event. Workers'
KV blocks are never held by the router: an aborted request's blocks are freed by the
worker (a dropped connection aborts it), and a transfer nobody claims expires on the
decode worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import telemetry
from ..server.body import read_body
from ..server.errors import ApiError, error_body, install_error_handlers
from ..server.protocol import ChatCompletionRequest, CompletionRequest
from .admission import admit, predict, unavailable
from .prefill_cost import Work
from ..http_client import HttpError
from .router_state import CONNECT_S, RouterState
from .selection import choose_decode, choose_prefill, prefill_locally

log = logging.getLogger("qserve.router")
KV_HEADER = "x-qserve-kv-request-id"


def _is_token_line(line: bytes) -> bool:
    """An SSE event carrying generated text (not a chat stream's opening role chunk, which
    a worker sends before computing anything)."""
    return line.startswith(b"data: {") and b'"delta": {"role"' not in line


def _prompt_text(data: dict) -> str:
    """The text the prefix tree indexes: the chat messages or the prompt, as sent."""
    if isinstance(data.get("messages"), list):
        return json.dumps(data["messages"], ensure_ascii=False, separators=(",", ":"))
    prompt = data.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class _Failed(Exception):
    """A worker failed this attempt (the request may go to another)."""


def create_router_app(state: RouterState) -> FastAPI:
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        state.poll_task()
        yield
        await state.close()

    app = FastAPI(title="qserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    opts = state.options

    async def prefill_on(worker, data: dict, rid: str, decode, est: Work) -> dict:
        """Prefill on `worker`, `est` the work expected there; record its speed from what
        it reports it computed."""
        body = {"request_id": rid, "kv_port": state.kv_ports.get(decode.url),
                "kv_transport": state.kv_transports.get(decode.url, "socket")}
        # what makes the prompt: the tools are rendered into a chat prompt too
        for k in ("messages", "prompt", "add_generation_prompt", "tools", "tool_choice"):
            if k in data:
                body[k] = data[k]
        ahead = worker.queued  # what this prompt waits behind
        worker.in_flight += 1
        worker.enqueue(est)
        span = telemetry.start_span("router.prefill", {"qserve.worker": worker.url,
                                                       "qserve.request_id": rid}, kind="client")
        try:
            with telemetry.current(span):
                status, _, raw = await state.client.fetch(
                    "POST", worker.url + "/v1/disagg/prefill", json.dumps(body).encode(),
                    telemetry.inject({"content-type": "application/json"}),
                    timeout=opts.prefill_timeout_s, connect_timeout=CONNECT_S)
            out = json.loads(raw)
            if status != 200:
                if 400 <= status < 500 and status not in (408, 429):
                    err = (out or {}).get("error") or {}
                    raise ApiError(status, str(err.get("message", "prefill refused")),
                                   err.get("param"), err.get("code"))
                raise _Failed(f"prefill worker answered {status}")
        except (HttpError, asyncio.TimeoutError, ValueError) as e:
            worker.healthy = False
            raise _Failed(f"prefill worker {worker.url} failed ({type(e).__name__})") from None
        finally:
            worker.in_flight -= 1
            worker.dequeue(est)
            telemetry.end(span)
        if span is not None and out.get("transfer_s") is not None:  # the KV hand-off, as
            end = time.monotonic()                                    # the worker timed it
            telemetry.record_span("router.kv_handoff", end - float(out["transfer_s"]), end,
                                  {"qserve.kv_bytes": out.get("kv_bytes")}, parent=span)
        tokens = max(1, int(out.get("prompt_tokens") or 1))
        cached = min(tokens - 1, max(0, int(out.get("cached_tokens") or 0)))
        if out.get("prefill_s"):
            worker.record_prefill(Work.prompt(tokens, cached), max(float(out["prefill_s"]), 1e-6),
                                  ahead)
        if out.get("transfer_s") is not None:
            worker.transfer_s_per_token.update(float(out["transfer_s"]) / tokens)
        state.kv_bytes += int(out.get("kv_bytes") or 0)
        state.kv_transfers += 1
        return out

    async def route(request: Request, path: str, model_cls):
        span = telemetry.start_span(f"router POST {path}", {"http.route": path},
                                    parent=telemetry.extract(request.headers), kind="server")
        try:
            with telemetry.current(span):
                return await routed(request, path, model_cls, span)
        finally:
            telemetry.end(span)

    async def routed(request: Request, path: str, model_cls, span):
        data, _ = await read_body(request, 8 << 20, model_cls)
        text = _prompt_text(data)
        chars_per_token = state.chars_per_token(path)
        est_tokens = max(1, round(len(text) / chars_per_token))
        block = 16
        if state.layout and state.layout.get("block_size"):
            block = int(state.layout["block_size"])
        blocks_needed = math.ceil((est_tokens + int(data.get("max_tokens") or 256)) / block)
        tried_p, tried_d = set(), set()
        last_error = "no worker is available"
        for _ in range(opts.max_attempts):
            prefill = choose_prefill([w for w in state.prefill if w.url not in tried_p], text,
                                     state.tree, opts.policy)
            decode = choose_decode([w for w in state.decode if w.url not in tried_d],
                                   blocks_needed)
            p = None if prefill is None else next(w for w in state.prefill
                                                  if w.url == prefill.worker)
            local = decode is not None and prefill_locally(p, est_tokens, opts.local_prefill)
            if decode is None or (p is None and not local):
                if tried_p or tried_d:
                    break                      # some were tried and failed: say why below
                which = "decode" if decode is None else "prefill"
                rejection = unavailable(f"no healthy {which} worker with room")
                state.counters.record(rejection, est_tokens)
                raise ApiError(rejection.status, f"{rejection.reason}; retry shortly.",
                               code="no_worker_available", type="server_error",
                               headers={"Retry-After": str(rejection.retry_after_s)})
            d = next(w for w in state.decode if w.url == decode.worker)
            via = None if local else p
            # what the prefill worker's prefix cache should spare (the tree's match; the
            # last token is always computed)
            cached = 0 if local else min(est_tokens - 1,
                                         int(prefill.matched_chars / chars_per_token))
            with telemetry.span("router.admission", {"qserve.decode_worker": d.url,
                                                     "qserve.local_prefill": local}):
                predicted = predict(via, d, est_tokens, cached)
                rejection = admit(via, d, est_tokens, opts.slo, cached)
            if rejection is not None:
                state.counters.record(rejection, est_tokens)
                raise ApiError(rejection.status, rejection.reason, code="slo_rejected",
                               headers={"Retry-After": str(rejection.retry_after_s)})
            if local:                          # the decode worker computes the prompt
                rid = None
                state.local_prefills += 1
                headers = {"x-qserve-prefill": f"local (~{est_tokens} tokens)",
                           "x-qserve-kv-bytes": "0"}
            else:
                rid = f"rt-{uuid.uuid4().hex[:16]}"
                try:
                    info = await prefill_on(p, data, rid, d, Work.prompt(est_tokens, cached))
                except _Failed as e:
                    tried_p.add(p.url)
                    last_error = str(e)
                    continue
                state.tree.insert(text, p.url, time.monotonic())
                state.record_prompt_size(path, len(text), int(info.get("prompt_tokens") or 0))
                headers = {"x-qserve-prefill": f"{p.url} ({prefill.reason})",
                           "x-qserve-kv-bytes": str(info.get("kv_bytes", 0))}
            headers["x-qserve-decode"] = f"{d.url} ({decode.reason})"
            if predicted.ttft_s is not None:  # made before the prefill: for its accuracy
                headers["x-qserve-predicted-ttft-ms"] = f"{predicted.ttft_s * 1e3:.1f}"
            try:
                return await decode_on(d, path, data, rid, headers, est_tokens if local else 0)
            except _Failed as e:
                tried_d.add(d.url)
                last_error = str(e)
        raise ApiError(503, f"no prefill/decode pair could serve the request: {last_error}; "
                            f"retry shortly.", code="no_worker_available", type="server_error",
                       headers={"Retry-After": "1"})

    async def decode_on(worker, path: str, data: dict, rid: str | None, headers: dict,
                        local_tokens: int):
        """Send the request to a decode worker and relay its answer. `rid` names the KV
        transfer it imports first; None (and `local_tokens` > 0): it computes the prompt."""
        worker.in_flight += 1
        released = False
        first_token_s = opts.decode_first_token_s
        sent = time.monotonic()
        span = telemetry.start_span("router.decode", {"qserve.worker": worker.url},
                                    kind="client")
        send_headers = {"content-type": "application/json"}
        if rid is not None:
            send_headers[KV_HEADER] = rid
        with telemetry.current(span):
            telemetry.inject(send_headers)

        def release():
            nonlocal released
            if not released:
                released = True
                worker.in_flight -= 1
                telemetry.end(span)

        try:
            async with asyncio.timeout(first_token_s):
                resp = await state.client.request(
                    "POST", worker.url + path, json.dumps(data).encode(), send_headers,
                    connect_timeout=CONNECT_S)
        except (HttpError, asyncio.TimeoutError) as e:  # the response closed itself
            release()
            worker.healthy = False
            raise _Failed(f"decode worker {worker.url} failed ({type(e).__name__})") from None
        if resp.status >= 500:
            resp.close()
            release()
            raise _Failed(f"decode worker {worker.url} answered {resp.status}")
        if not data.get("stream") or resp.status != 200:
            try:
                body = await resp.read()      # whole answers come after the last token
            except HttpError:
                release()
                raise _Failed(f"decode worker {worker.url} failed mid-answer") from None
            release()
            return Response(body, resp.status, headers=headers,
                            media_type=resp.headers.get("content-type", "application/json"))
        try:
            async with asyncio.timeout(first_token_s):
                first = await resp.readline()
        except (HttpError, asyncio.TimeoutError):
            first = b""
        if not first:
            resp.close()
            release()
            raise _Failed(f"decode worker {worker.url} sent nothing")

        def first_token(line: bytes) -> bool:
            """Time the first generated text: the per-request term of the TTFT prediction
            (KV arrived), or the decode worker's own prefill rate (local)."""
            if not _is_token_line(line):
                return False
            elapsed = max(time.monotonic() - sent, 1e-6)
            if local_tokens:
                worker.local_prefill_tokens_per_s.update(local_tokens / elapsed)
            else:
                worker.first_token_s.update(elapsed)
            return True

        async def relay():
            ok = False
            started, tokens = time.monotonic(), 0
            timed = first_token(first)
            try:
                yield first
                while True:
                    async with asyncio.timeout(first_token_s):   # a stalled worker too
                        line = await resp.readline()
                    if not line:
                        break
                    if line.startswith(b"data: {"):
                        tokens += 1
                        if not timed:
                            timed = first_token(line)
                    yield line
                ok = True
            except (HttpError, asyncio.TimeoutError):
                err = error_body("the decode worker failed mid-stream; the answer is "
                                 "incomplete. Retry the request.", "server_error",
                                 code="worker_failed_mid_stream")
                yield f"\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                resp.close()          # unless complete: the worker sees the client leave
                release()
                if ok and tokens > 1:
                    elapsed = time.monotonic() - started
                    worker.decode_step_s.update(elapsed / tokens)
                    worker.stream_s.update(elapsed)

        return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions", CompletionRequest)

    @app.get("/health")
    async def health():
        up = [w.url for w in state.workers if w.healthy]
        ok = any(w.healthy for w in state.prefill) and any(w.healthy for w in state.decode)
        return JSONResponse({"status": "ok" if ok else "degraded", "workers_up": up},
                            200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        for w in state.decode:
            if w.healthy:
                got = await state.get_json(w.url + "/v1/models", 5.0)
                if got is not None:
                    return JSONResponse(got[1], got[0])
        raise ApiError(503, "no decode worker answers.", code="no_worker_available")

    @app.get("/metrics")
    async def metrics():
        c = state.counters
        lines = ["# TYPE qserve_router_rejected_total counter",
                 f"qserve_router_rejected_total {c.rejected}"]
        lines += [f'qserve_router_rejected_total{{status="{k}"}} {v}'
                  for k, v in sorted(c.by_status.items())]
        lines += [
                 "# TYPE qserve_router_prefill_tokens_saved_total counter",
                 f"qserve_router_prefill_tokens_saved_total {c.prefill_tokens_saved}",
                 "# TYPE qserve_router_kv_bytes_total counter",
                 f"qserve_router_kv_bytes_total {state.kv_bytes}",
                 "# TYPE qserve_router_kv_transfers_total counter",
                 f"qserve_router_kv_transfers_total {state.kv_transfers}",
                 "# TYPE qserve_router_local_prefills_total counter",
                 f"qserve_router_local_prefills_total {state.local_prefills}",
                 "# TYPE qserve_router_worker_in_flight gauge"]
        lines += [f'qserve_router_worker_in_flight{{role="{w.role}",worker="{w.url}"}} '
                  f"{w.in_flight}" for w in state.workers]
        prefill = [w for w in state.prefill if w.prefill_tokens_per_s.value is not None]
        lines += ["# TYPE qserve_router_prefill_tokens_per_second gauge"]
        lines += [f'qserve_router_prefill_tokens_per_second{{worker="{w.url}"}} '
                  f"{w.prefill_tokens_per_s.value:.6g}" for w in prefill]
        lines += ["# TYPE qserve_router_prefill_cost_seconds gauge"]   # prefill_cost.py
        for w in prefill:
            if (coef := w.prefill_cost.coefficients) is not None:
                lines += [f'qserve_router_prefill_cost_seconds{{worker="{w.url}",'
                          f'per="{per}"}} {v:.6g}'
                          for per, v in zip(("request", "token", "token_squared"), coef)]
        lines += ["# TYPE qserve_router_worker_up gauge"]
        lines += [f'qserve_router_worker_up{{role="{w.role}",worker="{w.url}"}} '
                  f"{int(w.healthy)}" for w in state.workers]
        return PlainTextResponse("\n".join(lines) + "\n")

    return app
