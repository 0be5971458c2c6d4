"""Early rejection: refuse a request at the door when it would miss the latency SLO.

    rejection = admit(prefill, decode, prompt_tokens, SloConfig(ttft_s=2.0, tpot_s=0.05))
    if rejection is not None:
        counters.record(rejection, prompt_tokens)
        answer rejection.status with "Retry-After: {rejection.retry_after_s}"

Mooncake's prediction-based early rejection: the router predicts the request's time to
first token (TTFT) and time per output token (TPOT) from the chosen workers' queues and
measured rates, and rejects before any prefill is spent on a request that would miss its
SLO anyway, so the cluster's work goes to requests that can still meet theirs.

Model (WorkerState holds the inputs):
  TTFT = prefill cost of this prompt
         + what is left of the cost of the work queued on the prefill worker (its cost
           less the time the worker has been on the queue's head)
         + prompt_tokens * transfer_s_per_token     (the transfer term only once measured)
         + the decode worker's first_token_s       (import, first step, hops; once measured)
         the cost fitted from the worker's past prompts as a * requests + b * tokens +
         c * tokens^2 (prefill_cost.py), until then tokens / prefill_tokens_per_s;
         a prompt's tokens leave out `cached_tokens`, the prefix the router believes the
         prefill worker holds (its prefix tree), which that worker does not compute again;
         the queue counts what is to be computed too. Both are measured from prompts that
         had the worker to themselves, their computed tokens against their time to the
         first token (WorkerState.record_prefill): a prefix-cache hit is not taken for
         speed.
  TTFT of a prompt the decode worker computes itself (local prefill, no prefill worker):
         prompt_tokens / the decode worker's local_prefill_tokens_per_s
  TPOT = the decode worker's own step time at in_flight + 1 sequences (step_s_by_rows,
         measured per number of sequences, runtime/step_times.py: interpolated between
         measured sizes, extrapolated along their slope);
         until it reports one: decode_step_s * (in_flight + 1) / max(in_flight, 1), the
         router's per-token time of finished streams scaled linearly from the worker's
         batch to one more stream (an upper bound: a step grows less than linearly).
A prediction is None while its rate is unmeasured: the router never rejects blind.

Statuses:
  429  the request would miss the SLO at the current load (`admit`); Retry-After is the
       predicted time until it would meet it.
  503  no worker can take the request at all: no healthy prefill or decode worker, or no
       decode worker with free KV blocks for it (`unavailable`, called by the router when
       selection finds nothing).

A request that would miss the SLO even on an idle worker (a very long prompt) cannot be
helped by waiting; rejecting it would only make its client retry forever. It is admitted
when the worker it needs is idle, and otherwise asked to retry when that worker should be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..step_times import step_at
from .prefill_cost import Work
from .worker_state import WorkerState

_EPS = 1e-9   # keeps float noise from rounding an exact 2.0 s up to a 3 s Retry-After


@dataclass(frozen=True)
class SloConfig:
    """Latency targets in seconds; None leaves that target unchecked."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")


@dataclass(frozen=True)
class Prediction:
    """Predicted latencies in seconds; None where the rate behind it is not measured yet."""

    ttft_s: float | None
    tpot_s: float | None


@dataclass(frozen=True)
class Rejection:
    """An answer to send instead of serving: 429 (SLO miss) or 503 (no capacity)."""

    status: int
    reason: str          # short ASCII, e.g. "ttft 3.00s > 2.00s"
    retry_after_s: int   # whole seconds, >= 1
    predicted: Prediction


@dataclass
class AdmissionCounters:
    """Totals for /metrics: requests rejected, and the prompt tokens that were not prefilled."""

    rejected: int = 0
    prefill_tokens_saved: int = 0
    by_status: dict[int, int] = field(default_factory=dict)   # 429 / 503 -> rejected

    def record(self, rejection: Rejection, prompt_tokens: int) -> None:
        """Count one rejected request of `prompt_tokens` prompt tokens (none was prefilled)."""
        self.rejected += 1
        self.prefill_tokens_saved += prompt_tokens
        self.by_status[rejection.status] = self.by_status.get(rejection.status, 0) + 1


