"""One HTTP request's engine work: admission, the engine streams of its prompts, metrics.

    gen = state.start(request_id, prompts, params)     # 429 at once when over the limit
    try:
        async for index, item in gen.outputs():        # RequestOutput or an exception
            ...
    finally:
        gen.close()                                    # aborts what is still running

Each prompt is one engine request driven by its own task, so a completions request with
several prompts runs them in one batch. `close()` is idempotent and is what frees the
admission slots, so the server may call it from several places (the stream's finally,
the response's background task) without double counting.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from .. import telemetry
from ..async_engine import AsyncEngine, EngineError
from ..engine import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .errors import ApiError
from .metrics import ServerMetrics

_END = object()
_INTERRUPT = object()


class StreamInterrupted(Exception):
    """The server ended this request's outputs early (its shutdown drain time ran out)."""


@dataclass(frozen=True)
class ServerLimits:
    max_in_flight: int = 128  # engine requests (prompts) admitted at once; beyond: 429
    max_body_bytes: int = 8 * 2**20  # request body size; beyond: 413
    max_prompts: int = 64  # prompts in one completions request
    max_model_len: int | None = None  # context limit (the model's max_position_embeddings);
    #                                   the KV pool's capacity bounds it too
    retry_after_s: int = 1  # Retry-After sent with 429
    max_n: int = 16  # samples (n) one request may ask for; beyond: 400
    max_tokens_default: int = 1024  # generated tokens when a request names no max_tokens
    #                                 (and the context has room), so that no request holds
    #                                 a slot for minutes unasked
    shutdown_drain_s: float = 10.0  # on SIGTERM, how long running streams may go on; then
    #                                 they end with an error event

    def __post_init__(self):
        for name in ("max_in_flight", "max_body_bytes", "max_prompts", "retry_after_s",
                     "max_tokens_default", "max_n"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be a positive integer, "
                                 f"got {getattr(self, name)!r}.")
        if not self.shutdown_drain_s >= 0:
            raise ValueError(f"ServerLimits.shutdown_drain_s must be >= 0, got "
                             f"{self.shutdown_drain_s!r}.")


def model_context_length(config: dict) -> int | None:
    """max_position_embeddings from an HF config (top level or text_config)."""
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


