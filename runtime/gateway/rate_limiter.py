"""Per-key rate limits over a sliding 60-second window: requests/min, tokens/min and
requests in flight.

    grant = limiter.admit(key, estimated_tokens, now)   # Grant, or raises RateLimited
    ... proxy ...
    limiter.settle(grant, actual_tokens, now)           # once, when the response ends

Tokens are estimated at admission (prompt characters / 4 plus max_tokens x n) and
reserved; when the response ends the reservation becomes the usage the backend reported,
so a request that stopped early gives the difference back. The window is exact (a log of
the last minute's entries, not a fixed bucket), so "60 per minute" never lets 120 through
across a bucket edge.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .config import ApiKey

WINDOW = 60.0


class RateLimited(Exception):
    """Over a limit ("requests", "tokens" or "concurrent"): answer 429 with Retry-After
    and these headers."""

    def __init__(self, limit: str, message: str, retry_after: float,
                 headers: dict[str, str]) -> None:
        super().__init__(message)
        self.limit, self.retry_after, self.headers = limit, retry_after, headers


class TooLarge(ValueError):
    """The request alone exceeds the key's tokens per minute: no wait would admit it."""


@dataclass
class _Entry:
    time: float
    tokens: int


@dataclass
class Grant:
    """An admitted request's hold on its key's limits; `headers` are the x-ratelimit-*
    values at admission."""
    key: str
    entry: _Entry | None
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


def _reset(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '250ms'."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class _KeyState:
    def __init__(self) -> None:
        self.requests: deque[float] = deque()
        self.tokens: deque[_Entry] = deque()
        self.in_flight = 0

    def expire(self, now: float) -> None:
        while self.requests and now - self.requests[0] >= WINDOW:
            self.requests.popleft()
        while self.tokens and now - self.tokens[0].time >= WINDOW:
            self.tokens.popleft()

    def used_tokens(self) -> int:
        return sum(e.tokens for e in self.tokens)


class RateLimiter:
    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self.keys = {k.name: k for k in keys}
        self.state: dict[str, _KeyState] = {}

    def update(self, keys: tuple[ApiKey, ...]) -> None:
        """New limits (config reload); the windows of keys that stay are kept."""
        self.keys = {k.name: k for k in keys}
        self.state = {n: s for n, s in self.state.items() if n in self.keys}

    def admit(self, key: str, tokens: int, now: float) -> Grant:
        limits = self.keys[key].limits
        st = self.state.setdefault(key, _KeyState())
        st.expire(now)
        headers: dict[str, str] = {}
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm is not None:
            wait = WINDOW - (now - st.requests[0]) if len(st.requests) >= rpm else 0.0
            headers |= {"x-ratelimit-limit-requests": str(rpm),
                        "x-ratelimit-remaining-requests": str(max(0, rpm - len(st.requests) - 1)),
                        "x-ratelimit-reset-requests":
                            _reset(WINDOW - (now - st.requests[0]) if st.requests else 0)}
            if wait > 0:
                headers["x-ratelimit-remaining-requests"] = "0"
                raise RateLimited("requests", f"rate limit reached for key {key!r}: {rpm} "
                                  f"requests per minute; retry after {math.ceil(wait)} s.",
                                  wait, headers)
        if tpm is not None:
            if tokens > tpm:
                raise TooLarge(f"this request may use ~{tokens} tokens (prompt estimate plus "
                               f"max_tokens), more than key {key!r}'s {tpm} tokens per minute; "
                               f"lower max_tokens or shorten the prompt.")
            used = st.used_tokens()
            wait, freed = 0.0, tpm - used
            for e in st.tokens:        # oldest first: when enough will have expired
                if freed >= tokens:
                    break
                freed += e.tokens
                wait = WINDOW - (now - e.time)
            headers |= {"x-ratelimit-limit-tokens": str(tpm),
                        "x-ratelimit-remaining-tokens": str(max(0, tpm - used - tokens)),
                        "x-ratelimit-reset-tokens":
                            _reset(WINDOW - (now - st.tokens[0].time) if st.tokens else 0)}
            if used + tokens > tpm:
                headers["x-ratelimit-remaining-tokens"] = str(max(0, tpm - used))
                raise RateLimited("tokens", f"rate limit reached for key {key!r}: {tpm} tokens "
                                  f"per minute ({used} used, this request ~{tokens}); retry "
                                  f"after {math.ceil(wait)} s.", wait, headers)
        if limits.concurrent is not None and st.in_flight >= limits.concurrent:
            raise RateLimited("concurrent", f"key {key!r} has {st.in_flight} requests in "
                              f"flight, its limit; retry when one finishes.", 1.0, headers)
        entry = None
        if rpm is not None:
            st.requests.append(now)
        if tpm is not None:
            entry = _Entry(now, tokens)
            st.tokens.append(entry)
        st.in_flight += 1
        return Grant(key, entry, headers)

    def settle(self, grant: Grant, tokens: int | None) -> None:
        """The request ended: release its slot; replace the token estimate by the usage the
        backend reported (None: keep the estimate)."""
        if grant.settled:
            return
        grant.settled = True
        st = self.state.get(grant.key)
        if st is None:
            return
        st.in_flight = max(0, st.in_flight - 1)
        if grant.entry is not None and tokens is not None:
            grant.entry.tokens = max(0, int(tokens))
