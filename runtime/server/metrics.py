"""Server metrics as Prometheus text (exposition format 0.0.4), no client library.

Latencies are histograms observed on the event loop (one thread, so no locks); engine
gauges (queue depth, running, KV blocks, prefix hit rate, preemptions) are read from the
engine's last stats snapshot when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the gateway renders metrics too, without the engine (and torch)
    from ..engine import EngineStats

PREFIX = "qserve_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OUTCOMES = ("stop", "length", "abort", "error", "rejected", "invalid")


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        n = PREFIX + self.name
        lines = [f"# HELP {n} {self.help}", f"# TYPE {n} histogram"]
        cumulative = 0
        for bound, c in zip(self.buckets, self.counts):
            cumulative += c
            lines.append(f'{n}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines.append(f'{n}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{n}_sum {_num(self.sum)}", f"{n}_count {self.count}"]
        return lines


def _num(x) -> str:
    if isinstance(x, bool):
        return str(int(x))
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class ServerMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram("time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = Histogram("request_latency_seconds",
                             "Time from request arrival to its last token.", E2E_BUCKETS)
        self.requests: dict[str, int] = defaultdict(int)
        for o in OUTCOMES:
            self.requests[o] = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.in_flight = 0  # engine requests admitted by the server and not yet finished

    def outcome(self, outcome: str, n: int = 1) -> None:
        self.requests[outcome] += n

    def render(self, stats: EngineStats, max_in_flight: int) -> str:
        lines: list[str] = []

        def metric(name, kind, help, samples):
            n = PREFIX + name
            lines.extend([f"# HELP {n} {help}", f"# TYPE {n} {kind}"])
            for labels, value in samples:
                lines.append(f"{n}{labels} {_num(value)}")

        metric("requests_total", "counter",
               "Requests (one per prompt) by outcome: stop/length (finished), abort (client "
               "went away), error (engine failure), rejected (overload; a request refused before its "
               "body is read, when the server is full, counts once), invalid (bad input).",
               [(f'{{outcome="{o}"}}', v) for o, v in sorted(self.requests.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
               [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.",
               [("", self.generation_tokens)])
        metric("requests_in_flight", "gauge",
               "Requests admitted by the server and not finished (running or waiting).",
               [("", self.in_flight)])
        metric("requests_in_flight_limit", "gauge",
               "Most requests admitted at once; beyond it the server answers 429.",
               [("", max_in_flight)])
        metric("num_requests_waiting", "gauge", "Requests in the engine's waiting queue.",
               [("", stats.num_waiting)])
        metric("num_requests_running", "gauge", "Requests the engine is running.",
               [("", stats.num_running)])
        metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.",
               [("", stats.kv_blocks_total)])
        metric("kv_blocks_used", "gauge", "KV cache blocks in use.",
               [("", stats.kv_blocks_total - stats.kv_blocks_free)])
        metric("kv_blocks_free", "gauge", "KV cache blocks free (including cached, evictable).",
               [("", stats.kv_blocks_free)])
        usage = 1 - stats.kv_blocks_free / stats.kv_blocks_total if stats.kv_blocks_total else 0
        metric("kv_cache_usage_ratio", "gauge", "Share of KV blocks in use.", [("", usage)])
        metric("prefix_cache_hit_rate", "gauge", "Prefix cache hits / lookups (blocks).",
               [("", stats.prefix_hit_rate)])
        metric("num_preemptions_total", "counter", "Requests preempted (recomputed) so far.",
               [("", stats.num_preemptions)])
        metric("tokens_computed_total", "counter", "Tokens run through the model.",
               [("", stats.tokens_computed)])
        metric("tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
               [("", stats.tokens_cached)])
        if stats.spec is not None:  # speculative decoding (runtime/spec) is on
            sp = stats.spec
            metric("spec_decode_num_draft_tokens_total", "counter",
                   "Draft tokens proposed and scored by the target.", [("", sp.proposed)])
            metric("spec_decode_num_accepted_tokens_total", "counter",
                   "Draft tokens accepted by rejection sampling.", [("", sp.accepted)])
            metric("spec_decode_num_cut_tokens_total", "counter",
                   "Drafts the draft budget cut: not verified, or not made by a draft model.",
                   [("", sp.cut)])
            metric("spec_decode_num_steps_total", "counter",
                   "Request-steps that verified drafts.", [("", sp.steps)])
            metric("spec_decode_num_emitted_tokens_total", "counter",
                   "Tokens emitted by those steps (accepted drafts + one each).",
                   [("", sp.emitted)])
            metric("spec_decode_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
                   [("", sp.acceptance_rate)])
            metric("spec_decode_mean_accepted_length", "gauge",
                   "Tokens emitted per verifying step.", [("", sp.mean_accepted_length)])
        for h in (self.ttft, self.itl, self.e2e):
            lines += h.render()
        return "\n".join(lines) + "\n"
