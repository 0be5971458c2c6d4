"""An exact-match response cache for deterministic requests.

    key = cache_key(path, body, version_key)      # None: this request is not cacheable
    hit = cache.get(key, now); cache.put(key, response, now)

Only requests that ask for temperature 0 are cached (a sampled answer is not "the" answer),
and only n = 1 without logprobs. Tools and response formats are part of the request, so
an answer (tool calls included) is reused only for the very same tools, tool_choice and
schema. The key is a digest of the normalised request
(sorted JSON, without the fields that do not change the answer: stream, stream_options,
user) and of the serving model's version (the artifact digest for qserve backends), so a
new artifact behind the same name never serves an old answer. Entries are the upstream's
final response as one JSON body (a streamed response is assembled first); a hit is served
as a normal response, streamed when the client asked for a stream. LRU with a TTL.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

from .config import CacheConfig

_IGNORED = ("stream", "stream_options", "user")


def cache_key(path: str, body: dict, version: str) -> str | None:
    """The key of a cacheable request, or None."""
    if body.get("temperature") != 0 or body.get("n", 1) != 1:
        return None
    if body.get("logprobs") or body.get("top_logprobs"):
        return None
    norm = {k: v for k, v in body.items() if k not in _IGNORED}
    blob = json.dumps([path, version, norm], sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    response: dict        # the upstream's final response body
    pin: dict             # what served it: group, backend, upstream model, digests
    stored: float         # clock time it was stored


class ResponseCache:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.entries: OrderedDict[str, CacheEntry] = OrderedDict()

    def get(self, key: str, now: float) -> CacheEntry | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if now - entry.stored > self.config.ttl:
            del self.entries[key]
            return None
        self.entries.move_to_end(key)
        return entry

    def put(self, key: str, response: dict, now: float, pin: dict | None = None) -> None:
        self.entries[key] = CacheEntry(response, pin or {}, now)
        self.entries.move_to_end(key)
        while len(self.entries) > self.config.max_entries:
            self.entries.popitem(last=False)
