"""Marking a backend up or down after an attempt or a probe.

    backend.mark(verdict(failure), now)     # after a failed attempt
    backend.mark(True, now)                 # it answered
    backend.mark(None, now)                 # no verdict: the client left first

What a mark does is the backend's own: the gateway's backends feed it to their circuit
breaker (gateway/backend.py), so a run of failures opens the circuit; the router's workers
are down from a failure until their next answered poll (disagg/worker_state.py).
"""

from __future__ import annotations

from typing import Protocol

from .failure import UpstreamFailure


class Health(Protocol):
    """A backend that requests and probes mark."""

    def mark(self, ok: bool | None, now: float) -> None:
        """`ok`: it worked (True), it failed (False), no verdict (None). `now`: monotonic s."""


def verdict(failure: UpstreamFailure) -> bool:
    """What a failed attempt says about its backend: a failure another attempt may fix (no
    answer, a 5xx, a 429) is the backend's (False); any other answer was the client's
    request, and the backend worked (True)."""
    return not failure.retryable
