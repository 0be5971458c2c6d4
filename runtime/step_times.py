"""How long the engine's decode steps take, by how many sequences they run.

    times = StepTimes()
    times.record(rows=4, seconds=0.021)   # a step of one token per sequence, 4 sequences
    times.snapshot()                      # {1: 0.0144, 4: 0.021}: smoothed seconds per size
    step_at(times.snapshot(), 5)          # 0.0233: interpolated or extrapolated

The engine records every step in which each scheduled sequence ran one token (decodes,
and the one prompt token a request with imported KV computes); steps that carry more of
a prompt are a prefill's cost, not a decode step's. A disaggregation router reads the
table from a decode worker (GET /v1/disagg/info) and predicts the time per output token a
new stream would get as the step at one more sequence (runtime/disagg/admission.py).
"""

from __future__ import annotations

import math
import threading

ALPHA = 0.2          # weight of a new sample in a size's moving average
MAX_ROWS = 1024      # sizes beyond this are not recorded (no step runs that many)


class StepTimes:
    """Exponentially weighted seconds per step, per number of sequences; thread-safe (the
    engine thread records, a server thread reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rows: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        """One step of `rows` sequences, one token each, took `seconds`."""
        if not 1 <= rows <= MAX_ROWS or not (math.isfinite(seconds) and seconds > 0):
            return
        with self._lock:
            old = self._by_rows.get(rows)
            self._by_rows[rows] = seconds if old is None else ALPHA * seconds + (1 - ALPHA) * old

    def snapshot(self) -> dict[int, float]:
        """{sequences: seconds per step}, smallest size first."""
        with self._lock:
            return dict(sorted(self._by_rows.items()))


def step_at(table: dict[int, float], rows: int) -> float | None:
    """Seconds of a step of `rows` sequences from a StepTimes snapshot: the measured value,
    else linear between the nearest measured sizes on either side, else beyond the
    measured range along the least-squares slope of all of them (never decreasing;
    with one size measured, proportional to the rows: an upper bound). None: empty."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if not table:
        return None
    if rows in table:
        return table[rows]
    sizes = sorted(table)
    lower = [n for n in sizes if n < rows]
    upper = [n for n in sizes if n > rows]
    if lower and upper:
        a, b = lower[-1], upper[0]
        return table[a] + (table[b] - table[a]) * (rows - a) / (b - a)
    if len(sizes) == 1:
        n = sizes[0]
        return table[n] * max(rows, n) / n
    mean_n = sum(sizes) / len(sizes)
    mean_s = sum(table[n] for n in sizes) / len(sizes)
    slope = (sum((n - mean_n) * (table[n] - mean_s) for n in sizes)
             / sum((n - mean_n) ** 2 for n in sizes))
    end = sizes[-1] if lower else sizes[0]
    return max(table[end] + max(slope, 0.0) * (rows - end), 0.0) if lower else table[end]
