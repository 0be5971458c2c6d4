"""Asyncio front of the engine: one engine loop (in its own thread or the caller's), many streams.

    engine = AsyncEngine(LLMEngine.from_model(lm))
    async for out in engine.generate("req-1", prompt_ids, params):   # RequestOutput deltas
        ...
    await engine.abort("req-1")        # also done when the consumer stops iterating

    engine = AsyncEngine(llm_engine, start_thread=False)   # the loop in the caller's thread:
    engine.run_forever(stop_when=lambda: not http_thread.is_alive())

`qserve serve` runs the loop in its main thread, the thread that loaded the model, and the
HTTP server in another: torch's OpenMP runtime keeps one team of worker threads per
thread that runs parallel ops, and once a process has more OpenMP threads than cores it
stops spinning between parallel regions, so every region waits for a sleeping worker
(stepping in a second thread after loading in the first made one-stream decode steps
clearly slower).

The model runs only in the loop thread, one step at a time over all active requests
(continuous batching). Requests and aborts are handed to that thread through a command
queue; outputs come back to each request's callback (`submit`) or asyncio queue
(`generate`), all of a step's outputs for one event loop in one wake-up of that loop. If a step raises, every
request in flight gets an `EngineError` and is dropped; the loop keeps serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from .engine import EngineLayout, EngineStats, LLMEngine, RequestOutput
from .kv_tail import KVTail
from .sampling_params import SamplingParams

log = logging.getLogger("qserve.engine")


class EngineError(RuntimeError):
    """The engine failed while this request was in flight."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    put: Callable[[object], None]  # called in `loop` with each output or exception


def _put_all(batch: list[tuple[Callable[[object], None], object]]) -> None:
    for put, item in batch:
        put(item)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


# -- commands: what other threads ask of the loop thread, run there between steps ---------
Deliver = Callable[[list[tuple[str, object]]], None]  # (request id, output or error) pairs