def predict(prefill: WorkerState | None, decode: WorkerState,
            prompt_tokens: int, cached_tokens: int = 0) -> Prediction:
    """TTFT and TPOT for a request of `prompt_tokens` tokens sent to this pair of workers,
    `cached_tokens` of them (a prefix) expected in the prefill worker's prefix cache;
    `prefill` None: the decode worker computes the prompt itself (local prefill)."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached_tokens must be in [0, prompt_tokens={prompt_tokens}], "
                         f"got {cached_tokens}")
    ttft = None
    if prefill is None:
        rate = decode.local_prefill_tokens_per_s.value
        if rate is not None and rate > 0:
            ttft = prompt_tokens / rate
    elif (ttft := prefill.prefill_s(Work.prompt(prompt_tokens, cached_tokens))) is not None:
        per_token = prefill.transfer_s_per_token.value
        if per_token is not None:
            ttft += prompt_tokens * per_token
        first = decode.first_token_s.value
        if first is not None:
            ttft += first
    return Prediction(ttft, _tpot(decode, decode.in_flight + 1))


def _tpot(decode: WorkerState, streams: int) -> float | None:
    """Seconds per output token with `streams` streams on the decode worker."""
    if decode.step_s_by_rows:
        return step_at(decode.step_s_by_rows, streams)
    step = decode.decode_step_s.value
    if step is None:
        return None
    n = decode.in_flight
    return step * streams / max(n, 1)


def admit(prefill: WorkerState | None, decode: WorkerState, prompt_tokens: int,
          slo: SloConfig, cached_tokens: int = 0) -> Rejection | None:
    """None to serve the request; a 429 Rejection when it is predicted to miss `slo`.
    `prefill` None: the decode worker computes the prompt itself (local prefill);
    `cached_tokens` as for `predict`."""
    predicted = predict(prefill, decode, prompt_tokens, cached_tokens)
    reasons: list[str] = []
    waits: list[float] = []
    if slo.ttft_s is not None and predicted.ttft_s is not None and predicted.ttft_s > slo.ttft_s:
        wait = (_ttft_wait(prefill, predicted.ttft_s, slo.ttft_s) if prefill is not None
                else _local_ttft_wait(decode))
        if wait is not None:
            reasons.append(f"ttft {predicted.ttft_s:.2f}s > {slo.ttft_s:.2f}s")
            waits.append(wait)
    if slo.tpot_s is not None and predicted.tpot_s is not None and predicted.tpot_s > slo.tpot_s:
        wait = _tpot_wait(decode, slo.tpot_s)
        if wait is not None:
            reasons.append(f"tpot {predicted.tpot_s:.3f}s > {slo.tpot_s:.3f}s")
            waits.append(wait)
    if not reasons:
        return None
    return Rejection(429, "; ".join(reasons), retry_after(max(waits)), predicted)


def unavailable(reason: str, retry_after_s: float = 1.0) -> Rejection:
    """The 503 for a request no worker can take (none healthy, or no decode KV room)."""
    return Rejection(503, reason, retry_after(retry_after_s), Prediction(None, None))


def retry_after(seconds: float) -> int:
    """A Retry-After value: whole seconds rounded up, at least 1."""
    return max(1, math.ceil(seconds - _EPS))


def _ttft_wait(prefill: WorkerState, ttft: float, slo: float) -> float | None:
    """Seconds until the prefill queue has drained enough for the request to meet `slo`.

    The queue drains at the measured rate, so the predicted TTFT falls one second per
    second waited. None when waiting cannot help (the request misses on an idle worker,
    which is idle now).
    """
    queue_s = prefill.prefill_s(Work()) or 0.0
    if ttft - queue_s <= slo:
        return ttft - slo
    return queue_s if queue_s > 0 else None


def _local_ttft_wait(decode: WorkerState) -> float | None:
    """A prompt the decode worker computes itself shares its steps with the streams there:
    busy, try again after the 1 s minimum; idle, waiting cannot help (None)."""
    return 1.0 if decode.in_flight > 0 else None


def _tpot_wait(decode: WorkerState, slo: float) -> float | None:
    """Seconds until enough of the decode worker's streams have finished to meet `slo`.

    With the worker's step table, at most the largest k <= in_flight + 1 whose step at k
    meets the SLO streams, the new one included, meet it; under the linear model one
    stream costs decode_step_s / max(in_flight, 1) per step, so floor(slo / that). Streams finish
    at in_flight / stream_s per second (each lasts stream_s on average); unmeasured, the
    wait is the 1 s minimum. None when waiting cannot help (one stream alone misses and the
    worker is idle now).
    """
    n = decode.in_flight
    if decode.step_s_by_rows:   # the most streams whose step meets the SLO
        fit = max((k for k in range(1, n + 2) if _tpot(decode, k) <= slo + _EPS), default=0)
    else:
        per_stream = decode.decode_step_s.value / max(n, 1)
        fit = math.floor(slo / per_stream + _EPS)    # streams, the new one included
    must_finish = n - fit + 1 if fit >= 1 else n
    if must_finish <= 0:
        return None
    stream_s = decode.stream_s.value
    if stream_s is None:
        return 1.0
    return must_finish * stream_s / n
