"""What the gateway adds: latency at a request rate, TTFT of streams, and the requests lost
when a backend is killed mid-run. Every server is a real process on loopback.

    python -m qserve.runtime.benchmark.gateway_overhead --out docs/gateway-bench.json \\
        [--rate 200 --seconds 2 --rounds 15 --gateway-cpu 0 --others-cpu 1]

1. Overhead: open-loop Poisson arrivals at `--rate` of small non-streaming chat requests,
   alternating direct-to-backend and through-the-gateway phases (so drift hits both);
   added latency = gateway percentile - direct percentile; also the gateway's own
   x-qserve-gateway-overhead-ms header.
2. Streaming: TTFT through the gateway vs direct (16 chunks, 5 ms apart, 20 requests/s).
3. Fault: two backends in one group, streams and plain requests at `--rate`/4 each;
   one backend is SIGKILLed after 3 s. Counts the requests that failed: plain ones must
   not (retried), streams only if they had already started on the killed backend.

The echo backend (echo_backend.py) answers without a model. The load generator is this
process (asyncio + aiohttp); pin the gateway and the rest to different cores on a small
machine so the gateway does not compete with the load generator for one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from ..atomic_file import write_text_atomic
from ..capabilities import cpu_class, cpu_flags, cpu_model
from .server_process import ServerProcess, free_port

BODY = {"model": "echo", "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 16}


@dataclass
class Sample:
    status: int
    latency: float             # s, request sent -> whole response read
    ttft: float | None = None  # s, to the first content event (streams)
    overhead_ms: float | None = None
    stream_error: bool = False  # an error event inside a 200 stream


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _one(session: aiohttp.ClientSession, url: str, stream: bool) -> Sample:
    t = time.perf_counter()
    try:
        if not stream:
            async with session.post(url, json=BODY) as r:
                await r.read()
                oh = r.headers.get("x-qserve-gateway-overhead-ms")
                return Sample(r.status, time.perf_counter() - t, None,
                              float(oh) if oh else None)
        ttft, err = None, False
        async with session.post(url, json=dict(BODY, stream=True)) as r:
            async for line in r.content:
                if ttft is None and line.startswith(b"data: ") and b'"content"' in line:
                    ttft = time.perf_counter() - t
                if line.startswith(b'data: {"error"'):
                    err = True
            return Sample(r.status, time.perf_counter() - t, ttft, None, err)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Sample(0, time.perf_counter() - t)


async def open_loop(url: str, rate: float, seconds: float, stream: bool, seed: int,
                    on_time=None) -> list[Sample]:
    """Poisson arrivals at `rate`/s for `seconds`; `on_time(elapsed)` is polled. The client
    is aiohttp: a slower client (httpx cost ~2 ms of CPU a request here) queues requests
    in the load generator itself at 200/s on one core and hides what is measured."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks, start, at = [], time.perf_counter(), 0.0
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if on_time is not None:
                on_time(time.perf_counter() - start)
            tasks.append(asyncio.create_task(_one(session, url, stream)))
            at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def _pinned(cmd: list[str], cpu: int | None) -> list[str]:
    return (["taskset", "-c", str(cpu)] + cmd) if cpu is not None else cmd


def _echo(port: int, cpu: int | None, tokens: int, itl_ms: float, log: Path) -> ServerProcess:
    cmd = [sys.executable, "-m", "qserve.runtime.benchmark.echo_backend", "--port", str(port),
           "--tokens", str(tokens), "--itl-ms", str(itl_ms)]
    return ServerProcess(f"echo:{port}", _pinned(cmd, cpu), port, log, startup_timeout=60)


def _gateway(config: dict, cpu: int | None, tmp: Path) -> ServerProcess:
    import yaml

    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    cmd = [sys.executable, "-m", "qserve.runtime.cli", "gateway", "--config", str(path),
           "--port", str(port)]
    return ServerProcess("gateway", _pinned(cmd, cpu), port, tmp / "gateway.log",
                         startup_timeout=60)


