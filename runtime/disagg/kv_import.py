"""Import (decode side): place a KVTransfer's blocks in an engine's prefix cache.

After `import_prefix`, a request whose prompt starts with the transfer's tokens is served
those blocks from the prefix cache, exactly as if this engine had computed them: the
blocks are allocated under a temporary request id through `BlockManager.allocate` (which
registers their chained hashes), the transferred K/V bytes are written into them for
every layer, and the temporary request is freed, so they stay cached with no reference
(evictable, least recently used last) until a request takes them.

Call it on the engine's own thread, between steps (the block manager is not thread-safe;
a step in flight may read or evict blocks). The placement counts as one `allocate` in
the block manager's prefix stats.

A server splits it so that the copy, the only part that grows with the prompt, runs off
the engine's thread while the engine steps, through the engine's own methods (its
`kv_imports` is a `StagedImports`):

    plan = engine.reserve_kv_import(transfer)  # engine thread: checked, blocks reserved
    engine.write_kv_import(plan)               # any thread: the K/V bytes
    engine.commit_kv_import(plan)              # engine thread: into the prefix cache
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import torch

from .kv_transfer import KVLayout, KVTransfer, KVTransferMismatch


class NotEnoughKVBlocks(RuntimeError):
    """The engine has too few free blocks to place a transfer; nothing was changed."""


@dataclass(frozen=True)
class ImportResult:
    num_blocks: int  # full blocks in the transfer (each KV group)
    num_skipped: int  # of them already cached here: shared, not written
    num_written: int  # blocks written from the transfer (each KV group)
    num_cached_tokens: int  # leading transfer tokens now in the prefix cache (every group)


def check_transfer(engine, transfer: KVTransfer) -> None:
    """Raise KVTransferMismatch unless `engine` may use `transfer`'s blocks: same namespace,
    same KV layout, same FP8 scales, and block hashes that follow from its tokens under
    this engine's namespace. Changes nothing."""
    blocks, cache = engine.blocks, engine.kv_cache
    if transfer.namespace != blocks.namespace:
        raise KVTransferMismatch(
            f"the transfer's KV belongs to namespace {transfer.namespace!r}, this engine's "
            f"is {blocks.namespace!r} (another artifact, weight dtype or KV dtype): send it to "
            f"an engine serving the same artifact with the same dtypes.")
    diff = KVLayout.of(cache).differences(transfer.layout)
    if diff:
        raise KVTransferMismatch(f"the transfer's KV layout differs from this engine's "
                                 f"(this engine vs transfer): {'; '.join(diff)}. Start both "
                                 f"engines with the same block size and KV dtype.")
    if transfer.layout.kv_dtype == "fp8":
        bad = [i for i, kv in enumerate(cache.layers)
               if not (torch.equal(kv.k_scale.cpu(), transfer.k_scales[i])
                       and torch.equal(kv.v_scale.cpu(), transfer.v_scales[i]))]
        if bad:
            raise KVTransferMismatch(f"the transfer's FP8 KV was quantized with other k/v "
                                     f"scales than this engine's at layers {bad}: both "
                                     f"engines must serve the same calibrated artifact.")
    mine = blocks.block_hashes(transfer.token_ids)
    for g, (expected, got) in enumerate(zip(mine, transfer.block_hashes)):
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                raise KVTransferMismatch(
                    f"block {i} of KV group {g}: the transferred hash {b.hex()[:16]}... is not "
                    f"the hash of its tokens here ({a.hex()[:16]}...): tokens or hashes were "
                    f"altered, or the sender chains hashes differently. Refused.")


def import_prefix(engine, transfer: KVTransfer) -> ImportResult:
    """Place `transfer`'s blocks in `engine`'s prefix cache (see the module docstring).

    Raises KVTransferMismatch (see `check_transfer`), ValueError when the engine has
    prefix caching off (nothing could hit the blocks), or NotEnoughKVBlocks when too few
    blocks are free; in each case nothing is changed. Blocks already cached here are
    shared, not written."""
    check_transfer(engine, transfer)
    plan = reserve_import(engine, transfer)
    write_import(engine.kv_cache, plan)
    return commit_import(engine, plan)


@dataclass(frozen=True)
class ImportPlan:
    """Blocks reserved for a transfer (`reserve_import`): held under a temporary request
    id, so nothing evicts or reuses them, and kept out of the prefix cache, so no request
    reads them before `write_import` has filled them and `commit_import` registers them."""

    request_id: str  # the temporary holder in the block manager
    transfer: KVTransfer
    hits: int  # leading full blocks already cached here: shared, not written
    dst: tuple[tuple[int, ...], ...]  # per KV group: block ids for logical blocks hits..n-1

    @property
    def num_written(self) -> int:
        return self.transfer.num_blocks - self.hits


