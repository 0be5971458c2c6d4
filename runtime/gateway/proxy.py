"""One client request through the gateway: attempts over backends with backoff, fallback
groups and circuit breakers; output guardrails; the cache; usage, trace and metrics.

    response = await Proxy(state).handle(request, exchange)

Attempts. The route's chain is its group and then the fallback groups; each group gets up
to `retries.max_attempts` attempts, on the least-loaded backend this request has not
tried yet, else (after exponential backoff with full jitter, or the backend's Retry-After
when it is short enough) on one it has. A 4xx other than 429 is the client's request and
goes back to the client as the backend wrote it.

Streams. A stream is opened and read up to its first content token before the client's
response starts, so a backend that fails before it is retried or replaced transparently
and a request that fails everywhere gets a real HTTP error. Once content has reached the
client the backend is fixed: if it fails then, the stream ends with an error event; two
models' text are never spliced. A client that disconnects cancels the upstream request
(its connection is closed, which qserve and vLLM take as an abort).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..server.errors import ApiError, error_body
from .backend import Backend
from .backoff import backoff_delay
from .guardrails import GuardrailBlocked, RequestGuard
from .payload import StreamAssembler, has_content, replay_events, set_choice_text, choice_text
from .rate_limiter import Grant
from .routing import RouteChoice
from .state import GatewayState
from .trace import Attempt, Trace
from .upstream import UpstreamFailure, UpstreamStream, call_json, open_stream

log = logging.getLogger("qserve.gateway")


@dataclass
class Exchange:
    """A client request as the proxy carries it."""
    id: str
    path: str                  # "/v1/chat/completions" | "/v1/completions"
    chat: bool
    body: dict                 # the request as sent upstream (guardrails applied)
    stream: bool
    include_usage: bool        # the client asked for the usage chunk
    route: RouteChoice
    guard: RequestGuard | None
    grant: Grant | None
    trace: Trace
    t0: float                  # monotonic arrival
    cache_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    waited: float = 0.0        # s slept between attempts (backoff, Retry-After)


@dataclass
class _Plan:
    """Where the attempt loop stands."""
    group_index: int = 0
    in_group: int = 0          # attempts in the current group
    attempts: int = 0
    tried: set = field(default_factory=set)
    skip: set = field(default_factory=set)         # Retry-After too long, or unavailable
    retry_after: dict = field(default_factory=dict)


class _Lease:
    """A backend's in-flight slot and circuit verdict for one attempt; released once."""

    def __init__(self, state: GatewayState, backend: Backend) -> None:
        self.state, self.backend, self.open = state, backend, True
        backend.outstanding += 1

    def release(self, ok: bool | None) -> None:
        """ok: the backend worked (True), failed (False), or no verdict (None: cancelled)."""
        if not self.open:
            return
        self.open = False
        self.backend.outstanding -= 1
        now = self.state.clock()
        if ok is None:
            self.backend.breaker.release(now)
        else:
            self.backend.breaker.record(ok, now)


class ClientGone(Exception):
    """The client disconnected while the gateway waited on a backend."""


async def _unless_disconnected(request: Request, coro):
    """Run `coro`; cancel it and raise ClientGone if the client disconnects first. Called
    after the body is read, so the next ASGI message can only be the disconnect."""
    work = asyncio.ensure_future(coro)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watch.cancel()
        raise
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientGone


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


