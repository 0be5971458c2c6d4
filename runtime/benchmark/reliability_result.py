"""What a reliability check returns, and how a run of checks is summarised and saved.

A check is a list of criteria (each passes or fails, with the numbers that decided it),
plus measurements worth recording whether or not anything failed. A check that could
not run at all (the server did not start, say) carries `error` and fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic_file


@dataclass
class Criterion:
    """One pass/fail rule of a check; `detail` says what was measured against what."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class CheckResult:
    name: str
    criteria: list[Criterion] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # observations that decide nothing
    duration_s: float = 0.0
    error: str | None = None  # the check could not run to its end

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.criteria) and all(c.passed for c in self.criteria)

    def require(self, name: str, passed: bool, detail: str = "") -> bool:
        """Add a criterion; returns whether it passed."""
        self.criteria.append(Criterion(name, bool(passed), detail))
        return bool(passed)

    @property
    def failed(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.passed]

    def to_dict(self) -> dict:
        return dict(asdict(self), passed=self.passed)


@dataclass
class ReliabilityReport:
    date: str
    cpu: str
    threads: int
    artifact: str
    config: dict[str, Any]
    checks: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        return {"date": self.date, "cpu": self.cpu, "threads": self.threads,
                "artifact": self.artifact, "config": self.config, "passed": self.passed,
                "checks": [c.to_dict() for c in self.checks]}


def percentiles_ms(seconds: list[float], qs: tuple[float, ...] = (50, 99)) -> dict[str, float]:
    """{"p50": ms, "p99": ms, "max": ms, "count": n} of samples given in seconds; empty
    samples give an empty dict (nothing measured is not zero)."""
    if not seconds:
        return {}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    out = {f"p{q:g}": round(float(np.percentile(ms, q)), 2) for q in qs}
    out["max"] = round(float(ms.max()), 2)
    out["count"] = int(ms.size)
    return out


def write_json_atomic(path: str | Path, data: dict) -> Path:
    """Write a report's `data` as JSON atomically (values JSON has no type for as str)."""
    return atomic_file.write_json_atomic(path, data, indent=2, default=str)


def summary_table(checks: list[CheckResult]) -> str:
    """A fixed-width table: one line per check, then one line per failed criterion."""
    lines = [f"{'check':<20} {'result':<7} {'time':>7}  key numbers", "-" * 78]
    for c in checks:
        verdict = "PASS" if c.passed else ("ERROR" if c.error else "FAIL")
        lines.append(f"{c.name:<20} {verdict:<7} {c.duration_s:>6.0f}s  {_headline(c)}")
        if c.error:
            lines.append(f"{'':<20}   error: {c.error}")
        for crit in c.failed:
            lines.append(f"{'':<20}   failed: {crit.name}: {crit.detail}")
    return "\n".join(lines)


def _headline(c: CheckResult) -> str:
    m = c.measurements
    keys = {
        "fuzz": ("operations", "examples", "status_counts"),
        "soak": ("requests", "survivors", "disconnected", "throughput_rps", "ttft_ms",
                 "rss_growth_pct"),
        "overload": ("rejected", "rejection_latency_ms"),
        "sigterm": ("stream_outcomes", "exit_code", "exit_s"),
        "quantize-interrupt": ("sigint_exit_code", "sigkill_left_temp", "rerun_exit_code"),
    }.get(c.name, ())
    parts = []
    for k in keys:
        if k in m:
            v = m[k]
            if isinstance(v, dict):
                v = ",".join(f"{a}={b}" for a, b in v.items() if a != "count")
            parts.append(f"{k}={v}")
    return "; ".join(parts)
