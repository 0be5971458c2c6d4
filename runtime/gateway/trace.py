"""One JSONL trace line per request: who asked, where it went and why, what served it (down
to the artifact and gate-report digests of a qserve backend), how long each part took,
tokens, retries and guardrail actions, and (unless zero-retention) the text.

Each line is one write() on a file opened for appending, so concurrent requests never
interleave within a line and a crash loses at most the line being written.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass, field

from .config import TraceConfig

log = logging.getLogger("qserve.gateway")


@dataclass
class Attempt:
    backend: str
    group: str
    outcome: str           # "ok", "http_500", "http_429", "timeout", "connect_error", ...
    ms: float


@dataclass
class Trace:
    id: str
    time: float                         # unix seconds at arrival
    path: str
    key: str | None = None              # the API key's name, never the key
    model: str | None = None            # as the client sent it
    route: str | None = None            # why: "alias fast -> small", "auto -> small: ..."
    group: str | None = None            # the group that answered
    backend: str | None = None
    upstream_model: str | None = None
    artifact_digest: str | None = None
    gate_report_digest: str | None = None
    difficulty: float | None = None     # auto routing score
    stream: bool = False
    status: int = 200
    error: str | None = None
    cache: str | None = None            # "hit" | "semantic-hit" | "miss" | None (not cacheable)
    similarity: float | None = None     # a semantic hit's cosine similarity
    queue_ms: float | None = None       # arrival -> upstream request sent
    upstream_ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    retries: int = 0
    fallback: bool = False
    attempts: list[Attempt] = field(default_factory=list)
    guardrails: dict[str, int] = field(default_factory=dict)
    request: dict | None = None         # messages / prompt (after input guardrails)
    response: str | None = None         # completion text (choice 0) as the client got it


class TraceWriter:
    def __init__(self, config: TraceConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.fd = None
        if config.path:
            os.makedirs(os.path.dirname(os.path.abspath(config.path)), exist_ok=True)
            self.fd = os.open(config.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, trace: Trace) -> None:
        if self.fd is None:
            return
        failed = trace.status != 200 or trace.error is not None
        if not failed and self.config.sample < 1.0 and self.rng.random() >= self.config.sample:
            return
        record = asdict(trace)
        if self.config.zero_retention:
            record["request"] = record["response"] = None
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        try:
            os.write(self.fd, line.encode("utf-8"))
        except OSError as e:
            log.error("cannot write the trace log %s: %s", self.config.path, e.strerror)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