class Proxy:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    # --- the attempt loop -----------------------------------------------------------------

    async def _next(self, ex: Exchange, plan: _Plan) -> tuple[str, Backend] | None:
        """The next (group, backend) to try, after any backoff; None when out of options."""
        cfg, router, chain = self.state.config, self.state.router, ex.route.chain
        while plan.group_index < len(chain):
            group = chain[plan.group_index]
            if plan.in_group < cfg.retries.max_attempts:
                backend = router.pick(group, plan.tried, plan.skip, self.state.clock())
                if backend is not None:
                    if backend.name in plan.tried:   # a retry on a backend already used
                        delay = backoff_delay(cfg.retries, plan.attempts - 1, self.state.rng)
                        delay = max(delay, plan.retry_after.get(backend.name, 0.0))
                        await asyncio.sleep(delay)
                        ex.waited += delay
                    if backend.saturated() or not backend.breaker.allow(self.state.clock()):
                        plan.skip.add(backend.name)
                        continue
                    plan.in_group += 1
                    plan.attempts += 1
                    plan.tried.add(backend.name)
                    return group, backend
            plan.group_index += 1
            plan.in_group = 0
        return None

    async def _attempts(self, ex: Exchange, send):
        """Call `send(group, backend)` on attempt after attempt until one succeeds; returns
        (group, backend, lease, result). The lease is still open (the caller releases it)."""
        plan, last = _Plan(), None
        while (choice := await self._next(ex, plan)) is not None:
            group, backend = choice
            lease = _Lease(self.state, backend)
            started = self.state.clock()
            if plan.attempts > 1:
                self.state.metrics.inc("retries_total", backend.name)
            try:
                result = await send(group, backend)
            except UpstreamFailure as f:
                lease.release(not f.retryable)
                self._attempt(ex, backend, group, f.outcome, started)
                if not f.retryable:
                    raise self._passthrough(f) from None
                last = f
                if f.retry_after is not None:
                    if f.retry_after > self.state.config.retries.max_retry_after:
                        plan.skip.add(backend.name)
                    else:
                        plan.retry_after[backend.name] = f.retry_after
                continue
            except BaseException:
                lease.release(None)
                raise
            self._attempt(ex, backend, group, "ok", started)
            ex.trace.retries = plan.attempts - 1
            if group != ex.route.chain[0]:
                ex.trace.fallback = True
                self.state.metrics.inc("fallbacks_total", group)
            return group, backend, lease, result
        ex.trace.retries = max(0, plan.attempts - 1)
        raise self._exhausted(ex, last)

    def _attempt(self, ex: Exchange, backend: Backend, group: str, outcome: str,
                 started: float) -> None:
        ms = (self.state.clock() - started) * 1000
        ex.trace.attempts.append(Attempt(backend.name, group, outcome, round(ms, 3)))
        self.state.metrics.inc("backend_requests_total", backend.name, outcome)

    @staticmethod
    def _passthrough(f: UpstreamFailure) -> ApiError:
        """The backend's own error object (its message, param and code) for a 4xx."""
        e = (f.body or {}).get("error")
        if not isinstance(e, dict):
            return ApiError(f.status, f"the backend refused the request (HTTP {f.status}).",
                            code=f"upstream_{f.status}")
        return ApiError(f.status, str(e.get("message") or f"HTTP {f.status}"),
                        e.get("param") if isinstance(e.get("param"), str) else None,
                        str(e["code"]) if e.get("code") is not None else None,
                        e.get("type") if isinstance(e.get("type"), str) else None)

    def _exhausted(self, ex: Exchange, last: UpstreamFailure | None) -> ApiError:
        model = ex.route.requested
        if last is None:
            return ApiError(503, f"no backend for model {model!r} can take a request now (all "
                                 f"are cooling down after failures or at their concurrency "
                                 f"limit); retry shortly.", code="no_backend_available",
                            headers={"Retry-After": "1"})
        if last.status == 429:
            wait = max(1, round(last.retry_after or 1))
            return ApiError(429, f"every backend for model {model!r} is rate limited; retry "
                                 f"after {wait} s.", code="upstream_rate_limited",
                            headers={"Retry-After": str(wait)})
        status = 504 if last.outcome == "timeout" else 502
        return ApiError(status, f"every attempt for model {model!r} failed; the last: "
                                f"{last} ({last.outcome}).", code="upstream_failed",
                        type="server_error")

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
        cache = self.state.cache if self.state.config.cache.enabled else None
        if cache is not None and ex.cache_key is not None:
            hit = cache.get(ex.cache_key, self.state.clock())
            self.state.metrics.inc("cache_total", "hit" if hit else "miss")
            ex.trace.cache = "hit" if hit else "miss"
            ex.headers["x-qserve-cache"] = ex.trace.cache
            if hit is not None:
                return self._from_cache(ex, hit.response, hit.pin)
        try:
            if ex.stream:
                return await _unless_disconnected(request, self._open_stream(ex))
            return await _unless_disconnected(request, self._json(ex))
        except ClientGone:
            ex.trace.status, ex.trace.error = 499, "client disconnected"
            self.finish(ex)
            return Response(status_code=499)

    async def _json(self, ex: Exchange) -> Response:
        async def send(group, backend):
            ex.trace.queue_ms = (self.state.clock() - ex.t0) * 1000
            return await call_json(self.state.client, backend, ex.path, self._payload(ex, group))

        sent = self.state.clock()
        try:
            group, backend, lease, body = await self._attempts(ex, send)
        except ApiError as e:
            self._fail(ex, e)
            raise
        lease.release(True)
        await self._pin(ex, group, backend)
        elapsed = self.state.clock() - sent
        self.state.metrics.latency.observe(backend.name, elapsed)
        if ex.cache_key is not None and self.state.config.cache.enabled:
            self.state.cache.put(ex.cache_key, body, self.state.clock(), self._pin_of(ex))
        return self._deliver(ex, body)

    def _deliver(self, ex: Exchange, body: dict) -> Response:
        """A whole response body to the client, through the output guardrails."""
        if ex.guard is not None or ex.trace.cache == "hit":
            body = json.loads(json.dumps(body))   # never alter a cached object
        try:
            for c in body.get("choices") or []:
                text = choice_text(c, ex.chat)
                if text and ex.guard is not None:
                    scanner = ex.guard.output_scanner()
                    set_choice_text(c, ex.chat, scanner.feed(text) + scanner.flush())
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
                async with asyncio.timeout(timeout):
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
            except TimeoutError:
                if up is not None:
                    await up.aclose()
                raise UpstreamFailure("timeout", "no first token in time") from None
            except BaseException:
                if up is not None:
                    await up.aclose()
                raise
            first_token["t"] = self.state.clock() - sent
            return up, pending

        try:
            group, backend, lease, (up, pending) = await self._attempts(ex, send)
        except ApiError as e:
            self._fail(ex, e)
            raise
        await self._pin(ex, group, backend)
        ex.trace.upstream_ttft_ms = first_token["t"] * 1000
        self.state.metrics.ttft.observe(backend.name, first_token["t"])
        return StreamingResponse(self._relay(ex, backend, lease, up, pending),
                                 media_type="text/event-stream", headers=self._headers(ex))

    async def _relay(self, ex: Exchange, backend: Backend, lease: _Lease, up: UpstreamStream,
                     pending: list[dict]):
        """The client's stream: events from the backend through the output guardrails."""
        chat, ok = ex.chat, None
        assembler = StreamAssembler(chat)
        scanners: dict[int, object] = {}
        shown: list[str] = []        # choice 0's text as the client got it (for the trace)
        started = self.state.clock()

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
                if i == 0:
                    shown.append(text)
            if not event.get("choices") and event.get("usage") and not ex.include_usage:
                return None
            return event

        try:
            try:
                for event in pending:
                    assembler.add(event)
                    out = through_guard(event)
                    if out is not None:
                        yield _sse(out)
                async for event in up:
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
            self.state.metrics.latency.observe(backend.name, self.state.clock() - started)
            if ok is None:
                ex.trace.status, ex.trace.error = 499, "client disconnected mid-stream"
            elif not ok:
                ex.trace.status = 502
            ex.trace.response = "".join(shown)
            self._usage(ex, assembler.usage)
            if (ok and ex.trace.status == 200 and ex.cache_key is not None
                    and self.state.config.cache.enabled and assembler.cacheable):
                self.state.cache.put(ex.cache_key, assembler.body(), self.state.clock(),
                                     self._pin_of(ex))
            self.finish(ex)

    # --- bookkeeping ------------------------------------------------------------------------

    def _headers(self, ex: Exchange) -> dict[str, str]:
        # arrival -> the last upstream request, less the failed attempts and the waits
        # between attempts: the time the gateway itself took
        spent = sum(a.ms for a in ex.trace.attempts[:-1]) + ex.waited * 1000
        overhead = max(0.0, (ex.trace.queue_ms or 0.0) - spent)
        ex.headers["x-qserve-gateway-overhead-ms"] = f"{overhead:.3f}"
        self.state.metrics.overhead.observe(ex.path, overhead / 1000)
        return {k: _latin1(v) for k, v in ex.headers.items()}

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


def _latin1(value: str) -> str:
    return value.encode("latin-1", "replace").decode("latin-1")
