"""Retry delays: exponential backoff with full jitter, and the upstream's Retry-After.

Full jitter (sleep U(0, min(cap, base * 2**attempt))) spreads the retries of many clients
that failed together, which plain exponential backoff keeps in lockstep.
"""

from __future__ import annotations

import random
from email.utils import parsedate_to_datetime
from datetime import datetime, timezone

from .config import RetryConfig


def backoff_delay(config: RetryConfig, attempt: int, rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (0-based)."""
    cap = min(config.max_delay, config.base_delay * (2 ** attempt))
    return rng.uniform(0.0, cap)


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return max(0.0, (when - now).total_seconds())
