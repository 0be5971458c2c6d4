"""Iteration-level scheduler: which requests run this step, and how many tokens each.

Each step fills a token budget: running requests first (a decode needs 1 token, a
request mid-prefill needs the rest of its prompt), oldest first, then waiting requests
in arrival order. A request whose remaining tokens exceed the budget gets a chunk:
chunked prefill is nothing but the budget running out (optionally a smaller budget for
prompt tokens in steps that also decode, `max_prefill_tokens_with_decodes`). When the
block pool cannot grow a running request, the newest running request is preempted by
recompute (its blocks freed, its progress reset, put back at the head of the queue)
until the request fits or is itself the one preempted. Waiting requests are admitted
only if their blocks fit, so a step never starts what it cannot hold; a request that
cannot fit even in an empty pool is rejected at `add_request`. A request that arrives
with its prompt's tail KV (runtime/kv_tail.py) is admitted with those positions
computed when its prefix-cache hit ends where the tail starts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .kv_tail import KVTail
from .request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_tokens: int  # positions start .. start + num_tokens - 1 (drafts included)
    block_tables: tuple[tuple[int, ...], ...]  # per KV group (BlockManager.block_tables)
    draft_token_ids: tuple[int, ...] = ()  # speculative tokens after the last known one

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the last known token, so the step samples a new one."""
        return self.end - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # requests admitted with their prompt's tail KV computed elsewhere: the engine writes
    # it into their blocks before running the step (runtime/kv_tail.py)
    kv_tails: list[tuple[Request, KVTail]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class SchedulerConfig:
    def __init__(self, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True,
                 max_prefill_tokens_with_decodes: int | None = None) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1.")
        if max_prefill_tokens_with_decodes is not None and max_prefill_tokens_with_decodes < 1:
            raise ValueError("max_prefill_tokens_with_decodes must be >= 1 (or None: the "
                             "step budget).")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching  # False: every prompt computed
        # prompt tokens in a step that also decodes (None: the whole budget): a small
        # value keeps inter-token gaps even while long prompts arrive; steps without
        # decodes still prefill with the whole budget
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig | None = None) -> None:
        self.blocks = blocks
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: newest last
        self.num_preemptions = 0
        self.tokens_cached = 0  # prompt tokens whose KV came from the prefix cache
        self.tokens_imported = 0  # prompt tokens whose KV came with the request (KV tails)
        self.held: dict[str, Request] = {}  # finished with hold_kv: blocks kept until release

    # -- queue ------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError if it could never fit in the KV pool."""
        self.check_fits(req)
        self.waiting.append(req)

    def blocks_needed(self, num_tokens: int) -> int:
        """The most KV blocks a request of num_tokens (prompt + max_tokens) holds at once."""
        return self.blocks.max_blocks_held(num_tokens, self.config.max_num_batched_tokens)

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens (prompt + max_tokens) can ever fit the pool."""
        return self.blocks_needed(num_tokens) <= self.blocks.num_blocks

    def check_fits(self, req: Request) -> None:
        """Raise ValueError if the request could never fit in the KV pool. Read-only."""
        need = self.blocks_needed(req.num_prompt_tokens + req.params.max_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs {need} KV blocks for its prompt and "
                f"max_tokens, the cache has {self.blocks.num_blocks}; lower max_tokens or "
                "raise the KV cache size.")

    def adopt_running(self, req: Request) -> None:
        """Mutates: run a request whose blocks were given to it directly (a sample forked
        from another's prompt, BlockManager.fork) as the newest running one."""
        req.status = RequestStatus.RUNNING
        if req.scheduled_at is None:
            req.scheduled_at = time.monotonic()
        self.running.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is (held blocks included); free its blocks.
        Returns it, or None."""
        if request_id in self.held:
            return self.release(request_id)
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED_ABORTED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                return req
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mutates: mark a running request finished and free its blocks (a request with
        hold_kv that was not aborted keeps them, in `held`, until `release`)."""
        self.running.remove(req)
        if req.hold_kv and status != RequestStatus.FINISHED_ABORTED:
            self.held[req.request_id] = req
        else:
            self.blocks.free(req.request_id)
        req.status = status

    def release(self, request_id: str) -> Request | None:
        """Mutates: free a finished request's held blocks. Returns it, or None."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.blocks.free(request_id)
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------
    def _preempt_newest(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        self.blocks.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        out.preempted.append(victim)
        return victim

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Mutates: pick this step's work, allocating KV slots for it. `drafts` (request id
        -> speculative tokens) extend decoding requests' chunks as far as the budget and
        the free blocks allow; drafts that do not fit are cut, never preempting for them."""
        drafts = drafts or {}
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prefill_budget = budget  # prompt tokens, this step
        cap = self.config.max_prefill_tokens_with_decodes
        if cap is not None and any(r.num_tokens - r.num_computed_tokens == 1
                                   for r in self.running):
            prefill_budget = min(budget, cap)
        i = 0
        while i < len(self.running) and budget > 0:  # running requests, oldest first
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens  # 1: decoding
            n = min(remaining, budget)
            if remaining > 1:  # mid-prefill
                n = min(n, prefill_budget)
                if n == 0:  # this step's prompt tokens are spent: decodes only
                    i += 1
                    continue
                prefill_budget -= n
            draft = (tuple(drafts.get(req.request_id, ())[:budget - 1]) if remaining == 1
                     else ())
            table = self.blocks.append_slots(req.request_id, req.all_token_ids,
                                             n + len(draft), req.num_computed_tokens)
            if table is None and draft:
                draft = ()
                table = self.blocks.append_slots(req.request_id, req.all_token_ids, n,
                                                 req.num_computed_tokens)
            while table is None:
                victim = self._preempt_newest(out)
                if victim is req:
                    break
                table = self.blocks.append_slots(req.request_id, req.all_token_ids, n,
                                                 req.num_computed_tokens)
            if table is None:  # req itself was preempted; it was the newest
                break
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n + len(draft),
                                             self.blocks.block_tables(req.request_id), draft))
            budget -= n + len(draft)
            i += 1
        if out.preempted:  # no admissions in a step that had to preempt
            return out
        while (self.waiting and min(budget, prefill_budget) > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            # prompt logprobs need logits for every prompt token: no prefix reuse
            use_cache = (self.config.enable_prefix_caching
                         and req.params.prompt_logprobs is None)
            cached = self.blocks.probe_prefix(req.all_token_ids) if use_cache else 0
            tail = req.kv_tail if use_cache and req.kv_tail is not None else None
            pre = tail.num_tokens if tail is not None and cached == tail.start else 0
            n = min(req.num_tokens - cached - pre, budget, prefill_budget)
            alloc = self.blocks.allocate(req.request_id, req.all_token_ids, cached + pre + n,
                                         use_cache)
            if alloc is None:
                break  # FCFS: do not let later requests overtake the head of the queue
            self.waiting.popleft()
            req.kv_tail = None  # used now or never (a recompute computes everything)
            if alloc.num_cached_tokens != cached:  # the probe is exact; guard anyway
                pre = 0
            req.num_computed_tokens = alloc.num_cached_tokens + pre
            self.tokens_cached += alloc.num_cached_tokens
            self.tokens_imported += pre
            if pre:
                out.kv_tails.append((req, tail))
            if req.num_preemptions == 0:
                req.num_cached_tokens = alloc.num_cached_tokens + pre
            n = min(req.num_tokens - req.num_computed_tokens, budget, prefill_budget)
            if req.scheduled_at is None:
                req.scheduled_at = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n,
                                             self.blocks.block_tables(req.request_id)))
            budget -= n
            prefill_budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput) -> None:
        """Mutates: advance each scheduled request past the tokens just computed (drafts
        not included: the engine adds the accepted ones)."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens = chunk.end - len(chunk.draft_token_ids)
