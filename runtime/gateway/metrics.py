"""Gateway metrics as Prometheus text: per backend latency, errors, retries, fallbacks,
circuit state; cache hits; rate-limit and guardrail counts; gateway overhead.

Counters are dicts keyed by label tuples, observed on the event loop (one thread).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from ..server.metrics import _num
from .circuit import STATE_VALUE

PREFIX = "qserve_gateway_"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
OVERHEAD_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class LabeledHistogram:
    def __init__(self, name: str, help: str, label: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.label, self.buckets = name, help, label, buckets
        self.series: dict[str, list] = {}   # label value -> [counts..., sum, count]

    def observe(self, value: str, x: float) -> None:
        s = self.series.setdefault(value, [0] * (len(self.buckets) + 1) + [0.0, 0])
        s[bisect.bisect_left(self.buckets, x)] += 1
        s[-2] += x
        s[-1] += 1

    def render(self) -> list[str]:
        n = PREFIX + self.name
        lines = [f"# HELP {n} {self.help}", f"# TYPE {n} histogram"]
        for value, s in sorted(self.series.items()):
            lab = f'{self.label}="{value}"'
            cum = 0
            for bound, c in zip(self.buckets, s):
                cum += c
                lines.append(f'{n}_bucket{{{lab},le="{_num(bound)}"}} {cum}')
            lines.append(f'{n}_bucket{{{lab},le="+Inf"}} {s[-1]}')
            lines += [f"{n}_sum{{{lab}}} {_num(s[-2])}", f"{n}_count{{{lab}}} {s[-1]}"]
        return lines


class GatewayMetrics:
    COUNTERS = {
        "requests_total": ("Requests answered, by model group and HTTP status.",
                           ("group", "status")),
        "backend_requests_total": ("Upstream attempts, by backend and outcome.",
                                   ("backend", "outcome")),
        "retries_total": ("Upstream attempts after the first, by backend.", ("backend",)),
        "fallbacks_total": ("Requests served by a fallback group, by group.", ("group",)),
        "cache_total": ("Response cache lookups, by result.", ("result",)),
        "rate_limited_total": ("Requests refused by a rate limit, by key and limit.",
                               ("key", "limit")),
        "guardrail_actions_total": ("PII guardrail actions, by direction, entity, action.",
                                    ("direction", "entity", "action")),
        "auto_route_total": ("Requests for model auto, by chosen size.", ("target",)),
    }

    def __init__(self) -> None:
        self.counters: dict[str, dict[tuple, int]] = {n: defaultdict(int) for n in self.COUNTERS}
        self.latency = LabeledHistogram("backend_latency_seconds",
                                        "Upstream response time (to the last byte), by backend.",
                                        "backend", LATENCY_BUCKETS)
        self.ttft = LabeledHistogram("backend_ttft_seconds",
                                     "Upstream time to the first content token, by backend.",
                                     "backend", LATENCY_BUCKETS)
        self.overhead = LabeledHistogram("overhead_seconds",
                                         "Time spent in the gateway before the upstream call.",
                                         "path", OVERHEAD_BUCKETS)

    def inc(self, name: str, *labels: str, by: int = 1) -> None:
        self.counters[name][tuple(labels)] += by

    def guardrail_actions(self, actions: dict[str, int]) -> None:
        """Counts keyed 'input.email.mask' (RequestGuard.actions)."""
        for k, n in actions.items():
            parts = k.split(".")
            if len(parts) == 3 and n:
                self.inc("guardrail_actions_total", *parts, by=n)

    def render(self, backends, now: float) -> str:
        lines = []
        for name, (help, labels) in self.COUNTERS.items():
            n = PREFIX + name
            lines += [f"# HELP {n} {help}", f"# TYPE {n} counter"]
            for values, count in sorted(self.counters[name].items()):
                lab = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(labels, values))
                lines.append(f"{n}{{{lab}}} {count}")
        for h in (self.latency, self.ttft, self.overhead):
            lines += h.render()
        n = PREFIX + "circuit_state"
        lines += [f"# HELP {n} Circuit breaker state per backend (0 closed, 1 half-open, "
                  f"2 open).", f"# TYPE {n} gauge"]
        lines += [f'{n}{{backend="{b.name}"}} {STATE_VALUE[b.breaker.current(now)]}'
                  for b in backends]
        n = PREFIX + "backend_in_flight"
        lines += [f"# HELP {n} Requests in flight per backend.", f"# TYPE {n} gauge"]
        lines += [f'{n}{{backend="{b.name}"}} {b.outstanding}' for b in backends]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