@dataclass(frozen=True)
class AddRequest:
    """LLMEngine.add_request, after `before(engine)` (whose result is the kv_tail); an
    error goes to the request's stream."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    before: Callable[[LLMEngine], KVTail | None] | None = None
    hold_kv: bool = False
    fork_of: str | None = None

    def apply(self, engine: LLMEngine, deliver: Deliver) -> None:
        try:
            tail = self.before(engine) if self.before is not None else None
            engine.add_request(self.request_id, self.prompt_token_ids, self.params,
                               kv_tail=tail, hold_kv=self.hold_kv, fork_of=self.fork_of)
        except Exception as e:
            deliver([(self.request_id, e)])


@dataclass(frozen=True)
class AbortRequest:
    """LLMEngine.abort_request (harmless for a request that has ended)."""

    request_id: str

    def apply(self, engine: LLMEngine, deliver: Deliver) -> None:
        engine.abort_request(self.request_id)


@dataclass(frozen=True)
class CallEngine:
    """fn(engine), its result or exception settling `future` in its event loop."""

    fn: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def apply(self, engine: LLMEngine, deliver: Deliver) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as e:
            result, error = None, e
        self.loop.call_soon_threadsafe(_settle, self.future, result, error)


@dataclass(frozen=True)
class PostEngine:
    """fn(engine) with nobody waiting: its result dropped, an exception logged."""

    fn: Callable[[LLMEngine], object]

    def apply(self, engine: LLMEngine, deliver: Deliver) -> None:
        try:
            self.fn(engine)
        except Exception:
            log.exception("a posted engine call failed")


EngineCommand = AddRequest | AbortRequest | CallEngine | PostEngine


class AsyncEngine:
    """The one owner of an LLMEngine: the engine changes only in the loop thread, through
    EngineCommands; other threads read `stats()` (a snapshot published after each step, and
    while idle after each batch of commands), `layout` and `grammars` (fixed or
    thread-safe)."""

    def __init__(self, engine: LLMEngine, start_thread: bool = True) -> None:
        self.engine = engine  # the loop thread's (and the tests'); others use the above
        self._commands: queue.Queue[EngineCommand] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._stats = engine.stats()
        self._looping = False
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="qserve-engine", daemon=True)
            self._thread.start()

    # -- public (event loop side) -----------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams,
                       before: Callable[[LLMEngine], KVTail | None] | None = None,
                       hold_kv: bool = False,
                       fork_of: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output deltas until it finishes. Stopping the iteration
        early (client gone, task cancelled) aborts the request and frees its KV blocks.
        `before(engine)` runs in the loop thread right before the request is added, in the
        same pause between steps (e.g. placing imported KV blocks the request will hit);
        what it returns is the request's `kv_tail` (None: none); if it raises, the request
        fails with that exception. `hold_kv`: the finished request keeps its KV blocks
        until `abort(request_id)` or an `engine.release_kv` through `call`. `fork_of`: a
        request of the same prompt this one shares its prefill with (LLMEngine.add_request)."""
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params, queue.put_nowait, before, hold_kv,
                    fork_of)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # a finished stream was unregistered by the loop thread
                self.cancel(request_id)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               put: Callable[[object], None],
               before: Callable[[LLMEngine], KVTail | None] | None = None,
               hold_kv: bool = False, fork_of: str | None = None) -> None:
        """Start a request whose outputs go to `put(item)`, called in this event loop (an
        output delta, or the exception that ended the request) until one is finished or
        an exception; after `cancel(request_id)` only the outputs the loop thread handed over
        before it can still arrive. The callback form of
        `generate` (same arguments): no task and no queue between the engine and the
        consumer, so a token costs the server no task switch of its own."""
        stream = _Stream(asyncio.get_running_loop(), put)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use.")
            self._streams[request_id] = stream
        self._send(AddRequest(request_id, prompt_token_ids, params, before, hold_kv, fork_of))

    def cancel(self, request_id: str) -> None:
        """Stop a `submit`ted request (no more calls of its `put`) and abort it in the
        engine, which frees its KV blocks between steps; harmless once it has ended."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(AbortRequest(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine)'s result, run in the loop thread between steps (the engine and its
        block manager are not thread-safe); its exception is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(CallEngine(fn, loop, future))
        return await future

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run fn(engine) in the loop thread between steps, without waiting for it (e.g. a
        clean-up from a cancelled task); its result is dropped and an exception logged."""
        self._send(PostEngine(fn))

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)
        self._wake.set()

    @property
    def layout(self) -> EngineLayout:
        """The engine's fixed shape (namespace, block size, pool size, KV dtype)."""
        return self.engine.layout

    @property
    def grammars(self):
        """The engine's grammar compiler (thread-safe: the server compiles into it)."""
        return self.engine.grammars

    def write_kv_import(self, plan) -> None:
        """LLMEngine.write_kv_import, from any thread (a reserved plan's bytes)."""
        self.engine.write_kv_import(plan)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() if self._thread is not None else self._looping

    def run_forever(self, stop_when: Callable[[], bool] | None = None) -> None:
        """Run the engine loop in the calling thread (made with start_thread=False) until
        shutdown() or until stop_when() turns true (checked at least every 0.5 s)."""
        if self._thread is not None:
            raise RuntimeError("this AsyncEngine already runs its loop in its own thread.")
        self._run(stop_when)

    def stats(self) -> EngineStats:
        """The stats after the last step (safe to read from any thread)."""
        return self._stats

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- loop thread ------------------------------------------------------------------
    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """(request id, output or exception) pairs, in order: one wake-up of each event loop
        that has streams among them (not one per item: at 16 streams a step's outputs were
        16 self-pipe writes and callbacks, on the engine's critical path and then in the
        HTTP thread). A stream's last item (finished, or an exception) unregisters it."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.put, item))
                    if isinstance(item, BaseException) or item.finished:
                        del self._streams[request_id]
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _drain_commands(self) -> None:
        """Apply every queued command."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command.apply(self.engine, self._deliver_all)

    def _fail_all(self, error: Exception) -> None:
        failed = list(self.engine.requests)
        for rid in failed:
            self.engine.abort_request(rid)
        self._deliver_all([(rid, EngineError(f"engine failure: {error}")) for rid in failed])

    def _run(self, stop_when: Callable[[], bool] | None = None) -> None:
        self._looping = True
        try:
            self._loop(stop_when)
        finally:
            self._looping = False

    def _loop(self, stop_when: Callable[[], bool] | None) -> None:
        while not self._stop and not (stop_when is not None and stop_when()):
            self._drain_commands()  # their effect is published below: idle, or after the step
            if not self.engine.has_unfinished:
                self._stats = self.engine.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail the requests in flight only
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self._stats = self.engine.stats()  # before delivery: readers see the new state
            self._deliver_all([(out.request_id, out) for out in outputs])
