"""`qserve router` and `qserve cluster`: prefill/decode disaggregation on one machine.

    qserve serve ARTIFACT --role prefill --port 8001        (and --role decode --port 8002)
    qserve router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000
    qserve cluster ARTIFACT --prefill 1 --decode 1 --port 8000    all of the above, at once
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import click

slo_options = [
    click.option("--ttft-slo", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Refuse (429) a request whose predicted time to first token exceeds "
                      "this many seconds, before any prefill work."),
    click.option("--tpot-slo", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Refuse (429) a request whose predicted time per output token exceeds "
                      "this many seconds."),
    click.option("--cache-threshold", type=click.FloatRange(0, 1), default=0.5,
                 show_default=True,
                 help="Share of the prompt a prefill worker must hold to be chosen for it."),
    click.option("--balance-abs-threshold", type=click.IntRange(min=0), default=4,
                 show_default=True,
                 help="Load imbalance (requests in flight, max - min) above which the least "
                      "loaded prefill worker is chosen instead of the cache's."),
    click.option("--balance-rel-threshold", type=click.FloatRange(min=1), default=1.5,
                 show_default=True, help="... and max > this x min."),
    click.option("--local-prefill-tokens", type=click.IntRange(min=0), default=0,
                 show_default=True,
                 help="Prompts of at most this many tokens (estimated) skip the prefill "
                      "workers: their decode worker computes them. 0: never."),
    click.option("--local-prefill-queue-s", type=click.FloatRange(min=0), default=0.0,
                 show_default=True,
                 help="... only while the prefill worker's queue would keep them waiting "
                      "at least this many seconds. 0: always."),
]


def _with(options):
    def wrap(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return wrap


def _run_router(prefill, decode, host, port, ttft_slo, tpot_slo, cache_threshold,
                balance_abs_threshold, balance_rel_threshold, local_prefill_tokens,
                local_prefill_queue_s, log_level="warning") -> None:
    import logging

    import uvicorn

    from .admission import SloConfig
    from .router_app import create_router_app
    from .router_state import RouterOptions, RouterState
    from .selection import LocalPrefillPolicy, SelectionPolicy

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from .. import telemetry

    telemetry.configure("qserve-router")  # on only where the OTEL_* variables ask for it
    options = RouterOptions(SelectionPolicy(cache_threshold, balance_abs_threshold,
                                            balance_rel_threshold),
                            SloConfig(ttft_slo, tpot_slo),
                            LocalPrefillPolicy(local_prefill_tokens, local_prefill_queue_s))
    app = create_router_app(RouterState(list(prefill), list(decode), options))
    click.echo(f"qserve router: {len(prefill)} prefill, {len(decode)} decode workers; serving "
               f"at http://{host}:{port}/v1", err=True)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()


@click.command(name="router")
@click.option("--prefill", multiple=True, required=True, metavar="URL",
              help="A prefill worker (`qserve serve ... --role prefill`); repeat for more.")
@click.option("--decode", multiple=True, required=True, metavar="URL",
              help="A decode worker (`qserve serve ... --role decode`); repeat for more.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@_with(slo_options)
def router(prefill, decode, host, port, **kw):
    """OpenAI-compatible router over prefill and decode workers: KV-cache-aware prefill
    choice, decode by load and free KV blocks, early rejection against SLOs."""
    _run_router(prefill, decode, host, port, **kw)


@click.command(name="cluster")
@click.argument("artifact")
@click.option("--prefill", "num_prefill", type=click.IntRange(min=1), default=1,
              show_default=True)
@click.option("--decode", "num_decode", type=click.IntRange(min=1), default=1,
              show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Threads (and pinned cores) per worker.")
@click.option("--worker-arg", "worker_args", multiple=True,
              help="An extra `qserve serve` option for every worker (repeat), e.g. "
                   "--worker-arg=--allow-ungated.")
@click.option("--prefill-worker-arg", "prefill_args", multiple=True,
              help="An extra `qserve serve` option for the prefill workers only (repeat).")
@click.option("--decode-worker-arg", "decode_args", multiple=True,
              help="An extra `qserve serve` option for the decode workers only (repeat), "
                   "e.g. --decode-worker-arg=--max-prefill-tokens-with-decodes=32 to "
                   "spread local prefills over steps.")
@click.option("--kv-transport", type=click.Choice(["socket", "mooncake"]), default="socket",
              show_default=True, help="The decode workers' KV receivers (`qserve serve "
                                      "--kv-transport`).")
@click.option("--kv-receive-on", type=click.Choice(["decode-cores", "prefill-cores"]),
              default="prefill-cores", show_default=True,
              help="Where decode workers read, check and copy into their KV pool the KV "
                   "frames they receive: on the prefill workers' cores (`qserve serve "
                   "--kv-receive-cores`), which keeps that work off the decode steps, or on "
                   "their own.")
@_with(slo_options)
def cluster(artifact, num_prefill, num_decode, host, port, threads, worker_args, prefill_args,
            decode_args, kv_transport, kv_receive_on, **kw):
    """Start NUM prefill and NUM decode workers of ARTIFACT (each pinned to its own cores,
    wrapping around when there are fewer) and a router in front; Ctrl-C or SIGTERM stops
    them all."""
    from ..benchmark.server_process import free_port
    from ..cli import prepare_builtin_artifact  # the command line composes the stages

    # a built-in model's artifact is made and gated here once, on all cores, before any
    # worker starts (each would otherwise do both on its own core); the workers are given
    # the model's name still (what clients ask for) and find both done
    prepare_builtin_artifact(artifact, gate="--allow-ungated" not in worker_args)
    # SIGTERM must unwind to the `finally` below, which stops the workers: by default it
    # kills this process outright, and uvicorn re-raises it once the router has stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cores = sorted(os.sched_getaffinity(0))
    procs, urls = [], {"prefill": [], "decode": []}
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    placed = [[cores[(i * threads + j) % len(cores)] for j in range(threads)]
              for i in range(len(roles))]  # each worker's cores, in `roles` order
    prefill_cores = sorted({c for i in range(num_prefill) for c in placed[i]})
    try:
        for i, role in enumerate(roles):
            wport = free_port()
            mine = placed[i]
            cmd = ["taskset", "-c", ",".join(map(str, mine)), sys.executable, "-m",
                   "qserve.runtime.cli", "serve", artifact, "--role", role, "--host",
                   "127.0.0.1", "--port", str(wport), "--threads", str(threads),
                   "--log-level", "warning", *worker_args]
            if role == "decode":
                cmd += ["--kv-transport", kv_transport, *decode_args]
                if kv_receive_on == "prefill-cores":
                    cmd += ["--kv-receive-cores", ",".join(map(str, prefill_cores))]
            else:
                cmd += list(prefill_args)
            procs.append(subprocess.Popen(cmd))
            urls[role].append(f"http://127.0.0.1:{wport}")
            click.echo(f"qserve cluster: {role} worker on port {wport}, cores {mine}",
                       err=True)
        _wait_healthy(urls["prefill"] + urls["decode"], procs)
        _run_router(urls["prefill"], urls["decode"], host, port, **kw)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _wait_healthy(urls: list[str], procs, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            if any(p.poll() is not None for p in procs):
                raise click.ClickException("a worker exited while starting (its error is "
                                           "above).")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise click.ClickException(f"worker {url} did not start in {timeout:.0f} s.")
            time.sleep(0.5)
