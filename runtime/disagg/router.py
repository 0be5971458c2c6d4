"""The router's work on one request, over the workers its RouterState knows.

    router = Router(RouterState(["http://p0:8001"], ["http://d0:8002"]))
    await router.start()                      # read the workers, then poll them every second
    response = await router.handle(request, "/v1/completions", CompletionRequest)
    router.health(), await router.models(), router.metrics()    # the other routes' answers
    await router.close()

A request's path (`handle`): estimate the prompt (`estimate`), pick a prefill and a decode
worker (`pick`: selection.py), predict TTFT and TPOT and refuse at once a request that
would miss the SLO (`admit`: admission.py), have the prefill worker compute the prompt and
ship its KV to the decode worker (`forward_prefill`), then send the request to the decode
worker and relay its answer (`forward_decode`, `relay`). A short prompt may skip the
prefill worker (selection.prefill_locally): the decode worker computes it.

Faults: a prefill worker that fails is replaced (the next one computes the prompt); a
decode worker that fails before sending anything is replaced too (the prompt is prefilled
again for the new one; the prefill worker's prefix cache makes that cheap). Once bytes of
the answer reached the client, a failure ends the stream with an error event. Workers'
KV blocks are never held by the router: an aborted request's blocks are freed by the
worker (a dropped connection aborts it), and a transfer nobody claims expires on the
decode worker.

Talking to a worker (bounded waits, reading the stream, telling a failure that another
worker may fix from the client's own error, marking a worker down) is the shared upstream
client's (runtime/upstream_client/); a worker marked down rejoins on its next answered
poll (router_state.py).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import telemetry
from ..server.body import read_body
from ..server.errors import ApiError, error_body
from ..upstream_client import (LineStream, UpstreamFailure, fetch, is_retryable, send,
                               within)
from .admission import Prediction, admit, predict, unavailable
from .prefill_cost import Work
from .router_state import CONNECT_S, RouterState
from .selection import Choice, choose_decode, choose_prefill, prefill_locally
from .worker_state import WorkerState

KV_HEADER = "x-qserve-kv-request-id"
MAX_BODY = 8 << 20          # bytes of a request body
DEFAULT_BLOCK = 16          # tokens per KV block until the workers report theirs
DEFAULT_MAX_TOKENS = 256    # a request's output budget when it sets none
PREFILL_RETRY_4XX = (408, 429)   # a prefill worker's 4xx that another worker may get past


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


@dataclass(frozen=True)
class PromptEstimate:
    """What the router knows of a request's size before any worker has seen it."""

    text: str                # what the prefix tree indexes (_prompt_text)
    chars_per_token: float   # of `text`, as measured for the request's API path
    tokens: int              # estimated prompt tokens, >= 1
    blocks: int              # KV blocks for the prompt and the output budget


@dataclass(frozen=True)
class Pair:
    """The workers one attempt goes to. `prefill` None: the decode worker computes the
    prompt (local prefill)."""

    decode: WorkerState
    decode_choice: Choice
    prefill: WorkerState | None = None
    prefill_choice: Choice | None = None

    @property
    def local(self) -> bool:
        return self.prefill is None


class _Slot:
    """A decode worker's in-flight count and the request's span, held until the answer
    has been relayed (or failed); released once."""

    def __init__(self, worker: WorkerState, span) -> None:
        self.worker, self.span, self.held = worker, span, True
        worker.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.worker.in_flight -= 1
            telemetry.end(self.span)


