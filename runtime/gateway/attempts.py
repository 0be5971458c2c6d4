"""The attempt loop: which backend each try goes to, the waits between tries, and what the
client gets when every try failed.

    group, backend, lease, result = await Attempts(state).run(exchange, send)

The route's chain is its group and then the fallback groups; each group gets up to
`retries.max_attempts` attempts, on the least-loaded backend this request has not tried
yet, else (after exponential backoff with full jitter, or the backend's Retry-After when
it is short enough) on one it has; a longer Retry-After skips that backend. A 4xx other
than 429 is the client's request: it goes back to the client as the backend wrote it.
Every attempt holds a Lease: the backend's in-flight slot and its circuit verdict.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .. import telemetry
from ..server.errors import ApiError
from .backend import Backend
from .backoff import backoff_delay
from .exchange import Exchange
from .state import GatewayState
from .trace import Attempt
from ..upstream_client import UpstreamFailure, verdict


@dataclass
class _Plan:
    """Where the attempt loop stands."""
    group_index: int = 0
    in_group: int = 0          # attempts in the current group
    attempts: int = 0
    tried: set = field(default_factory=set)
    skip: set = field(default_factory=set)         # Retry-After too long, or unavailable
    retry_after: dict = field(default_factory=dict)


class Lease:
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
        self.backend.mark(ok, self.state.clock())


class Attempts:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

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

    async def run(self, ex: Exchange, send):
        """Call `send(group, backend)` on attempt after attempt until one succeeds; returns
        (group, backend, lease, result). The lease is still open (the caller releases it)."""
        plan, last = _Plan(), None
        while (choice := await self._next(ex, plan)) is not None:
            group, backend = choice
            lease = Lease(self.state, backend)
            started = self.state.clock()
            if plan.attempts > 1:
                self.state.metrics.inc("retries_total", backend.name)
            span = telemetry.start_span("gateway.upstream", {
                "qserve.backend": backend.name, "qserve.group": group,
                "qserve.attempt": plan.attempts}, kind="client")
            try:
                with telemetry.current(span):  # the upstream request carries its traceparent
                    result = await send(group, backend)
            except UpstreamFailure as f:
                telemetry.end(span, {"qserve.outcome": f.outcome})
                lease.release(verdict(f))
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
                telemetry.end(span, {"qserve.outcome": "error"})
                lease.release(None)
                raise
            telemetry.end(span, {"qserve.outcome": "ok"})
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
