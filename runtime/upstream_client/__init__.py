"""The client side of talking to a backend, shared by the gateway (runtime/gateway/) and the
disaggregation router (runtime/disagg/): both send requests to backends over
runtime/http_client.py, relay their streams, retry elsewhere on failures and mark the
backends that fail.

    async with within(5.0): ...                          timeout.py: a bounded wait
    reply = await fetch(client, "GET", url, timeout=5, connect_timeout=2)      reply.py
    resp = await send(client, "POST", url, body, headers, timeout=120, connect_timeout=2)
    lines = LineStream(resp, read_timeout=120)           lines.py: an SSE stream, line by line
    except UpstreamFailure as f: f.retryable             failure.py: what failed, retry or not
    backend.mark(verdict(f), now)                        health.py: up or down

Which backend gets an attempt, and how many attempts there are, is each caller's own: the
gateway's attempt loop (gateway/attempts.py) and the router (disagg/router.py).
"""

from .failure import (RETRYABLE_4XX, UpstreamFailure, failure_from_exception,
                      failure_from_response, is_retryable)
from .health import Health, verdict
from .lines import LineStream
from .reply import Reply, fetch, send
from .retry_after import parse_retry_after
from .timeout import within

__all__ = ["RETRYABLE_4XX", "Health", "LineStream", "Reply", "UpstreamFailure",
           "failure_from_exception", "failure_from_response", "fetch", "is_retryable",
           "parse_retry_after", "send", "verdict", "within"]