def reserve_import(engine, transfer: KVTransfer) -> ImportPlan:
    """Engine thread, between steps: take blocks for the transfer's full blocks (the
    cached ones shared) without registering the new ones. Raises ValueError (prefix
    caching off) or NotEnoughKVBlocks with nothing changed. Every plan ends in
    `commit_import` or `cancel_import`. The transfer must have passed `check_transfer`."""
    if not engine.config.enable_prefix_caching:
        raise ValueError("this engine has prefix caching off, so no request could use "
                         "imported KV blocks: enable prefix caching on the decode engine.")
    blocks = engine.blocks
    n, bs = transfer.num_blocks, transfer.layout.block_size
    rid = f"kv-import-{uuid.uuid4().hex}"
    # one token past the full blocks, never hashed, lets all n blocks hit the cache
    # (allocate keeps a prompt's last token to compute)
    alloc = blocks.allocate(rid, list(transfer.token_ids) + [0], n * bs, register=False)
    if alloc is None:
        raise NotEnoughKVBlocks(
            f"placing {n} KV blocks in each of {blocks.num_groups} KV groups needs more than "
            f"the {blocks.num_free_blocks} free blocks: retry when requests have finished, "
            f"or give the decode engine more KV blocks.")
    hits = alloc.num_cached_tokens // bs
    return ImportPlan(rid, transfer, hits,
                      tuple(tuple(t[hits:n]) for t in blocks.block_tables(rid)))


def write_import(kv_cache, plan: ImportPlan) -> None:
    """Any thread, also while the engine steps: copy the transfer's uncached blocks into
    the plan's blocks, every layer, bit-exact. Touches only those blocks, which no
    request reads until `commit_import`."""
    transfer, hits = plan.transfer, plan.hits
    if not plan.num_written:
        return
    for layer, kv in enumerate(kv_cache.layers):
        dst = torch.tensor(plan.dst[transfer.layout.layer_group[layer]], dtype=torch.long,
                           device=kv.k_pool.device)  # [n - hits]
        # [n - hits, block_size, Hkv, D] each
        kv.write(dst, transfer.k[layer][hits:], transfer.v[layer][hits:])


def commit_import(engine, plan: ImportPlan) -> ImportResult:
    """Engine thread, after `write_import`: register the written blocks in the prefix
    cache and let go of them (cached, unreferenced: the next request with this prefix
    takes them)."""
    blocks, transfer = engine.blocks, plan.transfer
    tokens = list(transfer.token_ids)
    blocks.register(plan.request_id, tokens)
    blocks.free(plan.request_id)
    n, bs = transfer.num_blocks, transfer.layout.block_size
    cached = min(len(g) for g in blocks.cached_prefix_blocks(tokens))
    return ImportResult(n, plan.hits, plan.num_written, cached * bs)


def cancel_import(engine, plan: ImportPlan) -> bool:
    """Engine thread: give a plan's blocks back unregistered (its request will not come).
    Idempotent; True if it still held blocks."""
    if not engine.blocks.has_request(plan.request_id):
        return False
    engine.blocks.free(plan.request_id)
    return True


class StagedImports:
    """The plans reserved and not yet committed or cancelled. A plan whose request never
    reaches the engine (refused at admission, its task cancelled before it started) would
    hold its blocks for good, so every `reserve` and `commit` first cancels the plans
    older than `ttl_s`. Engine thread only, like the block manager."""

    def __init__(self, ttl_s: float = 120.0, clock=time.monotonic) -> None:
        self.ttl_s, self._clock = ttl_s, clock
        self._plans: dict[str, tuple[ImportPlan, float]] = {}  # request id -> (plan, when)

    def __len__(self) -> int:
        return len(self._plans)

    def reserve(self, engine, transfer: KVTransfer) -> ImportPlan:
        self.expire(engine)
        plan = reserve_import(engine, transfer)
        self._plans[plan.request_id] = (plan, self._clock())
        return plan

    def commit(self, engine, plan: ImportPlan) -> ImportResult:
        """`commit_import`; ValueError for a plan that expired or was cancelled (its
        blocks are gone: the request computes its prompt instead). A plan's copy must end
        well within ttl_s (it takes milliseconds), or its blocks could be given back under
        it."""
        self.expire(engine)
        if self._plans.pop(plan.request_id, None) is None:
            raise ValueError(f"KV import {plan.request_id} was given back before its "
                             f"request came (older than {self.ttl_s:g} s, or cancelled).")
        return commit_import(engine, plan)

    def cancel(self, engine, plan: ImportPlan) -> bool:
        self._plans.pop(plan.request_id, None)
        return cancel_import(engine, plan)

    def expire(self, engine) -> int:
        """Cancel the plans older than ttl_s; returns how many."""
        old = self._clock() - self.ttl_s
        stale = [plan for plan, when in self._plans.values() if when < old]
        for plan in stale:
            self.cancel(engine, plan)
        return len(stale)
