"""Retry delays: exponential backoff with full jitter, and the upstream's Retry-After
(parsed by the shared upstream client, runtime/upstream_client/retry_after.py).

Full jitter (sleep U(0, min(cap, base * 2**attempt))) spreads the retries of many clients
that failed together, which plain exponential backoff keeps in lockstep.
"""

from __future__ import annotations

import random

from ..upstream_client.retry_after import parse_retry_after
from .config import RetryConfig

__all__ = ["backoff_delay", "parse_retry_after"]


def backoff_delay(config: RetryConfig, attempt: int, rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (0-based)."""
    cap = min(config.max_delay, config.base_delay * (2 ** attempt))
    return rng.uniform(0.0, cap)