class Router:
    """The routes' work over one RouterState (see the module docstring)."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.options = state.options

    # --- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Read every worker's info, then keep polling it (health, free KV blocks)."""
        await self.state.start()
        self.state.poll_task()

    async def close(self) -> None:
        await self.state.close()

    # --- a request ------------------------------------------------------------------------

    async def handle(self, request: Request, path: str, model_cls) -> Response:
        """The answer to a POST of `path` (a `model_cls` body), under the request's span."""
        span = telemetry.start_span(f"router POST {path}", {"http.route": path},
                                    parent=telemetry.extract(request.headers), kind="server")
        try:
            with telemetry.current(span):
                return await self._route(request, path, model_cls)
        finally:
            telemetry.end(span)

    async def _route(self, request: Request, path: str, model_cls) -> Response:
        """Attempts on worker pairs, each pair's workers not tried before, until one
        answers; a 503 naming the last failure when none did."""
        data, _ = await read_body(request, MAX_BODY, model_cls)
        est = self.estimate(data, path)
        state, opts = self.state, self.options
        tried_p: set[str] = set()
        tried_d: set[str] = set()
        last_error = "no worker is available"
        for _ in range(opts.max_attempts):
            pair = self.pick(est, tried_p, tried_d)
            if pair is None:
                break                          # some were tried and failed: say why below
            cached = self._cached_tokens(pair, est)
            predicted = self.admit(pair, est, cached)
            if pair.local:                     # the decode worker computes the prompt
                rid = None
                state.local_prefills += 1
                headers = {"x-qserve-prefill": f"local (~{est.tokens} tokens)",
                           "x-qserve-kv-bytes": "0"}
            else:
                p = pair.prefill
                rid = f"rt-{uuid.uuid4().hex[:16]}"
                try:
                    info = await self.forward_prefill(p, data, rid, pair.decode,
                                                      Work.prompt(est.tokens, cached))
                except UpstreamFailure as e:
                    tried_p.add(p.url)
                    last_error = str(e)
                    continue
                state.tree.insert(est.text, p.url, time.monotonic())
                state.record_prompt_size(path, len(est.text),
                                         int(info.get("prompt_tokens") or 0))
                headers = {"x-qserve-prefill": f"{p.url} ({pair.prefill_choice.reason})",
                           "x-qserve-kv-bytes": str(info.get("kv_bytes", 0))}
            d = pair.decode
            headers["x-qserve-decode"] = f"{d.url} ({pair.decode_choice.reason})"
            if predicted.ttft_s is not None:  # made before the prefill: for its accuracy
                headers["x-qserve-predicted-ttft-ms"] = f"{predicted.ttft_s * 1e3:.1f}"
            try:
                return await self.forward_decode(d, path, data, rid, headers,
                                                  est.tokens if pair.local else 0)
            except UpstreamFailure as e:
                tried_d.add(d.url)
                last_error = str(e)
        raise ApiError(503, f"no prefill/decode pair could serve the request: {last_error}; "
                            f"retry shortly.", code="no_worker_available", type="server_error",
                       headers={"Retry-After": "1"})

    def estimate(self, data: dict, path: str) -> PromptEstimate:
        """The prompt's size in tokens and KV blocks, from its text's length."""
        text = _prompt_text(data)
        chars_per_token = self.state.chars_per_token(path)
        tokens = max(1, round(len(text) / chars_per_token))
        block = DEFAULT_BLOCK
        layout = self.state.layout
        if layout and layout.get("block_size"):
            block = int(layout["block_size"])
        blocks = math.ceil((tokens + int(data.get("max_tokens") or DEFAULT_MAX_TOKENS)) / block)
        return PromptEstimate(text, chars_per_token, tokens, blocks)

    def pick(self, est: PromptEstimate, tried_p: set[str], tried_d: set[str]) -> Pair | None:
        """The next pair of workers, none of them tried (urls in `tried_p`, `tried_d`);
        None when none is left after some were tried; a 503 (Retry-After) when no worker
        can take the request at all."""
        state = self.state
        prefill = choose_prefill([w for w in state.prefill if w.url not in tried_p], est.text,
                                 state.tree, self.options.policy)
        decode = choose_decode([w for w in state.decode if w.url not in tried_d], est.blocks)
        p = None if prefill is None else _named(state.prefill, prefill.worker)
        local = decode is not None and prefill_locally(p, est.tokens,
                                                       self.options.local_prefill)
        if decode is None or (p is None and not local):
            if tried_p or tried_d:
                return None
            which = "decode" if decode is None else "prefill"
            rejection = unavailable(f"no healthy {which} worker with room")
            state.counters.record(rejection, est.tokens)
            raise ApiError(rejection.status, f"{rejection.reason}; retry shortly.",
                           code="no_worker_available", type="server_error",
                           headers={"Retry-After": str(rejection.retry_after_s)})
        d = _named(state.decode, decode.worker)
        if local:
            return Pair(d, decode)
        return Pair(d, decode, p, prefill)

    @staticmethod
    def _cached_tokens(pair: Pair, est: PromptEstimate) -> int:
        """Prompt tokens the prefill worker's prefix cache should spare (the tree's match;
        the last token is always computed); 0 for a local prefill."""
        if pair.local:
            return 0
        return min(est.tokens - 1, int(pair.prefill_choice.matched_chars / est.chars_per_token))

    def admit(self, pair: Pair, est: PromptEstimate, cached: int) -> Prediction:
        """The predicted TTFT and TPOT on `pair`; a 429/503 (Retry-After) when the request
        would miss the SLO there."""
        d = pair.decode
        with telemetry.span("router.admission", {"qserve.decode_worker": d.url,
                                                 "qserve.local_prefill": pair.local}):
            predicted = predict(pair.prefill, d, est.tokens, cached)
            rejection = admit(pair.prefill, d, est.tokens, self.options.slo, cached)
        if rejection is not None:
            self.state.counters.record(rejection, est.tokens)
            raise ApiError(rejection.status, rejection.reason, code="slo_rejected",
                           headers={"Retry-After": str(rejection.retry_after_s)})
        return predicted

    # --- the workers ----------------------------------------------------------------------

    async def forward_prefill(self, worker: WorkerState, data: dict, rid: str,
                              decode: WorkerState, est: Work) -> dict:
        """Prefill on `worker` and ship the KV to `decode` as transfer `rid`; `est` the work
        expected there. Returns what the worker reports (tokens, seconds, KV bytes) and
        records its speed from it. UpstreamFailure when another worker should try (the
        worker is marked down when it gave no whole JSON answer); the worker's own 4xx
        error for the client's request."""
        state = self.state
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
                reply = await fetch(
                    state.client, "POST", worker.url + "/v1/disagg/prefill",
                    json.dumps(body).encode(),
                    telemetry.inject({"content-type": "application/json"}),
                    timeout=self.options.prefill_timeout_s, connect_timeout=CONNECT_S)
            out = reply.json()
        except UpstreamFailure as f:
            worker.mark(False)
            raise UpstreamFailure(f.outcome, f"prefill worker {worker.url} failed "
                                             f"({f.cause})", cause=f.cause) from None
        finally:
            worker.in_flight -= 1
            worker.dequeue(est)
            telemetry.end(span)
        if reply.status != 200:
            if 400 <= reply.status < 500 and not is_retryable(reply.status, PREFILL_RETRY_4XX):
                err = (out or {}).get("error") or {}
                raise ApiError(reply.status, str(err.get("message", "prefill refused")),
                               err.get("param"), err.get("code"))
            raise UpstreamFailure(f"http_{reply.status}",
                                  f"prefill worker answered {reply.status}", reply.status)
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

    async def forward_decode(self, worker: WorkerState, path: str, data: dict,
                             rid: str | None, headers: dict[str, str],
                             local_tokens: int) -> Response:
        """Send the request to a decode worker and relay its answer. `rid` names the KV
        transfer it imports first; None (and `local_tokens` > 0): it computes the prompt.
        UpstreamFailure while nothing of the answer has gone to the client: no response
        head in time (the worker is marked down), a 5xx, or a stream with no first line."""
        first_token_s = self.options.decode_first_token_s
        sent = time.monotonic()
        span = telemetry.start_span("router.decode", {"qserve.worker": worker.url},
                                    kind="client")
        send_headers = {"content-type": "application/json"}
        if rid is not None:
            send_headers[KV_HEADER] = rid
        with telemetry.current(span):
            telemetry.inject(send_headers)
        slot = _Slot(worker, span)
        relaying = False
        try:
            try:
                resp = await send(self.state.client, "POST", worker.url + path,
                                  json.dumps(data).encode(), send_headers,
                                  timeout=first_token_s, connect_timeout=CONNECT_S)
            except UpstreamFailure as f:    # the response closed itself
                worker.mark(False)
                raise UpstreamFailure(f.outcome, f"decode worker {worker.url} failed "
                                                 f"({f.cause})", cause=f.cause) from None
            if is_retryable(resp.status, ()):
                resp.close()
                raise UpstreamFailure(f"http_{resp.status}", f"decode worker {worker.url} "
                                      f"answered {resp.status}", resp.status)
            if not data.get("stream") or resp.status != 200:
                try:
                    async with within(None):      # whole answers come after the last token
                        body = await resp.read()
                except UpstreamFailure as f:
                    raise UpstreamFailure(f.outcome, f"decode worker {worker.url} failed "
                                                     f"mid-answer", cause=f.cause) from None
                slot.release()
                return Response(body, resp.status, headers=headers,
                                media_type=resp.headers.get("content-type",
                                                            "application/json"))
            lines = LineStream(resp, first_token_s)
            try:
                first = await lines.readline()
            except UpstreamFailure:
                first = b""
            if not first:
                lines.close()
                raise UpstreamFailure("stream_cut", f"decode worker {worker.url} sent nothing")
            relaying = True
            return StreamingResponse(self.relay(worker, lines, first, slot, sent, local_tokens),
                                     media_type="text/event-stream", headers=headers)
        finally:
            if not relaying:
                slot.release()

    async def relay(self, worker: WorkerState, lines: LineStream, first: bytes, slot: _Slot,
                    sent: float, local_tokens: int):
        """The client's stream: `first` (read already), then the decode worker's lines as
        they come, each within the first-token timeout. A break or a stall ends it with an
        error event and [DONE]. Whatever ends it (the end, a failure, the client leaving),
        the worker's connection is closed unless its stream ended, and `slot` released.
        `sent`: when the request went out (monotonic s)."""
        ok = False
        started, tokens = time.monotonic(), 0
        timed = self._first_token(worker, first, sent, local_tokens)
        try:
            yield first
            while True:
                line = await lines.readline()       # a stalled worker too: UpstreamFailure
                if not line:
                    break
                if line.startswith(b"data: {"):
                    tokens += 1
                    if not timed:
                        timed = self._first_token(worker, line, sent, local_tokens)
                yield line
            ok = True
        except UpstreamFailure:
            err = error_body("the decode worker failed mid-stream; the answer is "
                             "incomplete. Retry the request.", "server_error",
                             code="worker_failed_mid_stream")
            yield f"\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            lines.close()             # unless complete: the worker sees the client leave
            slot.release()
            if ok and tokens > 1:
                elapsed = time.monotonic() - started
                worker.decode_step_s.update(elapsed / tokens)
                worker.stream_s.update(elapsed)

    @staticmethod
    def _first_token(worker: WorkerState, line: bytes, sent: float, local_tokens: int) -> bool:
        """Time the first generated text: the per-request term of the TTFT prediction (KV
        arrived), or the decode worker's own prefill rate (`local_tokens` > 0). False when
        `line` carries no generated text."""
        if not _is_token_line(line):
            return False
        elapsed = max(time.monotonic() - sent, 1e-6)
        if local_tokens:
            worker.local_prefill_tokens_per_s.update(local_tokens / elapsed)
        else:
            worker.first_token_s.update(elapsed)
        return True

    # --- the other routes -----------------------------------------------------------------

    def health(self) -> JSONResponse:
        """200 while a prefill and a decode worker are up, else 503 ("degraded")."""
        state = self.state
        up = [w.url for w in state.workers if w.healthy]
        ok = any(w.healthy for w in state.prefill) and any(w.healthy for w in state.decode)
        return JSONResponse({"status": "ok" if ok else "degraded", "workers_up": up},
                            200 if ok else 503)

    async def models(self) -> JSONResponse:
        """The first healthy decode worker's GET /v1/models, as it answered."""
        for w in self.state.decode:
            if w.healthy:
                got = await self.state.get_json(w.url + "/v1/models", 5.0)
                if got is not None:
                    return JSONResponse(got[1], got[0])
        raise ApiError(503, "no decode worker answers.", code="no_worker_available")

    def metrics(self) -> str:
        """The Prometheus text of the router's counters and the workers' gauges."""
        state = self.state
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
        return "\n".join(lines) + "\n"


def _named(workers: list[WorkerState], url: str) -> WorkerState:
    return next(w for w in workers if w.url == url)