class ServerState:
    """What the routes share: the engine, the tokenizer, limits and metrics."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 limits: ServerLimits, api_key: str | None,
                 tool_call_parser: str = "auto") -> None:
        from ..tools import pick_format

        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.limits, self.api_key = limits, api_key
        # compiled grammars: shared with the engine (thread-safe); the routes compile into
        # it before admitting a request (server/constraints.py)
        self.grammars = engine.engine.grammars
        self.tool_format = pick_format(tokenizer.chat_template, tool_call_parser)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.disagg = None       # the prefill/decode role (set by create_app)
        blocks = engine.engine.blocks
        pool_tokens = blocks.num_blocks * blocks.block_size
        self.kv_capacity = pool_tokens
        self.max_model_len = min(limits.max_model_len or pool_tokens, pool_tokens)
        self._next_id = 0

    def next_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}-{time.monotonic_ns() % 10**9:09d}"

    def start(self, request_id: str, prompts: list[list[int]],
              params: list[SamplingParams], before=None, n: int = 1,
              headers=None) -> "Generation":
        """Admit and start n samples of each prompt, or raise 429 (nothing started) if over
        the limit. `before(engine)`: run in the engine thread right before the first prompt
        is added (AsyncEngine.generate), e.g. placing the prompt's imported KV blocks.
        `headers`: the HTTP request's, whose traceparent the request's span continues
        (runtime/telemetry.py)."""
        total = len(prompts) * n
        if self.metrics.in_flight + total > self.limits.max_in_flight:
            raise self.overloaded(total)
        span = None if headers is None else telemetry.start_span(
            "serve.request", {"qserve.request_id": request_id, "qserve.samples": total},
            parent=telemetry.extract(headers), kind="server")
        return Generation(self, request_id, prompts, params, before, n, span)

    def full(self) -> bool:
        """No room for even one more prompt."""
        return self.metrics.in_flight >= self.limits.max_in_flight

    def overloaded(self, n: int) -> ApiError:
        """The 429 for a request of n prompts that does not fit (counted as rejected)."""
        self.metrics.outcome("rejected", n)
        limit = self.limits.max_in_flight
        return ApiError(
            429, f"the server is at capacity ({self.metrics.in_flight} of {limit} requests "
                 f"in flight, this one adds {n}); retry after {self.limits.retry_after_s}s.",
            code="server_overloaded", headers={"Retry-After": str(self.limits.retry_after_s)})


class Generation:
    """Engine streams numbered prompt * samples + sample: sample 0 of each prompt computes
    it, the others fork from sample 0 (one prefill, SamplingParams.for_sample seeds)."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], before=None, samples: int = 1,
                 span=None) -> None:
        self.state = state
        self.request_id = request_id
        self.span = span  # ended by close(); each engine stream records its stages under it
        self.n = len(prompts) * samples
        self.arrival = time.monotonic()
        self.done = [False] * self.n
        self.closed = False
        self._queue: asyncio.Queue = asyncio.Queue()
        m = state.metrics
        m.in_flight += self.n
        m.prompt_tokens += sum(len(p) for p in prompts)
        self._tasks = []
        for p, (prompt, sp) in enumerate(zip(prompts, params)):
            first = p * samples
            for i in range(samples):
                self._tasks.append(asyncio.create_task(self._pump(
                    first + i, prompt, sp.for_sample(i), before if first + i == 0 else None,
                    self.engine_id(first) if i else None)))

    def engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    async def _pump(self, index: int, prompt: list[int], params: SamplingParams,
                    before=None, fork_of: str | None = None) -> None:
        m = self.state.metrics
        last = first = scheduled = None
        tokens = 0
        try:
            async for out in self.state.engine.generate(self.engine_id(index), prompt, params,
                                                        before, fork_of=fork_of):
                now = time.monotonic()
                scheduled = scheduled or out.scheduled_at
                tokens += len(out.token_ids)
                if out.token_ids:
                    if last is None:
                        first = now
                        m.ttft.observe(now - self.arrival)
                    else:
                        m.itl.observe((now - last) / len(out.token_ids))
                    last = now
                    m.generation_tokens += len(out.token_ids)
                if out.finished:
                    m.e2e.observe(now - self.arrival)
                    self._finish(index, out.finish_reason or "stop")
                    self._record_stages(index, scheduled, first, now, len(prompt),
                                        out.num_cached_tokens, tokens)
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EngineError, or the engine refused the request
            self._finish(index, "error")
            self._queue.put_nowait((index, e))
        self._queue.put_nowait((index, _END))

    def _record_stages(self, index: int, scheduled, first, end, prompt_tokens: int,
                       cached: int, tokens: int) -> None:
        """The engine stream's stages as spans under the request's: waiting for a step,
        computing the prompt (to the first token), decoding the rest."""
        if self.span is None or scheduled is None or first is None:
            return
        attrs = {"qserve.sample": index}
        telemetry.record_span("serve.queue", self.arrival, scheduled, attrs, self.span)
        telemetry.record_span("serve.prefill", scheduled, first, dict(
            attrs, **{"qserve.prompt_tokens": prompt_tokens, "qserve.cached_tokens": cached}),
            self.span)
        telemetry.record_span("serve.decode", first, end, dict(
            attrs, **{"qserve.completion_tokens": tokens}), self.span)

    def _finish(self, index: int, outcome: str) -> None:
        if not self.done[index]:
            self.done[index] = True
            self.state.metrics.outcome(outcome)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        """(prompt index, output delta or the exception that ended that prompt)."""
        remaining = self.n
        while remaining:
            index, item = await self._queue.get()
            if item is _INTERRUPT:
                raise StreamInterrupted()
            if item is _END:
                remaining -= 1
                continue
            yield index, item

    def interrupt(self) -> None:
        """Make `outputs()` raise StreamInterrupted once it has yielded what came before."""
        self._queue.put_nowait((0, _INTERRUPT))

    def close(self) -> None:
        """Abort whatever still runs (client gone) and release the admission. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for t in self._tasks:
            t.cancel()  # the engine stream's own finally sends the abort
        for i in range(self.n):
            self._finish(i, "abort")
        self.state.metrics.in_flight -= self.n
        telemetry.end(self.span)


def error_for(exc: Exception) -> ApiError:
    """The API error for an exception that ended one prompt's engine stream."""
    if isinstance(exc, EngineError):
        return ApiError(500, f"{exc}; the request was dropped, the server keeps serving.",
                        code="engine_error", type="server_error")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc), code="invalid_value")
    return ApiError(500, f"internal error ({type(exc).__name__}: {exc}).",
                    code="internal_error", type="server_error")
