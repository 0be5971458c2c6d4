"""A backend at run time: its config, circuit breaker, requests in flight, and the model
versions it reported.

The versions come from the backend's GET /v1/models. For a qserve backend each model card
carries the artifact digest and the gate-report digest, which pin the exact weights a
trace and a cache entry came from; for other servers the version is the card's id and
`created` time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .circuit import CircuitBreaker
from .config import BackendConfig, CircuitConfig
from ..http_client import HttpClient
from ..upstream_client import UpstreamFailure, fetch

log = logging.getLogger("qserve.gateway")


@dataclass(frozen=True)
class ModelVersion:
    model: str
    artifact_digest: str | None = None
    gate_report_digest: str | None = None
    created: int | None = None

    @property
    def key(self) -> str:
        """What identifies the weights behind this model, for cache keys."""
        if self.artifact_digest:
            return f"artifact:{self.artifact_digest}"
        return f"{self.model}@{self.created}"

    @classmethod
    def from_card(cls, card: dict) -> "ModelVersion":
        qs = card.get("qserve") if isinstance(card.get("qserve"), dict) else {}
        created = card.get("created")
        return cls(str(card.get("id")), qs.get("artifact_digest"), qs.get("gate_report_digest"),
                   created if isinstance(created, int) else None)


class Backend:
    def __init__(self, config: BackendConfig, circuit: CircuitConfig) -> None:
        self.config = config
        self.breaker = CircuitBreaker(circuit)
        self.outstanding = 0          # requests in flight to it now
        self.versions: dict[str, ModelVersion] = {}
        self.probed_at: float | None = None   # clock time of the last probe attempt

    @property
    def name(self) -> str:
        return self.config.name

    def headers(self) -> dict[str, str]:
        if self.config.api_key:
            return {"Authorization": f"Bearer {self.config.api_key}"}
        return {}

    def saturated(self) -> bool:
        return self.outstanding >= self.config.max_concurrency

    def load(self) -> float:
        """Least-outstanding-requests, weighted: the next request's share of the weight."""
        return (self.outstanding + 1) / self.config.weight

    def mark(self, ok: bool | None, now: float) -> None:
        """An attempt's verdict (upstream_client/health.py) into the circuit breaker: a
        success or a failure is recorded; None (the client left) frees a half-open trial."""
        if ok is None:
            self.breaker.release(now)
        else:
            self.breaker.record(ok, now)

    def version(self, model: str) -> ModelVersion:
        return self.versions.get(model) or ModelVersion(model)

    async def probe(self, client: HttpClient) -> bool:
        """Read GET /v1/models into `versions`; False (and a warning) when unreachable."""
        try:
            reply = await fetch(client, "GET", self.config.url + "/v1/models",
                                headers=self.headers(),
                                timeout=self.config.timeouts.connect + 3,
                                connect_timeout=self.config.timeouts.connect)
            if reply.status != 200:
                raise ValueError(f"HTTP {reply.status}")
            cards = reply.json().get("data", [])
        except (UpstreamFailure, ValueError, AttributeError) as e:
            log.warning("backend %s (%s) did not answer GET /v1/models: %s; it starts "
                        "cooled down", self.name, self.config.url, e or type(e).__name__)
            return False
        self.versions = {}
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and card.get("id") is not None:
                v = ModelVersion.from_card(card)
                self.versions[v.model] = v
        missing = [m for m in self.config.models if m not in self.versions]
        if missing and self.versions:
            log.warning("backend %s does not list model(s) %s in /v1/models (it lists %s)",
                        self.name, ", ".join(missing), ", ".join(sorted(self.versions)))
        return True
