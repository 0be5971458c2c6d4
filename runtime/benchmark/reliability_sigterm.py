"""SIGTERM check: stopping the server mid-stream must end every stream cleanly.

Streams are started and given time to produce text; then the server gets SIGTERM.
Each stream in flight must either finish normally ([DONE] after a finish_reason) or end
with an SSE error event; a stream cut off with neither is the failure this check looks
for. New requests after the signal must be refused (connection refused or 503), and the
process must exit with status 0 within a bound.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from dataclasses import dataclass

import httpx

from .reliability_client import RequestOutcome, RequestPlan, make_prompt, send_planned
from .reliability_result import CheckResult
from .reliability_server import ServeOptions, start_server

PROBE_AT_S = (0.3, 1.0, 2.0, 4.0)  # seconds after SIGTERM at which a new request is tried


@dataclass(frozen=True)
class SigtermConfig:
    streams: int = 8
    max_tokens: int = 200
    text_before_signal: int = 2  # text events every stream has before the signal
    exit_within_s: float = 30.0
    seed: int = 0
    model: str | None = None


@dataclass
class StreamEnd:
    index: int
    verdict: str  # finished, error_event, truncated, refused
    events: int
    text_events: int
    finish_reason: str | None
    done: bool
    error: str
    last_event_after_signal_s: float | None  # negative: nothing arrived after the signal
    ended_after_signal_s: float


def stream_verdict(o: RequestOutcome) -> str:
    """finished: [DONE] after a finish_reason; error_event: an SSE error event; refused:
    no 200 at all; truncated: anything else (the stream stopped with neither)."""
    if o.status is not None and o.status != 200:
        return "refused"
    if o.error_event:
        return "error_event"
    if o.done and o.finish_reason is not None:
        return "finished"
    return "truncated"


def probe_verdict(outcome: str) -> bool:
    """Whether a probe's outcome counts as refused: no connection, or 503."""
    return outcome in ("connection refused", "503")


async def _probe(base: str) -> str:
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/v1/completions",
                             json={"prompt": "hello", "max_tokens": 2}, timeout=10)
        return str(r.status_code)
    except httpx.ConnectError:
        return "connection refused"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}"


async def _sigterm(server, cfg: SigtermConfig) -> dict:
    rng = random.Random(cfg.seed)
    plans = [RequestPlan(i, "chat" if i % 2 else "completions", True, cfg.max_tokens,
                         make_prompt(rng)) for i in range(cfg.streams)]
    limits = httpx.Limits(max_connections=cfg.streams + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = [asyncio.ensure_future(send_planned(client, server.base, cfg.model, p))
                 for p in plans]
        # wait until every stream has produced some text (outcomes are filled in as the
        # events arrive, so watch the server's own count instead: generation tokens)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            text = (await client.get(server.base + "/metrics")).text
            if _tokens_generated(text) >= cfg.streams * cfg.text_before_signal \
                    or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.1)
        running_before = sum(1 for t in tasks if not t.done())
        signalled = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        probes = []
        for at in PROBE_AT_S:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - signalled)))
            probes.append({"after_s": at, "outcome": await _probe(server.base)})
        outcomes = await asyncio.gather(*tasks)
    loop = asyncio.get_running_loop()
    try:
        code = await loop.run_in_executor(None, lambda: server.proc.wait(cfg.exit_within_s))
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.perf_counter() - signalled
    return {"outcomes": list(outcomes), "signalled": signalled, "probes": probes,
            "exit_code": code, "exit_s": exit_s, "running_before": running_before}


def _tokens_generated(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("qserve_generation_tokens_total "):
            return float(line.split()[1])
    return 0.0


def stream_ends(outcomes: list[RequestOutcome], signalled: float) -> list[StreamEnd]:
    ends = []
    for o in outcomes:
        last = o.timeline[-1] - signalled if o.timeline else None
        ends.append(StreamEnd(o.index, stream_verdict(o), o.events, o.text_events,
                              o.finish_reason, o.done, o.error or o.error_event or o.end,
                              None if last is None else round(last, 3),
                              round(o.ended_at - signalled, 3)))
    return ends


def judge_sigterm(res: CheckResult, ends: list[StreamEnd], probes: list[dict],
                  exit_code: int | None, exit_s: float, bound_s: float) -> None:
    truncated = [e for e in ends if e.verdict == "truncated"]
    res.require("no stream truncated", bool(ends) and not truncated,
                f"{len(ends) - len(truncated)} of {len(ends)} streams finished or ended with "
                f"an error event" + (f"; truncated: {[e.index for e in truncated]} "
                                     f"(first ended: {truncated[0].error})"
                                     if truncated else ""))
    accepted = [p for p in probes if not probe_verdict(p["outcome"])]
    res.require("new requests refused after SIGTERM", bool(probes) and not accepted,
                ", ".join(f"+{p['after_s']:g}s: {p['outcome']}" for p in probes))
    res.require(f"exit code 0 within {bound_s:g}s", exit_code == 0 and exit_s <= bound_s,
                f"exit code {exit_code} after {exit_s:.1f}s" if exit_code is not None
                else f"still running after {bound_s:g}s")


def run_sigterm(opts: ServeOptions, cfg: SigtermConfig) -> CheckResult:
    res = CheckResult("sigterm")
    t0 = time.monotonic()
    with start_server(opts, "sigterm", log_level="info") as server:
        res.measurements["server_log"] = str(server.log)
        out = asyncio.run(_sigterm(server, cfg))
    ends = stream_ends(out["outcomes"], out["signalled"])
    counts: dict[str, int] = {}
    for e in ends:
        counts[e.verdict] = counts.get(e.verdict, 0) + 1
    res.measurements.update(
        streams=len(ends), running_at_signal=out["running_before"], stream_outcomes=counts,
        per_stream=[e.__dict__ for e in ends], probes=out["probes"],
        exit_code=out["exit_code"], exit_s=round(out["exit_s"], 2))
    if out["running_before"] < len(ends):
        res.notes.append(f"only {out['running_before']} of {len(ends)} streams were still "
                         "running when the signal was sent")
    judge_sigterm(res, ends, out["probes"], out["exit_code"], out["exit_s"], cfg.exit_within_s)
    res.duration_s = time.monotonic() - t0
    return res
