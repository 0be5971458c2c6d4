"""One client request through the gateway: the attempts (attempts.py), then the answer
through the output guardrails, the cache, usage, trace and metrics.

    response = await Proxy(state).handle(request, exchange)

Streams. A stream is opened and read up to its first content token before the client's
response starts, so a backend that fails before it is retried or replaced transparently
and a request that fails everywhere gets a real HTTP error. Once content has reached the
client the backend is fixed: if it fails then, the stream ends with an error event; two
models' text are never spliced. A client that disconnects cancels the upstream request
(its connection is closed, which qserve and vLLM take as an abort).
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import telemetry
from ..server.errors import ApiError, error_body
from .attempts import Attempts, Lease
from .backend import Backend
from .exchange import Exchange
from .guardrails import GuardrailBlocked
from .payload import (StreamAssembler, choice_text, has_content, replay_events,
                      set_choice_text, tool_calls)
from .state import GatewayState
from .disconnect import ClientGone, unless_disconnected
from .upstream import UpstreamFailure, UpstreamStream, call_json, open_stream
from ..upstream_client import within

log = logging.getLogger("qserve.gateway")


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


class Proxy:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.attempts = Attempts(state)

    def _payload(self, ex: Exchange, group: str) -> dict:
        payload = dict(ex.body, model=self.state.router.groups[group].model)
        if ex.stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

    async def _pin(self, ex: Exchange, group: str, backend: Backend) -> None:
        """Record in the trace and headers what served the request."""
        await self.state.ensure_versions(backend)
        upstream = self.state.router.groups[group].model
        version = backend.version(upstream)
        t = ex.trace
        t.group, t.backend, t.upstream_model = group, backend.name, upstream
        t.artifact_digest, t.gate_report_digest = version.artifact_digest, version.gate_report_digest
        ex.headers["x-qserve-route"] = f"{group}/{backend.name}"

    # --- responses --------------------------------------------------------------------------

    async def handle(self, request: Request, ex: Exchange) -> Response:
        with telemetry.current(ex.span):
            return await self._handle(request, ex)

    async def _handle(self, request: Request, ex: Exchange) -> Response:
        if ex.cache_key is not None or ex.semantic is not None:
            with telemetry.span("gateway.cache") as s:
                cached = await self._cached(ex)
                if s is not None:
                    s.set_attribute("qserve.cache", ex.trace.cache or "none")
            if cached is not None:
                return cached
        try:
            if ex.stream:
                return await unless_disconnected(request.receive, self._open_stream(ex))
            return await unless_disconnected(request.receive, self._json(ex))
        except ClientGone:
            ex.trace.status, ex.trace.error = 499, "client disconnected"
            self.finish(ex)
            return Response(status_code=499)

    async def _cached(self, ex: Exchange) -> Response | None:
        """The answer from the exact or the semantic cache, or None."""
        if ex.cache_key is not None:
            hit = self.state.cache.get(ex.cache_key, self.state.clock())
            ex.trace.cache = "hit" if hit else "miss"
            ex.headers["x-qserve-cache"] = ex.trace.cache
            if hit is not None:
                self.state.metrics.inc("cache_total", "hit")
                return self._from_cache(ex, hit.response, hit.pin)
        if ex.semantic is not None:
            hit = await self._semantic_lookup(ex)
            if hit is not None:
                self.state.metrics.inc("cache_total", "semantic_hit")
                return self._from_cache(ex, hit.response, hit.pin)
        if ex.trace.cache == "miss":
            self.state.metrics.inc("cache_total", "miss")
        return None

    async def _semantic_lookup(self, ex: Exchange):
        """An answer to the same question in other words (semantic_cache.py), or None."""
        vector = await self.state.embedder.embed(ex.semantic.question)
        ex.semantic_vector = vector
        threshold = self.state.config.cache.semantic.threshold_for(ex.route.chain[0])
        hit = self.state.semantic.lookup(ex.semantic, vector, threshold, self.state.clock())
        ex.trace.cache = "semantic-hit" if hit is not None else "miss"
        ex.headers["x-qserve-cache"] = ex.trace.cache
        if hit is not None:
            ex.trace.similarity = round(hit.similarity, 4)
            ex.headers["x-qserve-cache-similarity"] = f"{hit.similarity:.4f}"
        return hit

    def _store(self, ex: Exchange, body: dict) -> None:
        """Keep a successful answer in the caches that may reuse it."""
        if ex.cache_key is not None:
            self.state.cache.put(ex.cache_key, body, self.state.clock(), self._pin_of(ex))
        if ex.semantic is not None and ex.semantic_vector is not None:
            self.state.semantic.put(ex.semantic, ex.semantic_vector, body, self.state.clock(),
                                    self._pin_of(ex))

    async def _json(self, ex: Exchange) -> Response:
        async def send(group, backend):
            ex.trace.queue_ms = (self.state.clock() - ex.t0) * 1000
            return await call_json(self.state.client, backend, ex.path, self._payload(ex, group))

        try:
            group, backend, lease, (body, raw) = await self.attempts.run(ex, send)
        except ApiError as e:
            self._fail(ex, e)
            raise
        lease.release(True)
        await self._pin(ex, group, backend)
        # the answering attempt's time, not the failed ones' or the waits before it
        self.state.metrics.latency.observe(backend.name, ex.trace.attempts[-1].ms / 1000)
        self._store(ex, body)
        return self._deliver(ex, body, raw)

    def _deliver(self, ex: Exchange, body: dict, raw: bytes | None = None) -> Response:
        """A whole response body to the client, through the output guardrails. `raw`: the
        backend's bytes of `body`, sent as they are when nothing may change them."""
        if ex.guard is not None or ex.trace.cache in ("hit", "semantic-hit"):
            body = json.loads(json.dumps(body))   # never alter a cached object
        try:
            for c in body.get("choices") or []:
                text = choice_text(c, ex.chat)
                if text and ex.guard is not None:
                    scanner = ex.guard.output_scanner()
                    set_choice_text(c, ex.chat, scanner.feed(text) + scanner.flush())
                for call in tool_calls(c) if ex.guard is not None else ():
                    fn = call.get("function") or {}
                    if fn.get("arguments"):  # a call's arguments are output too
                        scanner = ex.guard.output_scanner()
                        fn["arguments"] = scanner.feed(fn["arguments"]) + scanner.flush()
        except GuardrailBlocked as g:
            err = ApiError(422, str(g), code="pii_blocked")
            self._fail(ex, err)
            raise err from None
        choices = body.get("choices") or []
        ex.trace.response = choice_text(choices[0], ex.chat) if choices else None
        self._usage(ex, body.get("usage"))
        self.finish(ex)
        if ex.stream:   # a cache hit for a streaming client
            events = replay_events(body, ex.chat, ex.include_usage)
            chunks = [_sse(e) for e in events] + [_sse("[DONE]")]
            return StreamingResponse(iter(chunks), media_type="text/event-stream",
                                     headers=self._headers(ex))
        if raw is not None and ex.guard is None:
            return Response(raw, media_type="application/json", headers=self._headers(ex))
        return JSONResponse(body, headers=self._headers(ex))

    def _from_cache(self, ex: Exchange, body: dict, pin: dict) -> Response:
        """A cached answer; the trace names what served it originally."""
        t = ex.trace
        t.queue_ms = (self.state.clock() - ex.t0) * 1000
        t.group = pin.get("group", ex.route.chain[0])
        t.upstream_model = pin.get("upstream_model")
        t.artifact_digest = pin.get("artifact_digest")
        t.gate_report_digest = pin.get("gate_report_digest")
        return self._deliver(ex, body)

    @staticmethod
    def _pin_of(ex: Exchange) -> dict:
        t = ex.trace
        return {"group": t.group, "backend": t.backend, "upstream_model": t.upstream_model,
                "artifact_digest": t.artifact_digest, "gate_report_digest": t.gate_report_digest}

    async def _open_stream(self, ex: Exchange) -> Response:
        chat = ex.chat
        first_token = {}

        async def send(group, backend):
            sent = self.state.clock()
            ex.trace.queue_ms = (sent - ex.t0) * 1000
            timeout = backend.config.timeouts.first_token
            up = None
            try:
                async with within(timeout, expired="no first token in time"):
                    up = await open_stream(self.state.client, backend, ex.path,
                                           self._payload(ex, group))
                    pending = []
                    async for event in up:
                        if "error" in event and not event.get("choices"):
                            raise UpstreamFailure("stream_error", "the backend sent an error "
                                                  "event before any content")
                        pending.append(event)
                        if has_content(event, chat):
                            break
            except BaseException:
                if up is not None:
                    await up.aclose()
                raise
            first_token["sent"], first_token["t"] = sent, self.state.clock() - sent
            return up, pending

        try:
            group, backend, lease, (up, pending) = await self.attempts.run(ex, send)
        except ApiError as e:
            self._fail(ex, e)
            raise
        await self._pin(ex, group, backend)
        ex.trace.upstream_ttft_ms = first_token["t"] * 1000
        self.state.metrics.ttft.observe(backend.name, first_token["t"])
        return StreamingResponse(self._relay(ex, backend, lease, up, pending,
                                             first_token["sent"]),
                                 media_type="text/event-stream", headers=self._headers(ex))

    async def _relay(self, ex: Exchange, backend: Backend, lease: Lease, up: UpstreamStream,
                     pending: list[dict], sent: float):
        """The client's stream: the events read before the first content token (`pending`),
        then the rest from the backend, through the output guardrails. `sent`: when the
        answering attempt's request went out (the latency metric runs from there)."""
        chat, ok = ex.chat, None
        assembler = StreamAssembler(chat)
        scanners: dict[int, object] = {}
        shown: list[str] = []        # choice 0's text as the client got it (for the trace)

        async def events():
            for event in pending:    # no error event among them: send() refused those
                yield event
            async for event in up:
                yield event

        def through_guard(event: dict) -> dict | None:
            for c in event.get("choices") or []:
                i = c.get("index", 0)
                text = choice_text(c, chat) or ""
                if ex.guard is not None:
                    scanner = scanners.get(i) or scanners.setdefault(i, ex.guard.output_scanner())
                    text = scanner.feed(text)
                    if c.get("finish_reason") is not None:
                        text += scanner.flush()
                        scanners.pop(i)
                if text or choice_text(c, chat) is not None:
                    set_choice_text(c, chat, text)
                if ex.guard is not None and chat:
                    _guard_call_deltas(c, i, scanners, ex.guard)
                if i == 0:
                    shown.append(text)
            if not event.get("choices") and event.get("usage") and not ex.include_usage:
                return None
            return event

        try:
            try:
                async for event in events():
                    if "error" in event and not event.get("choices"):
                        ex.trace.error = "the backend sent an error event mid-stream"
                        yield _sse(event)
                        ok = False
                        break
                    assembler.add(event)
                    out = through_guard(event)
                    if out is not None:
                        yield _sse(out)
                else:
                    ok = True
            except UpstreamFailure as f:
                ok = False
                ex.trace.error = f"{f} ({f.outcome}) after content was sent"
                self.state.metrics.inc("backend_requests_total", backend.name, f.outcome)
                yield _sse(error_body(f"the backend failed mid-stream ({f.outcome}); the "
                                      f"answer is incomplete. Retry the request.",
                                      "server_error", code="upstream_failed_mid_stream"))
            except GuardrailBlocked as g:
                ok = True
                ex.trace.error = "output blocked by a guardrail"
                ex.trace.status = 422
                yield _sse(error_body(str(g), code="pii_blocked"))
            yield _sse("[DONE]")
        finally:
            await up.aclose()
            lease.release(ok)
            self.state.metrics.latency.observe(backend.name, self.state.clock() - sent)
            if ok is None:
                ex.trace.status, ex.trace.error = 499, "client disconnected mid-stream"
            elif not ok:
                ex.trace.status = 502
            ex.trace.response = "".join(shown)
            self._usage(ex, assembler.usage)
            if ok and ex.trace.status == 200 and assembler.cacheable:
                self._store(ex, assembler.body())
            self.finish(ex)

    # --- bookkeeping ------------------------------------------------------------------------

    def _headers(self, ex: Exchange) -> dict[str, str]:
        # arrival -> the last upstream request, less the failed attempts and the waits
        # between attempts: the time the gateway itself took
        spent = sum(a.ms for a in ex.trace.attempts[:-1]) + ex.waited * 1000
        overhead = max(0.0, (ex.trace.queue_ms or 0.0) - spent)
        ex.headers["x-qserve-gateway-overhead-ms"] = f"{overhead:.3f}"
        self.state.metrics.overhead.observe(ex.path, overhead / 1000)
        return {k: v if v.isascii() else _latin1(v) for k, v in ex.headers.items()}

    def _usage(self, ex: Exchange, usage: dict | None) -> None:
        if isinstance(usage, dict):
            ex.trace.prompt_tokens = usage.get("prompt_tokens")
            ex.trace.completion_tokens = usage.get("completion_tokens")

    def _fail(self, ex: Exchange, err: ApiError) -> None:
        ex.trace.status, ex.trace.error = err.status, err.message
        self.finish(ex)

    def finish(self, ex: Exchange) -> None:
        """Once per request: settle the rate-limit grant, count, write the trace."""
        t = ex.trace
        if t.total_ms is not None:
            return
        t.total_ms = round((self.state.clock() - ex.t0) * 1000, 3)
        if ex.grant is not None:
            used = None
            if t.prompt_tokens is not None and t.completion_tokens is not None:
                used = t.prompt_tokens + t.completion_tokens
            self.state.limiter.settle(ex.grant, used)
        if ex.guard is not None:
            t.guardrails = dict(ex.guard.actions)
            self.state.metrics.guardrail_actions(t.guardrails)
        self.state.metrics.inc("requests_total", t.group or ex.route.chain[0], str(t.status))
        self.state.tracer.write(t)
        telemetry.end(ex.span, {"http.response.status_code": t.status, "qserve.group": t.group,
                                "qserve.backend": t.backend, "qserve.cache": t.cache,
                                "qserve.retries": t.retries})


def _latin1(value: str) -> str:
    return value.encode("latin-1", "replace").decode("latin-1")


def _guard_call_deltas(choice: dict, index: int, scanners: dict, guard) -> None:
    """Stream the arguments of a chunk's tool-call deltas through the output guardrails,
    one scanner per call (what a scanner holds back at the choice's end is sent then)."""
    for d in tool_calls(choice):
        fn = d.get("function")
        if fn and fn.get("arguments"):
            key = (index, d.get("index", 0))
            scanner = scanners.get(key) or scanners.setdefault(key, guard.output_scanner())
            fn["arguments"] = scanner.feed(fn["arguments"])
    if choice.get("finish_reason") is not None:
        rest = []
        for key in [k for k in scanners if isinstance(k, tuple) and k[0] == index]:
            tail = scanners.pop(key).flush()
            if tail:
                rest.append({"index": key[1], "function": {"arguments": tail}})
        if rest:
            choice.setdefault("delta", {}).setdefault("tool_calls", []).extend(rest)
