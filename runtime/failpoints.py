"""Failpoints: named places where this process fails on purpose, for fault-injection
tests of the distributed paths (a worker that dies mid-transfer, mid-request).

    QSERVE_FAILPOINTS=kv-send-partial qserve serve ART --role prefill   # set by a test
    if failpoints.active("kv-send-partial"): ...                         # at the place

Read once from the environment at import; with none set, `active` is one set lookup.
Each name is documented where it fires:

    kv-send-partial      prefill worker: sends half of a KV frame, then the process exits
    decode-exit-on-kv    decode worker: exits once a request's KV transfer has arrived,
                         before any token is generated
"""

from __future__ import annotations

import os
import sys

KNOWN = frozenset({"kv-send-partial", "decode-exit-on-kv"})
_ACTIVE = frozenset(n.strip() for n in os.environ.get("QSERVE_FAILPOINTS", "").split(",")
                    if n.strip())
if _ACTIVE - KNOWN:
    raise SystemExit(f"QSERVE_FAILPOINTS names unknown failpoints "
                     f"{', '.join(sorted(_ACTIVE - KNOWN))}; known: {', '.join(sorted(KNOWN))}")


def active(name: str) -> bool:
    return name in _ACTIVE


def die(name: str) -> None:
    """End the process at once, as a crash would (no cleanup, no graceful shutdown)."""
    print(f"failpoint {name}: exiting", file=sys.stderr, flush=True)
    os._exit(70)
