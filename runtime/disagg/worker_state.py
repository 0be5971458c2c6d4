"""What the disaggregation router knows about one prefill or decode worker.

    w = WorkerState("http://p0:8000", "prefill")
    ahead, own = w.queued, Work.prompt(812)                 # on sending a prompt
    w.in_flight += 1; w.enqueue(own)
    w.dequeue(own); w.record_prefill(own, 0.25, ahead)      # on its first token
    w.prefill_s(Work.prompt(300))                           # predicted, queue included
    d = WorkerState("http://d0:8000", "decode")
    d.first_token_s.update(0.03)                            # KV in, first token out

Counts are kept by the router as it sends and completes requests; KV block counts are the
worker's own last report; rates are measured from completed work and smoothed (an
exponentially weighted moving average), so the selection and admission rules (selection.py,
admission.py) read one plain number per signal; a prefill worker's time is fitted as a
function of the work (prefill_cost.py), its token rate standing in until the fit exists.
An unmeasured rate stays None, which the admission rule reads as "do not predict" rather
than as zero.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .prefill_cost import PrefillCost, Work

ROLES = ("prefill", "decode")


@dataclass
class Ewma:
    """Exponentially weighted moving average; the first sample seeds it (no bias to zero)."""

    value: float | None = None

    def update(self, x: float, alpha: float = 0.2) -> float:
        """Fold in sample `x` with weight `alpha`; returns the new value."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not math.isfinite(x):
            raise ValueError(f"sample must be finite, got {x}")
        self.value = x if self.value is None else alpha * x + (1.0 - alpha) * self.value
        return self.value


@dataclass
class WorkerState:
    """One worker's health, load, KV room and measured speeds, as the router sees them."""

    url: str
    role: str                               # "prefill" | "decode"
    healthy: bool = True
    in_flight: int = 0                      # requests the router has outstanding on it
    queued: Work = Work()                   # prefill work sent and not yet done (prefill)
    head_since: float | None = None         # monotonic s the worker has been on the queue's head
    free_kv_blocks: int | None = None       # last reported by the worker
    total_kv_blocks: int | None = None
    # prompt tokens / prefill seconds (prefill)
    prefill_tokens_per_s: Ewma = field(default_factory=Ewma)
    # seconds as a function of the prefill work (prefill); used once fitted
    prefill_cost: PrefillCost = field(default_factory=PrefillCost)
    # seconds per generated token per stream, at the batch the worker ran (decode)
    decode_step_s: Ewma = field(default_factory=Ewma)
    # seconds to ship one prompt token's KV to a decode worker (prefill); adds to TTFT
    transfer_s_per_token: Ewma = field(default_factory=Ewma)
    # seconds a request stays on the worker from first to last token (decode); paces how
    # fast streams finish, for the Retry-After of a TPOT rejection
    stream_s: Ewma = field(default_factory=Ewma)
    # seconds from sending a request whose KV has arrived to its first streamed token
    # (decode): the import, the wait for the step in progress, the first step and the
    # router's hops; the per-request term of the TTFT prediction, whatever the prompt
    first_token_s: Ewma = field(default_factory=Ewma)
    # prompt tokens / seconds to the first token, for prompts this worker computes itself
    # (decode; local prefill, selection.prefill_locally), its steps' decodes included
    local_prefill_tokens_per_s: Ewma = field(default_factory=Ewma)
    # {sequences: seconds} of the worker's decode steps, its own measurement (decode;
    # runtime/step_times.py), read with its KV block counts
    step_s_by_rows: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def mark(self, ok: bool | None, now: float | None = None) -> None:
        """A request's or a poll's verdict (upstream_client/health.py): down on a failure
        until an answered poll marks it up again; None (no verdict) changes nothing."""
        if ok is not None:
            self.healthy = ok

    def enqueue(self, work: Work, now: float | None = None) -> None:
        """`work` was sent to this worker (a prefill worker runs its prompts in order)."""
        if self.queued.requests == 0:
            self.head_since = time.monotonic() if now is None else now
        self.queued += work

    def dequeue(self, work: Work, now: float | None = None) -> None:
        """`work` is done; the worker is on the next in the queue since `now`."""
        self.queued -= work
        self.head_since = (time.monotonic() if now is None else now) \
            if self.queued.requests > 0 else None

    def prefill_s(self, work: Work, now: float | None = None) -> float | None:
        """Seconds until `work` sent now has its first token: the queue's cost less the
        time the worker has been on its head (since the last prompt finished, or since the
        queue began), then the work's own cost, each the fitted cost, else tokens over the
        measured rate; None while neither exists."""
        if self.prefill_cost.fitted:
            cost = self.prefill_cost.seconds
        else:
            rate = self.prefill_tokens_per_s.value
            if rate is None or rate <= 0:
                return None
            cost = lambda w: w.tokens / rate  # noqa: E731
        own = cost(work)
        queue = self.queued
        if queue.requests <= 0 and queue.tokens <= 0:
            return own
        done = 0.0 if self.head_since is None else \
            (time.monotonic() if now is None else now) - self.head_since
        return own + max(cost(queue) - max(done, 0.0), 0.0)

    def record_prefill(self, own: Work, seconds: float, ahead: Work) -> None:
        """A prompt (`own`: the tokens it computed, those its prefix cache did not hold)
        got its first token `seconds` after it was sent, with the work `ahead` queued on
        this worker at the time. Only a prompt that had the worker to itself is a sample
        of the rate and of the cost fit: behind a queue, its wait holds what was left of
        the prompt in progress, which the router does not know (counting that prompt
        whole took the worker for faster than it is, the more the busier it was)."""
        if own.requests != 1 or own.tokens < 1 or ahead.tokens < 0 or not seconds > 0:
            raise ValueError(f"need one prompt of >= 1 token, a queue of >= 0 tokens and "
                             f"seconds > 0; got {own}, {ahead}, {seconds}")
        if ahead.requests > 0:
            return
        self.prefill_tokens_per_s.update(own.tokens / seconds)
        self.prefill_cost.record(own, seconds)
