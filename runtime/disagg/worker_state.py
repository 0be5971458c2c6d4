"""What the disaggregation router knows about one prefill or decode worker.

    w = WorkerState("http://p0:8000", "prefill")
    ahead = w.queued_prefill_tokens                         # on sending a prompt
    w.in_flight += 1; w.queued_prefill_tokens += 812
    w.record_prefill(812, 0.25, ahead)                      # on its first token
    d = WorkerState("http://d0:8000", "decode")
    d.first_token_s.update(0.03)                            # KV in, first token out

Counts are kept by the router as it sends and completes requests; KV block counts are the
worker's own last report; rates are measured from completed work and smoothed (an
exponentially weighted moving average), so the selection and admission rules (selection.py,
admission.py) read one plain number per signal. An unmeasured rate stays None, which the
admission rule reads as "do not predict" rather than as zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    queued_prefill_tokens: int = 0          # prompt tokens sent and not yet prefilled (prefill)
    free_kv_blocks: int | None = None       # last reported by the worker
    total_kv_blocks: int | None = None
    # prompt tokens / prefill seconds (prefill)
    prefill_tokens_per_s: Ewma = field(default_factory=Ewma)
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

    def record_prefill(self, tokens: int, seconds: float, ahead: int) -> None:
        """A prompt that needed `tokens` computed (those its prefix cache did not hold) got
        its first token `seconds` after it was sent, with `ahead` prompt tokens to compute
        queued on this worker at the time. Its wait covered their
        prefill too, so the rate sample is (ahead + tokens) / seconds: the same model the
        admission rule predicts with (TTFT = (queued + prompt) / rate). Counting only the
        request's own tokens would fold the queue into the rate, and the prediction would
        then count the queue twice: refusals of requests that would meet the SLO, the
        busier the worker the more of them."""
        if tokens < 1 or ahead < 0 or not seconds > 0:
            raise ValueError(f"need tokens >= 1, ahead >= 0 and seconds > 0; got {tokens}, "
                             f"{ahead}, {seconds}")
        self.prefill_tokens_per_s.update((ahead + tokens) / seconds)
