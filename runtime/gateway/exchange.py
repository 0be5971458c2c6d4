"""A client request as the proxy carries it from admission to its trace line."""

from __future__ import annotations

from dataclasses import dataclass, field

from .guardrails import RequestGuard
from .rate_limiter import Grant
from .routing import RouteChoice
from .trace import Trace


@dataclass
class Exchange:
    """A client request as the proxy carries it."""
    id: str
    path: str                  # "/v1/chat/completions" | "/v1/completions"
    chat: bool
    body: dict                 # the request as sent upstream (guardrails applied)
    stream: bool
    include_usage: bool        # the client asked for the usage chunk
    route: RouteChoice
    guard: RequestGuard | None
    grant: Grant | None
    trace: Trace
    t0: float                  # monotonic arrival
    cache_key: str | None = None   # set only when the cache is on and may keep the answer
    headers: dict[str, str] = field(default_factory=dict)
    waited: float = 0.0        # s slept between attempts (backoff, Retry-After)
    # the semantic cache's view of the request (a SemanticQuery, set when that cache is on
    # and may reuse the answer), and the question's embedding once looked up
    semantic: object | None = None
    semantic_vector: object | None = None
    span: object | None = None  # the request's span (runtime/telemetry.py), ended by finish
