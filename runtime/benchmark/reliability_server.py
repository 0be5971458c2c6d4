"""The server a reliability check runs against: a `qserve serve` child process, its
/metrics gauges, its resident memory, and the shape of the errors it answers.

Every check starts its own server on a free loopback port, so one check's leftovers
(a leaked KV block, a wedged loop) cannot fail the next one.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .errors import BenchmarkError
from .server_process import ServerProcess, free_port

DRAIN_GAUGES = ("kv_blocks_used", "num_requests_running", "num_requests_waiting",
                "requests_in_flight")


@dataclass(frozen=True)
class ServeOptions:
    """How to start `qserve serve` for a check."""

    artifact: str  # a built-in model name, an artifact or checkpoint directory
    threads: int = 2
    serve_args: tuple[str, ...] = ()  # extra options for every check (e.g. tiny-model settings)
    log_dir: Path = Path(".")
    startup_timeout: float = 600.0
    env: dict[str, str] = field(default_factory=dict)


def serve_command(opts: ServeOptions, port: int, extra: tuple[str, ...] = (),
                  log_level: str = "warning") -> list[str]:
    return [sys.executable, "-m", "qserve.runtime.cli", "serve", opts.artifact,
            "--host", "127.0.0.1", "--port", str(port), "--threads", str(opts.threads),
            "--allow-ungated", "--log-level", log_level, *opts.serve_args, *extra]


def start_server(opts: ServeOptions, name: str, extra: tuple[str, ...] = (),
                 log_level: str = "warning") -> ServerProcess:
    """A ServerProcess (not yet entered) for check `name`, logging to log_dir/NAME.log."""
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(opts.threads), **opts.env}
    return ServerProcess(f"qserve serve ({name})", serve_command(opts, port, extra, log_level),
                         port, Path(opts.log_dir) / f"{name}.log", env=env,
                         startup_timeout=opts.startup_timeout)


def parse_prometheus(text: str, prefix: str = "qserve_") -> dict[str, float]:
    """Unlabelled samples of Prometheus text as {name without prefix: value}; labelled
    samples keep their labels in the key (`requests_total{outcome="stop"}`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.removeprefix(prefix)] = float(value)
        except ValueError:
            continue
    return out


def read_metrics(base: str, timeout: float = 5.0) -> dict[str, float]:
    r = httpx.get(base + "/metrics", timeout=timeout)
    if r.status_code != 200:
        raise BenchmarkError(f"GET {base}/metrics answered {r.status_code}: {r.text[:200]}")
    return parse_prometheus(r.text)


def is_drained(metrics: dict[str, float]) -> bool:
    return all(metrics.get(g) == 0 for g in DRAIN_GAUGES)


def wait_drained(base: str, timeout: float = 60.0) -> tuple[bool, dict[str, float], float]:
    """Poll /metrics until no request runs, waits or holds KV blocks. Returns (drained,
    the last gauges read, seconds waited)."""
    t0 = time.monotonic()
    last: dict[str, float] = {}
    while True:
        try:
            last = read_metrics(base)
        except (httpx.HTTPError, BenchmarkError):
            pass
        if last and is_drained(last):
            return True, _gauges(last), time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, _gauges(last), time.monotonic() - t0
        time.sleep(0.25)


def _gauges(metrics: dict[str, float]) -> dict[str, float]:
    return {g: metrics.get(g) for g in DRAIN_GAUGES}


def drain_detail(gauges: dict[str, float], waited: float) -> str:
    shown = ", ".join(f"{k}={v:g}" if v is not None else f"{k}=?" for k, v in gauges.items())
    return f"{shown} after {waited:.1f}s"


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process(pid).memory_info().rss)
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def openai_error_problem(body: object) -> str | None:
    """None if `body` is an OpenAI error object {"error": {"message": str, "type": str,
    "param": ..., "code": ...}}; else what is wrong with it."""
    if not isinstance(body, dict) or "error" not in body:
        return "no top-level 'error' object"
    err = body["error"]
    if not isinstance(err, dict):
        return f"'error' is a {type(err).__name__}, not an object"
    missing = [k for k in ("message", "type", "param", "code") if k not in err]
    if missing:
        return f"'error' lacks {', '.join(missing)}"
    for k in ("message", "type"):
        if not isinstance(err[k], str):
            return f"error.{k} is a {type(err[k]).__name__}, not a string"
    return None
