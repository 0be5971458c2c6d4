"""A semantic response cache: an answer is reused for the same question in other words.

    query = semantic_query(path, body, version, config)   # None: not reusable
    hit = cache.lookup(query, vector, threshold, now)     # SemanticHit or None
    cache.put(query, vector, response, now, pin)

What may match. A request is split into its question (the last user message's text; a
completion's prompt) and everything else (the earlier messages, the model and its
version, the sampling fields, tools, response_format...). Everything else must be
identical (`context`, a digest); only the question is compared by meaning. Reusable
requests are those with temperature 0 (unless `allow_sampled`), n = 1 and no logprobs.

How a match is decided: the cosine similarity of the questions' embeddings (embedder.py)
is at least the group's threshold, and guards agree, because an embedding puts a question
and its negation, or the same question about another number or day, closer than many true
paraphrases (measured: "Is it safe to ...?" / "Is it not safe to ...?" 0.99 against "Who
wrote Hamlet?" / "Which author wrote the play Hamlet?" 0.90): the numbers in both questions
are the same, both or neither hold a negation, and they hold the same words of time and
position (today, next, first, ...). The labelled set and the
threshold's choice: docs/gateway-semantic-cache.md.

The index is in process: per context, a matrix of unit vectors searched by one product
(exact; 1,024 entries of 384 floats take ~0.1 ms). It is bounded by `max_entries` over all
contexts (least recently used first) and a TTL; it does not outgrow one process's memory
or survive a restart, and several gateway workers keep one each.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .config import SemanticCacheConfig

_IGNORED = ("stream", "stream_options", "user")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_ROMAN = re.compile(r"\b[IVX]{2,}\b")  # World War II (a lone "I" is more often a pronoun)
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}
_NEGATION = re.compile(r"\b(?:not|no|never|none|nothing|nobody|neither|nor|without|cannot)\b"
                       r"|n't\b", re.IGNORECASE)
# words that pin a question to a time or a position: "today" is not "tomorrow", "the
# first" not "the second"
_SLOTS = frozenset(
    "today tomorrow yesterday tonight now currently recently soon later morning afternoon "
    "evening night week month year weekend past future last next previous this current "
    "first second third fourth fifth sixth seventh eighth ninth tenth final".split())
_WORD = re.compile(r"[a-z]+")


class SemanticQuery(NamedTuple):
    context: str   # digest of everything but the question
    question: str  # the text compared by meaning


def _text(content) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def semantic_query(path: str, body: dict, version: str,
                   config: SemanticCacheConfig) -> SemanticQuery | None:
    """The request split for the semantic cache, or None when its answer is not reusable
    (sampled, n > 1, logprobs, or no plain-text question)."""
    if body.get("temperature") != 0 and not config.allow_sampled:
        return None
    if body.get("n", 1) not in (1, None) or body.get("logprobs") or body.get("top_logprobs"):
        return None
    rest = {k: v for k, v in body.items() if k not in _IGNORED}
    if isinstance(body.get("messages"), list) and body["messages"]:
        last = body["messages"][-1]
        question = _text(last.get("content")) if isinstance(last, dict) else None
        if question is None or last.get("role") != "user":
            return None
        rest["messages"] = body["messages"][:-1] + [{k: v for k, v in last.items()
                                                     if k != "content"}]
    elif isinstance(body.get("prompt"), str):
        question = body["prompt"]
        rest.pop("prompt")
    else:
        return None
    if not question.strip():
        return None
    blob = json.dumps([path, version, rest], sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))
    return SemanticQuery(hashlib.sha256(blob.encode("utf-8")).hexdigest(), question)


def guards(text: str) -> tuple:
    """What two questions must share to match: their numbers (digits or words), whether
    they negate, and their words of time and position."""
    words = _WORD.findall(text.lower())
    numbers = [n.replace(",", "") for n in _NUMBER.findall(text)] + _ROMAN.findall(text)
    numbers += [_NUMBER_WORDS[w] for w in words if w in _NUMBER_WORDS]
    return (tuple(sorted(numbers)), bool(_NEGATION.search(text)),
            tuple(sorted(set(words) & _SLOTS)))


class SemanticHit(NamedTuple):
    response: dict
    pin: dict
    similarity: float


@dataclass
class _Entry:
    question: str
    guards: tuple
    response: dict
    pin: dict
    stored: float


@dataclass
class _Context:
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    entries: list = field(default_factory=list)  # _Entry per row of vectors


class SemanticCache:
    def __init__(self, config: SemanticCacheConfig) -> None:
        self.config = config
        self.contexts: dict[str, _Context] = {}
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()  # LRU of entries

    def __len__(self) -> int:
        return len(self._order)

    def lookup(self, query: SemanticQuery, vector: np.ndarray, threshold: float,
               now: float) -> SemanticHit | None:
        """The most similar stored answer of this context at or above `threshold` whose
        guards agree, or None. `vector`: the question's unit embedding [384]."""
        ctx = self.contexts.get(query.context)
        if ctx is None or not ctx.entries:
            return None
        self._expire(ctx, query.context, now)
        if not ctx.entries:
            return None
        sims = ctx.vectors @ vector  # [n] cosine similarities
        want = guards(query.question)
        for i in np.argsort(-sims):
            if sims[i] < threshold:
                break
            entry = ctx.entries[i]
            if entry.guards == want:
                self._order.move_to_end((query.context, entry.question))
                return SemanticHit(entry.response, entry.pin, float(sims[i]))
        return None

    def put(self, query: SemanticQuery, vector: np.ndarray, response: dict, now: float,
            pin: dict | None = None) -> None:
        ctx = self.contexts.setdefault(query.context, _Context())
        key = (query.context, query.question)
        if key in self._order:  # the same question again: the newer answer replaces it
            self._drop(key)
            ctx = self.contexts.setdefault(query.context, _Context())
        entry = _Entry(query.question, guards(query.question), response, pin or {}, now)
        row = vector.reshape(1, -1).astype(np.float32)
        ctx.vectors = row if not ctx.entries else np.vstack([ctx.vectors, row])
        ctx.entries.append(entry)
        self._order[key] = None
        while len(self._order) > self.config.max_entries:
            self._drop(next(iter(self._order)))

    def _expire(self, ctx: _Context, context: str, now: float) -> None:
        for e in [e for e in ctx.entries if now - e.stored > self.config.ttl]:
            self._drop((context, e.question))

    def _drop(self, key: tuple[str, str]) -> None:
        self._order.pop(key, None)
        ctx = self.contexts.get(key[0])
        if ctx is None:
            return
        keep = [i for i, e in enumerate(ctx.entries) if e.question != key[1]]
        ctx.entries = [ctx.entries[i] for i in keep]
        ctx.vectors = ctx.vectors[keep] if keep else np.zeros((0, 0), np.float32)
        if not ctx.entries:
            del self.contexts[key[0]]