def _summary(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.status == 200 and not s.stream_error]
    lat = [s.latency * 1000 for s in ok]
    out = {"requests": len(samples), "ok": len(ok), "p50_ms": round(_pct(lat, 0.5), 3),
           "p99_ms": round(_pct(lat, 0.99), 3)}
    ttft = [s.ttft * 1000 for s in ok if s.ttft is not None]
    if ttft:
        out |= {"ttft_p50_ms": round(_pct(ttft, 0.5), 3), "ttft_p99_ms": round(_pct(ttft, 0.99), 3)}
    oh = [s.overhead_ms for s in ok if s.overhead_ms is not None]
    if oh:
        out |= {"header_overhead_p50_ms": round(_pct(oh, 0.5), 3),
                "header_overhead_p99_ms": round(_pct(oh, 0.99), 3)}
    return out


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    result = {"machine": {"cpu": cpu_model(), "cpu_class": cpu_class(cpu_flags()),
                          "cores": os.cpu_count(), "python": platform.python_version()},
              "settings": {"rate": args.rate, "seconds": args.seconds, "rounds": args.rounds,
                           "phase_seconds": args.phase_seconds,
                           "gateway_cpu": args.gateway_cpu, "others_cpu": args.others_cpu}}
    if args.others_cpu is not None:
        os.sched_setaffinity(0, {args.others_cpu})
    # 1 + 2: overhead and streaming TTFT, one backend
    p1 = free_port()
    with _echo(p1, args.others_cpu, 16, 0.0, tmp / "echo1.log") as e1, \
            _echo(free_port(), args.others_cpu, 16, 5.0, tmp / "echo2.log") as e2:
        cfg = {"backends": [{"name": "fast", "url": e1.base, "models": ["echo"]},
                            {"name": "streamer", "url": e2.base, "models": ["echo"]}],
               "groups": [{"name": "echo", "backends": ["fast"], "model": "echo"},
                          {"name": "stream", "backends": ["streamer"], "model": "echo"}]}
        with _gateway(cfg, args.gateway_cpu, tmp) as gw:
            direct, via, rounds = [], [], []
            for r in range(args.rounds):
                d = asyncio.run(open_loop(e1.base + "/v1/chat/completions", args.rate,
                                          args.seconds, False, 2 * r))
                g = asyncio.run(open_loop(gw.base + "/v1/chat/completions", args.rate,
                                          args.seconds, False, 2 * r))
                direct, via = direct + d, via + g
                rounds.append(round(_summary(g)["p50_ms"] - _summary(d)["p50_ms"], 3))
            d, g = _summary(direct), _summary(via)
            result["overhead"] = {"direct": d, "gateway": g,
                                  "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 3),
                                  "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 3),
                                  "added_p50_ms_by_round": rounds}
            BODY["model"] = "stream"
            sd = asyncio.run(open_loop(e2.base + "/v1/chat/completions", 20,
                                       args.phase_seconds, True, 7))
            sg = asyncio.run(open_loop(gw.base + "/v1/chat/completions", 20,
                                       args.phase_seconds, True, 7))
            BODY["model"] = "echo"
            d, g = _summary(sd), _summary(sg)
            result["streaming"] = {"direct": d, "gateway": g,
                                   "added_ttft_p50_ms": round(g["ttft_p50_ms"] - d["ttft_p50_ms"], 3),
                                   "added_ttft_p99_ms": round(g["ttft_p99_ms"] - d["ttft_p99_ms"], 3)}
    # 3: a backend killed mid-run
    with _echo(free_port(), args.others_cpu, 16, 20.0, tmp / "k1.log") as k1, \
            _echo(free_port(), args.others_cpu, 16, 20.0, tmp / "k2.log") as k2:
        cfg = {"backends": [{"name": "k1", "url": k1.base, "models": ["echo"]},
                            {"name": "k2", "url": k2.base, "models": ["echo"]}],
               "groups": [{"name": "echo", "backends": ["k1", "k2"], "model": "echo"}],
               "circuit": {"failures": 3, "window": 10, "cooldown": 30}}
        with _gateway(cfg, args.gateway_cpu, tmp) as gw:
            killed = {}

            def kill(elapsed: float) -> None:
                if elapsed >= 3.0 and not killed:
                    os.kill(k1.pid, signal.SIGKILL)
                    killed["at"] = elapsed

            async def both():
                url = gw.base + "/v1/chat/completions"
                return await asyncio.gather(
                    open_loop(url, args.rate / 4, args.phase_seconds, False, 11, kill),
                    open_loop(url, args.rate / 4, args.phase_seconds, True, 12))

            plain, streams = asyncio.run(both())
            result["fault"] = {
                "killed_after_s": round(killed.get("at", -1), 2),
                "plain": {"requests": len(plain),
                          "failed": sum(s.status != 200 for s in plain)},
                "streams": {"requests": len(streams),
                            "failed_before_content": sum(s.status != 200 for s in streams),
                            "ended_with_error_event": sum(s.stream_error for s in streams)}}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--seconds", type=float, default=2.0,
                   help="Length of each direct and each gateway phase of the overhead test.")
    p.add_argument("--rounds", type=int, default=15,
                   help="Direct/gateway phase pairs: short alternating phases keep the "
                        "machine's drift out of the difference.")
    p.add_argument("--phase-seconds", type=float, default=10.0,
                   help="Length of the streaming test and of the fault test.")
    p.add_argument("--gateway-cpu", type=int, default=None)
    p.add_argument("--others-cpu", type=int, default=None)
    p.add_argument("--out", default=None, help="Write the result as JSON here.")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
