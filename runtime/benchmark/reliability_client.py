"""One planned request of a reliability check, sent and recorded event by event.

Unlike the throughput client (client.py), a planned request may leave on purpose: a
stream closes its connection after some events, a non-streamed request is cancelled
after a delay. The outcome records exactly how the answer ended, so a check can tell a
finished stream ([DONE] after a finish_reason) from one that ended with an error event
or was cut off with neither.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from .client import APIS, chunk_text

WORDS = ("the quick brown fox jumps over a lazy dog while seven small robots count "
         "prime numbers under the bright morning sky and a river carries old leaves "
         "toward the quiet harbour where ships wait for the tide").split()


@dataclass(frozen=True)
class RequestPlan:
    index: int
    api: str  # "chat" or "completions"
    stream: bool
    max_tokens: int
    prompt: str
    leave_after_events: int | None = None  # streamed: close the connection after N events
    leave_after_s: float | None = None  # non-streamed: cancel after this many seconds

    @property
    def leaves(self) -> bool:
        return self.leave_after_events is not None or self.leave_after_s is not None

    def body(self, model: str | None) -> dict:
        body: dict = {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                      "stream": self.stream}
        if model:
            body["model"] = model
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


@dataclass
class RequestOutcome:
    index: int
    api: str
    stream: bool
    planned_leave: bool
    status: int | None = None  # None: no HTTP answer (left first, or transport error)
    left: bool = False  # the client left before the answer ended
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen (streams)
    error_event: str = ""  # the `error` object of an SSE error event
    error: str = ""  # transport error, bad JSON, or the body of a non-200 answer
    events: int = 0  # SSE data events received
    text_events: int = 0
    completion_tokens: int | None = None
    ttft_s: float | None = None  # to the first event carrying text (streams)
    e2e_s: float = 0.0
    ended_at: float = 0.0  # perf_counter() when the answer ended (or the client left)
    end: str = ""  # how the answer ended: done, body, left, eof, http, transport error
    retry_after: str | None = None
    error_body: dict | None = None  # parsed JSON of a non-200 answer
    timeline: list[float] = field(default_factory=list)  # perf_counter() of each event

    @property
    def complete(self) -> bool:
        """A full, successful answer: 200 and a finish_reason (and [DONE] for streams)."""
        return (self.status == 200 and self.finish_reason is not None and not self.error_event
                and not self.error and (self.done or not self.stream))


def make_prompt(rng: random.Random, min_words: int = 8, max_words: int = 48) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


async def send_planned(client: httpx.AsyncClient, base: str, model: str | None,
                       plan: RequestPlan, timeout: float = 600.0) -> RequestOutcome:
    """Send `plan`; never raises for what the server does (that is the outcome)."""
    out = RequestOutcome(plan.index, plan.api, plan.stream, plan.leaves)
    t0 = time.perf_counter()
    try:
        if plan.stream:
            await _stream(client, base, model, plan, out, t0, timeout)
        elif plan.leave_after_s is not None:
            task = asyncio.ensure_future(_plain(client, base, model, plan, out, t0, timeout))
            done, _ = await asyncio.wait({task}, timeout=plan.leave_after_s)
            if not done:
                task.cancel()  # httpx closes the connection: the server sees a disconnect
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                out.left, out.end = True, "left"
            else:
                task.result()
        else:
            await _plain(client, base, model, plan, out, t0, timeout)
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        out.end = out.end or "transport error"
    out.ended_at = time.perf_counter()
    out.e2e_s = out.ended_at - t0
    return out


async def _plain(client, base, model, plan, out: RequestOutcome, t0, timeout) -> None:
    r = await client.post(base + APIS[plan.api], json=plan.body(model), timeout=timeout)
    _record_status(out, r)
    if r.status_code != 200:
        _record_error_body(out, r.content)
        out.end = "http"
        return
    try:
        data = r.json()
        choice = data["choices"][0]
        out.finish_reason = choice.get("finish_reason")
        out.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
        out.end = "body"
    except (ValueError, KeyError, IndexError, TypeError) as e:
        out.error = f"bad 200 body ({type(e).__name__}): {r.text[:200]}"
        out.end = "body"


async def _stream(client, base, model, plan, out: RequestOutcome, t0, timeout) -> None:
    async with client.stream("POST", base + APIS[plan.api], json=plan.body(model),
                             timeout=timeout) as r:
        _record_status(out, r)
        if r.status_code != 200:
            _record_error_body(out, await r.aread())
            out.end = "http"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            out.events += 1
            out.timeline.append(now)
            if data == "[DONE]":
                out.done, out.end = True, "done"
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                out.error = f"SSE event is not JSON: {data[:200]}"
                continue
            if "error" in chunk:
                out.error_event = json.dumps(chunk["error"])[:300]
                continue
            if chunk_text(chunk):
                out.text_events += 1
                if out.ttft_s is None:
                    out.ttft_s = now - t0
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason") is not None:
                    out.finish_reason = choice["finish_reason"]
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                out.completion_tokens = int(usage["completion_tokens"])
            if plan.leave_after_events is not None and out.events >= plan.leave_after_events:
                out.left, out.end = True, "left"
                return  # leaving the `async with` closes the connection mid-stream
        out.end = "eof"  # the body ended without [DONE]


def _record_status(out: RequestOutcome, r: httpx.Response) -> None:
    out.status = r.status_code
    out.retry_after = r.headers.get("retry-after")


def _record_error_body(out: RequestOutcome, content: bytes) -> None:
    try:
        out.error_body = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        out.error_body = None
    out.error = f"HTTP {out.status}: {content[:300].decode('utf-8', 'replace')}"
