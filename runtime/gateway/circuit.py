"""A per-backend circuit breaker: closed -> open after N failures in a window -> half-open
after a cooldown (one trial request) -> closed on its success, open again on failure.

    breaker = CircuitBreaker(CircuitConfig(failures=5, window=30, cooldown=10))
    if breaker.allow(now): ... send ...; breaker.record(ok, now)

Times are passed in (monotonic seconds) so tests drive the clock.
"""

from __future__ import annotations

from collections import deque

from .config import CircuitConfig

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}   # for the /metrics gauge


class CircuitBreaker:
    def __init__(self, config: CircuitConfig) -> None:
        self.config = config
        self.state = CLOSED
        self.failures: deque[float] = deque()   # times of recent failures (closed state)
        self.opened_at = 0.0
        self.trial_in_flight = False

    def current(self, now: float) -> str:
        """The state at `now` (an open circuit past its cooldown reads half-open)."""
        if self.state == OPEN and now - self.opened_at >= self.config.cooldown:
            self.state, self.trial_in_flight = HALF_OPEN, False
        return self.state

    def available(self, now: float) -> bool:
        """Whether a request may be sent now; does not reserve the half-open trial."""
        state = self.current(now)
        return state == CLOSED or (state == HALF_OPEN and not self.trial_in_flight)

    def allow(self, now: float) -> bool:
        """Whether to send a request now; in half-open, reserves the one trial request."""
        if not self.available(now):
            return False
        if self.state == HALF_OPEN:
            self.trial_in_flight = True
        return True

    def record(self, ok: bool, now: float) -> None:
        """The outcome of a request sent after allow()."""
        if self.current(now) == HALF_OPEN:
            self.trial_in_flight = False
            if ok:
                self.state = CLOSED
                self.failures.clear()
            else:
                self._open(now)
            return
        if ok or self.state == OPEN:
            return
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.config.window:
            self.failures.popleft()
        if len(self.failures) >= self.config.failures:
            self._open(now)

    def release(self, now: float) -> None:
        """A request sent after allow() ended without a verdict (the client left)."""
        if self.current(now) == HALF_OPEN:
            self.trial_in_flight = False

    def _open(self, now: float) -> None:
        self.state, self.opened_at = OPEN, now
        self.failures.clear()
