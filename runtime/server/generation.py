"""One HTTP request's engine work: admission, the engine streams of its prompts, metrics.

    gen = state.start(request_id, prompts, params)     # 429 at once when over the limit
    try:
        async for index, item in gen.outputs():        # RequestOutput or an exception
            ...
    finally:
        gen.close()                                    # aborts what is still running

Each prompt (and sample) is one engine request, so a completions request with several
prompts runs them in one batch; the engine loop hands their outputs to a callback here
(AsyncEngine.submit), with no task per stream, and `batches()` gives a step's outputs at
once, so a response writes them in one piece. `close()` is idempotent and is what frees the
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
        self.grammars = engine.grammars
        self.tool_format = pick_format(tokenizer.chat_template, tool_call_parser)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.disagg = None       # the prefill/decode role (set by create_app)
        pool_tokens = engine.layout.pool_tokens
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
        self._live: set[int] = set()  # engine streams started and not ended
        self._stage: list = [None] * self.n  # per stream: [scheduled, first, last, tokens]
        self._prompt_len = [0] * self.n
        engine = state.engine
        for p, (prompt, sp) in enumerate(zip(prompts, params)):
            first = p * samples
            for i in range(samples):
                index = first + i
                self._prompt_len[index] = len(prompt)
                self._stage[index] = [None, None, None, 0]
                self._live.add(index)
                try:
                    engine.submit(self.engine_id(index), prompt, sp.for_sample(i),
                                  lambda item, _i=index: self._on_item(_i, item),
                                  before if index == 0 else None,
                                  fork_of=self.engine_id(first) if i else None)
                except ValueError as e:  # its id in use (never, ids are unique)
                    self._on_item(index, e)

    def engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    def _on_item(self, index: int, item) -> None:
        """One engine output (or the exception that ended the stream), in the event loop:
        metrics, then the outputs' queue. A plain call from the engine loop's per-step
        delivery: no task of its own and no queue between engine and response."""
        if self.closed:
            return  # handed over before close() cancelled the stream
        if isinstance(item, BaseException):  # EngineError, or the engine refused it
            self._live.discard(index)
            self._finish(index, "error")
            self._queue.put_nowait((index, item))
            self._queue.put_nowait((index, _END))
            return
        m = self.state.metrics
        stage = self._stage[index]
        now = time.monotonic()
        if stage[0] is None:
            stage[0] = item.scheduled_at
        count = len(item.token_ids)
        if count:
            stage[3] += count
            if stage[2] is None:
                stage[1] = now
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe((now - stage[2]) / count)
            stage[2] = now
            m.generation_tokens += count
        self._queue.put_nowait((index, item))
        if item.finished:
            self._live.discard(index)
            m.e2e.observe(now - self.arrival)
            self._finish(index, item.finish_reason or "stop")
            self._record_stages(index, stage[0], stage[1], now, self._prompt_len[index],
                                item.num_cached_tokens, stage[3])
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
        async for batch in self.batches():
            for pair in batch:
                yield pair

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput | Exception]]]:
        """outputs() a list at a time: all that have arrived (one engine step's, for all
        of this request's streams), so that a response writes them at once."""
        remaining = self.n
        queue = self._queue
        held = None  # an interrupt, after the batch that came before it
        while remaining:
            pair = held or await queue.get()
            held = None
            batch = []
            while True:
                item = pair[1]
                if item is _INTERRUPT:
                    if batch:
                        held = pair
                        break
                    raise StreamInterrupted()
                if item is _END:
                    remaining -= 1
                else:
                    batch.append(pair)
                if not remaining or queue.empty():
                    break
                pair = queue.get_nowait()
            if batch:
                yield batch

    def interrupt(self) -> None:
        """Make `outputs()` raise StreamInterrupted once it has yielded what came before."""
        self._queue.put_nowait((0, _INTERRUPT))

    def close(self) -> None:
        """Abort whatever still runs (client gone) and release the admission. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for index in self._live:  # still running in the engine: abort, free its KV
            self.state.engine.cancel(self.engine_id(index))
        self._live.clear()
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
