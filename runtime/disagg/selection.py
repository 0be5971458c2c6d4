"""Which prefill worker and which decode worker a request goes to.

    choice = choose_prefill(workers, prompt, tree, SelectionPolicy())
    tree.insert(prompt, choice.worker, now)     # the caller records where the prompt went
    dchoice = choose_decode(workers, blocks_needed=ceil(total_tokens / block_size))

Prefill follows SGLang's router's cache-aware rule. When load is imbalanced (the most and
least loaded workers differ by more than an absolute count AND the most loaded carries more
than a ratio times the least) the least loaded worker gets the request, so a hot prefix
cannot pile everything onto one worker. Otherwise the worker holding the longest prefix of
the text gets it when that prefix is a large enough share of the text (its KV is reused);
below that share no worker has much to offer, so the worker whose tree is smallest gets it,
which spreads distinct prefixes over the workers' caches. Load is the router's count of
requests in flight.

Decode has no prefix to reuse (the KV arrives with the request), so it goes by load alone:
the least loaded worker among those with room for the request's KV blocks.

A short prompt may skip the prefill workers (`prefill_locally`, NVIDIA Dynamo's
conditional disaggregation): the decode worker computes it in its own steps, as one chunk
beside its streams, instead of queueing it behind long prompts on a prefill worker and
shipping its KV. Off unless `LocalPrefillPolicy.max_tokens` is set; then prompts up to
that many tokens go local, always or only while the prefill worker's queue would keep them
waiting at least `min_queue_s`, and any such prompt does when no prefill worker is up.

Every choice is deterministic: ties go to the lower in-flight count, then to the url that
sorts first.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prefill_cost import Work
from .prefix_tree import ApproxPrefixTree
from .worker_state import WorkerState


@dataclass(frozen=True)
class SelectionPolicy:
    """Thresholds of the cache-aware prefill rule (SGLang's router's parameters)."""

    cache_threshold: float = 0.5      # match share (matched chars / text chars) to follow cache
    balance_abs_threshold: int = 4    # imbalanced: max - min in flight > abs ...
    balance_rel_threshold: float = 1.5  # ... AND max > rel * min

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """Which prompts the decode worker computes itself (`prefill_locally`)."""

    max_tokens: int = 0        # prompts up to this many tokens may go local; 0: none
    min_queue_s: float = 0.0   # ... when the prefill queue is at least this long; 0: always

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.min_queue_s >= 0:
            raise ValueError(f"min_queue_s must be >= 0, got {self.min_queue_s}")


@dataclass(frozen=True)
class Choice:
    """The chosen worker's url and why, short ASCII for a response header or a trace."""

    worker: str
    reason: str     # "cache 0.82" | "balance" | "smallest tree" | "load 2 free 40"
    matched_chars: int = 0  # leading chars of the prompt the router's tree says it holds


def is_imbalanced(loads: list[int], policy: SelectionPolicy) -> bool:
    """SGLang's router's rule: max - min > abs threshold and max > rel threshold * min."""
    if not loads:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > policy.balance_abs_threshold and hi > policy.balance_rel_threshold * lo


def choose_prefill(workers: list[WorkerState], text: str, tree: ApproxPrefixTree,
                   policy: SelectionPolicy) -> Choice | None:
    """The prefill worker for `text`; None when no healthy prefill worker exists."""
    pool = [w for w in workers if w.healthy and w.role == "prefill"]
    if not pool:
        return None
    matched = tree.match(text) if text else {}
    if is_imbalanced([w.in_flight for w in pool], policy):
        best = min(pool, key=lambda w: (w.in_flight, w.url))
        return Choice(best.url, "balance", matched.get(best.url, 0))
    held = [w for w in pool if matched.get(w.url, 0) > 0]
    if held:
        best = min(held, key=lambda w: (-matched[w.url], w.in_flight, w.url))
        share = matched[best.url] / len(text)
        if share >= policy.cache_threshold:
            return Choice(best.url, f"cache {share:.2f}", matched[best.url])
    best = min(pool, key=lambda w: (tree.size(w.url), w.in_flight, w.url))
    return Choice(best.url, "smallest tree", matched.get(best.url, 0))


def choose_decode(workers: list[WorkerState], blocks_needed: int) -> Choice | None:
    """The decode worker for a request needing `blocks_needed` KV blocks; None when none fits.

    A worker that has not reported its free blocks is assumed to have room (its own
    admission refuses an import it cannot hold); among equally loaded workers one with a
    reported count ranks before one without, the larger count first.
    """
    if blocks_needed < 0:
        raise ValueError(f"blocks_needed must be >= 0, got {blocks_needed}")
    pool = [w for w in workers if w.healthy and w.role == "decode"
            and (w.free_kv_blocks is None or w.free_kv_blocks >= blocks_needed)]
    if not pool:
        return None
    best = min(pool, key=lambda w: (w.in_flight, w.free_kv_blocks is None,
                                    -(w.free_kv_blocks or 0), w.url))
    free = "?" if best.free_kv_blocks is None else str(best.free_kv_blocks)
    return Choice(best.url, f"load {best.in_flight} free {free}")


def prefill_locally(prefill: WorkerState | None, prompt_tokens: int,
                    policy: LocalPrefillPolicy) -> bool:
    """Whether the decode worker should compute this prompt itself rather than `prefill`
    (the chosen prefill worker; None when none is up).

    Only prompts of at most `policy.max_tokens` tokens. With `min_queue_s` > 0, only while
    the prefill worker's queue takes at least that long at its measured rate (unmeasured:
    stay remote); a short prompt then waits one decode step instead of the queue.
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if policy.max_tokens == 0 or prompt_tokens > policy.max_tokens:
        return False
    if prefill is None or policy.min_queue_s == 0:
        return True
    queue_s = prefill.prefill_s(Work())
    return queue_s is not None and queue_s >= policy.min_queue_s
