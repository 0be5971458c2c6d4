"""Benchmark: the served decode rate against the engine's own step rate, side by side.

    python -m qserve.runtime.benchmark.served_decode [MODEL] [--threads 2] [--batch 1,16,64]
        [--tokens 128] [--prompt-len 90] [--rounds 2]
    python -m qserve.runtime.benchmark.record served_decode --threads 2   # docs/generated/

Starts `qserve serve MODEL --threads N` as a child process and loads the same artifact
here with the same engine settings. For each round and batch size, interleaved (the one
idles while the other runs, so both see the same machine load): `b` greedy requests of
`--prompt-len`-token prompts (windows of held-out text, as token ids) and `--tokens`
output tokens (ignore_eos) are

  step    run through LLMEngine.step() in this process, each decode step timed (steps
          after every request's first token, before the first one finishes): the engine's
          own rate, b / median step;
  served  sent to the server at once as streaming /v1/completions, every SSE chunk timed
          on arrival: the inter-token latency (ITL) p50 over all streams, and the decode
          rate, summed over streams of each stream's tokens / its decode time.

`served / step` is the share of the engine's rate the HTTP server delivers (1.0: none
lost). The client reads the stream with the project's own HTTP client and parses only the
usage chunk, so that it takes little of the CPUs it shares with the server. Threads are
fixed on both sides (--threads); timings on a shared machine are noisy, so compare the
ratios of one run. Once the servers are up, this process takes the niceness the server
gives its engine threads, so that both engines get the same share of a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StreamTimes:
    """One served stream: chunk arrival times (perf_counter seconds) and its token count."""
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def window_rate(streams: list[StreamTimes]) -> float:
    """Chunks per second over all streams while every one of them decodes: from the last
    stream's first chunk to the first stream's last (a chunk is a token but where the
    detokenizer held one back for an incomplete character). 0: no such window."""
    start = max(s.chunks[0] for s in streams)
    end = min(s.chunks[-1] for s in streams)
    if end <= start:
        return 0.0
    return sum(sum(start < t <= end for t in s.chunks) for s in streams) / (end - start)


@dataclass
class Row:
    batch: int
    step_s: list[float] = field(default_factory=list)  # decode step seconds, all rounds
    itl: list[float] = field(default_factory=list)  # served ITL samples, all rounds
    step_rates: list[float] = field(default_factory=list)  # tok/s of each round
    served_rates: list[float] = field(default_factory=list)

    def add(self, steps: list[float], streams: list[StreamTimes]) -> None:
        self.step_s += steps
        self.itl += [x for s in streams for x in s.itl]
        self.step_rates.append(self.batch * len(steps) / sum(steps))
        self.served_rates.append(window_rate(streams))

    @property
    def ratio(self) -> float:
        """served / step rate, the median over rounds."""
        return statistics.median(s / t for s, t in zip(self.served_rates, self.step_rates))


def step_times(engine, prompts: list[list[int]], params) -> list[float]:
    """Seconds of each decode step of `prompts` run to the end through engine.step()."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"step-{i}", ids, params)
    started: set[str] = set()
    times, finished = [], False
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        decoding = len(started) == len(prompts)
        for out in outs:
            if out.token_ids:
                started.add(out.request_id)
            finished |= out.finished
        if decoding and not finished:
            times.append(dt)
    return times


def read_event(res: StreamTimes, line: bytes, now: float) -> None:
    """One SSE line of a streamed completion into `res`: the usage chunk's token count, an
    error event, or a chunk with text (its arrival time). Only lines that may be usage or
    error events are parsed (the client shares the server's CPU); a token whose text is
    "error" or "usage" is a chunk like any other."""
    if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
        return
    if b'"usage"' in line or b'"error"' in line:
        payload = json.loads(line[5:])
        if "error" in payload:
            res.error = line[:300].decode(errors="replace")
            return
        if payload.get("usage"):
            res.tokens = payload["usage"]["completion_tokens"]
            return
    if b'"text": ""' not in line and b'"text":""' not in line:
        res.chunks.append(now)


async def _stream(http, url: str, ids: list[int], model: str, tokens: int) -> StreamTimes:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    res = StreamTimes()
    resp = await http.request("POST", url, body, {"content-type": "application/json",
                                                  "connection": "close"})
    try:
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
            return res
        while line := await resp.readline():
            read_event(res, line, time.perf_counter())
    finally:
        resp.close()
    if res.tokens != tokens and not res.error:
        res.error = f"{res.tokens} tokens, expected {tokens}"
    return res


async def _served(base: str, model: str, prompts: list[list[int]],
                  tokens: int) -> list[StreamTimes]:
    from ..http_client import HttpClient

    http = HttpClient(user_agent="qserve-bench")
    try:
        return await asyncio.gather(*(_stream(http, base + "/v1/completions", ids, model,
                                              tokens) for ids in prompts))
    finally:
        await http.close()


