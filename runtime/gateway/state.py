"""Everything the gateway's routes share, built from one config and swapped whole on reload.

    state = GatewayState.build(config, config_path)
    await state.start()            # probe every backend's /v1/models (warnings, no crash)
    state.reload()                 # SIGHUP: re-read the file; a bad file keeps the old config

A reload keeps what must survive it: the circuit breakers and in-flight counts of backends
whose config did not change, the rate-limit windows of keys that remain, the cache, the
metrics. Requests in flight hold their own references and finish on the old objects.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from .backend import Backend
from .config import ConfigError, GatewayConfig, load_config
from ..http_client import HttpClient
from .metrics import GatewayMetrics
from .rate_limiter import RateLimiter
from .response_cache import ResponseCache
from .semantic_cache import SemanticCache
from .routing import Router
from .trace import TraceWriter

log = logging.getLogger("qserve.gateway")
VERSION_REFRESH_S = 30.0   # how often backends' model versions (artifact digests) are re-read


class GatewayState:
    def __init__(self, config: GatewayConfig, path: str | None = None,
                 rng: random.Random | None = None, clock=time.monotonic) -> None:
        self.path = path
        self.version_refresh_s = VERSION_REFRESH_S
        self.rng = rng or random.Random()
        self.clock = clock
        self.metrics = GatewayMetrics()
        self.client: HttpClient | None = None   # made in start(), on the loop
        self.backends: dict[str, Backend] = {}
        self.limiter = RateLimiter(config.keys)
        self.cache = ResponseCache(config.cache)
        self.semantic = SemanticCache(config.cache.semantic)
        self.embedder = None  # loaded in start() when the semantic cache is on
        self.tracer = TraceWriter(config.trace, self.rng)
        self._apply(config)

    def _apply(self, config: GatewayConfig) -> None:
        old = self.backends
        backends = {}
        for bc in config.backends:
            prev = old.get(bc.name)
            if prev is not None and prev.config == bc and prev.breaker.config == config.circuit:
                backends[bc.name] = prev
            else:
                backends[bc.name] = Backend(bc, config.circuit)
        self.config = config
        self.backends = backends
        self.router = Router(config, backends, self.rng)
        self.limiter.update(config.keys)
        if self.cache.config != config.cache:
            self.cache = ResponseCache(config.cache)
        if self.semantic.config != config.cache.semantic:
            self.semantic = SemanticCache(config.cache.semantic)
        if self.tracer.config != config.trace:
            self.tracer.close()
            self.tracer = TraceWriter(config.trace, self.rng)

    async def start(self) -> None:
        # no pool limit (backends' max_concurrency caps each), keep-alive connections
        self.client = HttpClient()
        await self.load_embedder()
        await self.probe(self.backends.values())

    async def load_embedder(self) -> None:
        """The semantic cache's embedding model, loaded once (off the event loop) when the
        config turns the cache on; its questions are embedded on its own thread."""
        if self.config.cache.semantic.enabled and self.embedder is None:
            from .embedder import Embedder

            self.embedder = await asyncio.to_thread(Embedder.load)

    async def probe(self, backends, cool_down: bool = True) -> None:
        """Read each backend's model versions; with `cool_down`, one that does not answer
        starts cooled down (its circuit open), so the first requests go elsewhere."""
        now = self.clock()
        for b in backends:
            b.probed_at = now
            if not await b.probe(self.client) and cool_down:
                b.breaker._open(now)

    async def ensure_versions(self, backend) -> None:
        """A backend that just served a request but whose versions are unknown (it was
        down when last probed) is probed now, at most once a second (a server without
        /v1/models stays unknown), so the trace of that very request names its artifact."""
        if backend.versions or self.client is None:
            return
        if backend.probed_at is not None and self.clock() - backend.probed_at < 1.0:
            return
        await self.probe([backend], cool_down=False)

    async def refresh_versions(self, interval: float | None = None) -> None:
        """Re-read every backend's model versions every `interval` s (run as a task): a
        backend restarted with another artifact behind the same URL changes its digest,
        and the cache keys and traces follow within one interval. Requests, not this
        probe, decide a backend's circuit."""
        while True:
            await asyncio.sleep(interval or self.version_refresh_s)
            await self.probe(list(self.backends.values()), cool_down=False)

    async def reload(self) -> bool:
        """Re-read the config file; False (and an error in the log) if it is invalid."""
        if self.path is None:
            return False
        try:
            config = load_config(self.path)
        except ConfigError as e:
            log.error("config reload refused, keeping the running config: %s", e)
            return False
        before = set(self.backends.values())
        self._apply(config)
        await self.load_embedder()  # a reload may turn the semantic cache on
        await self.probe([b for b in self.backends.values() if b not in before])
        log.warning("config reloaded from %s: %d backends, %d groups", self.path,
                    len(config.backends), len(config.groups))
        return True

    async def close(self) -> None:
        self.tracer.close()
        if self.client is not None:
            await self.client.close()