def _renice_like_the_engine() -> None:
    """Every thread of this process (the in-process engine's, its OpenMP workers', the
    client's) gets the niceness `qserve serve` gives its engine threads (runtime/cli.py's
    ENGINE_NICE), so that on a machine shared with other work the two engines get the
    same share of the CPUs. Linux only; elsewhere nothing changes."""
    import os

    from ..cli import ENGINE_NICE

    tasks = "/proc/self/task"
    if not hasattr(os, "setpriority") or not os.path.isdir(tasks):
        return
    for tid in os.listdir(tasks):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid),
                           os.getpriority(os.PRIO_PROCESS, int(tid)) + ENGINE_NICE)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    import torch

    from ...evals.golden_text import heldout_token_ids
    from ...quantize.builtin_artifact import cached_builtin_artifact
    from ..engine import EngineConfig, LLMEngine
    from ..loaded_model import load
    from ..sampling_params import SamplingParams
    from ..warm_up import warm_up
    from .errors import BenchmarkError
    from .server_process import ServerProcess, free_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,16,64", help="Comma-separated stream counts.")
    ap.add_argument("--tokens", type=int, default=128, help="Output tokens per request.")
    ap.add_argument("--prompt-len", type=int, default=90)
    ap.add_argument("--rounds", type=int, default=2,
                    help="Times each batch runs on both sides, interleaved.")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="An extra `qserve serve` argument (repeatable).")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="Also serve from the qserve package in DIR/qserve (e.g. `git archive "
                         "COMMIT` unpacked there), interleaved with this one: before/after.")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        ap.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if args.tokens < 8 or args.rounds < 1 or min(batches) < 1 or args.prompt_len < 1 \
            or args.threads < 1:
        ap.error("--tokens must be >= 8, --rounds, --prompt-len, --threads and every batch "
                 "size >= 1")
    if max(batches) > 64:
        ap.error("at most 64 streams: the server's default --max-num-seqs")
    if args.baseline_tree and not (Path(args.baseline_tree) / "qserve" / "runtime").is_dir():
        ap.error(f"--baseline-tree {args.baseline_tree}: no qserve/runtime folder there")
    torch.set_num_threads(args.threads)
    artifact = cached_builtin_artifact(args.model)
    lm = load(artifact)
    engine = LLMEngine.from_model(lm, EngineConfig())
    warm_up(engine, lm.tokenizer)
    text = heldout_token_ids(lm.tokenizer)
    if len(text) < max(batches) * args.prompt_len:
        raise SystemExit(f"{max(batches)} prompts of {args.prompt_len} tokens need more "
                         f"held-out text than its {len(text)} tokens: lower --prompt-len.")
    prompts = [text[i * args.prompt_len:(i + 1) * args.prompt_len] for i in range(max(batches))]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    sides = {"served": None} if not args.baseline_tree else {"served": None, "baseline": None}
    rows = {(side, b): Row(b) for side in sides for b in batches}
    # SIGTERM ends the run like Ctrl-C: through the with-blocks, so the servers stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with ExitStack() as stack:
            for side in sides:
                port = free_port()
                cmd = [sys.executable, "-m", "qserve.runtime.cli", "serve", args.model,
                       "--host", "127.0.0.1", "--port", str(port), "--threads",
                       str(args.threads), "--allow-ungated", "--served-model-name", "m",
                       *args.serve_arg]
                env = ({"PYTHONPATH": str(Path(args.baseline_tree).resolve())}
                       if side == "baseline" else None)
                log = Path(tempfile.gettempdir()) / f"qserve-served-decode-{port}.log"
                sides[side] = stack.enter_context(ServerProcess(f"qserve serve ({side})", cmd,
                                                                port, log, env=env)).base
            _renice_like_the_engine()
            for b in batches:  # warm every side at every size (kernels, caches)
                step_times(engine, prompts[:b], SamplingParams(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True))
                for base in sides.values():
                    asyncio.run(_served(base, "m", prompts[:b], 8))
            for _ in range(args.rounds):
                for b in batches:
                    for side, base in sides.items():
                        steps = step_times(engine, prompts[:b], params)
                        time.sleep(0.2)
                        streams = asyncio.run(_served(base, "m", prompts[:b], args.tokens))
                        bad = [s.error for s in streams if s.error]
                        if bad:
                            raise BenchmarkError(f"{len(bad)} of {b} streams failed: {bad[0]}")
                        rows[side, b].add(steps, streams)
                        print(f"{side} {b} streams: step {statistics.median(steps) * 1e3:.2f} "
                              f"ms, ITL {statistics.median(rows[side, b].itl) * 1e3:.2f} ms, "
                              f"served/step {rows[side, b].ratio:.2f}", file=sys.stderr,
                              flush=True)
                        time.sleep(0.2)
    except BenchmarkError as e:
        raise SystemExit(f"served_decode: {e}") from None
    import os

    if hasattr(os, "getloadavg"):  # a shared machine's other work shows here
        print(f"load average at the end (1/5/15 min): "
              f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"{artifact}, {args.threads} thread(s) on both sides, {args.prompt_len}-token "
          f"prompts, {args.tokens} greedy tokens per stream, {args.rounds} round(s) "
          f"interleaved; step: LLMEngine.step() in-process; served: streaming "
          f"/v1/completions of `qserve serve`"
          + (f"; baseline: the same served from {args.baseline_tree}" if args.baseline_tree
             else ""))
    print(f"\n{'server':>8} {'streams':>7} {'step p50 ms':>11} {'ITL p50 ms':>10} "
          f"{'ITL/step':>8} {'step tok/s':>10} {'served tok/s':>12} {'served/step':>11}")
    for (side, b), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "served")):
        step_p50, itl_p50 = statistics.median(row.step_s), statistics.median(row.itl)
        print(f"{side:>8} {b:>7} {step_p50 * 1e3:>11.2f} {itl_p50 * 1e3:>10.2f} "
              f"{itl_p50 / step_p50:>8.2f} {statistics.median(row.step_rates):>10.1f} "
              f"{statistics.median(row.served_rates):>12.1f} {row.ratio:>11.2f}")
    print("\ntok/s: mean rate over the steps (step) or the time (served) in which every "
          "stream decodes; served/step: their ratio, the median over rounds (goal >= 0.9); "
          "each served run follows its own step run")


if __name__ == "__main__":
    main()
