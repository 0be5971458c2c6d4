"""KV block manager: physical block ids for requests' logical blocks, with prefix caching.

The KV pool is `num_blocks` fixed-size blocks of `block_size` token slots. Each request
owns a block table (logical block i -> physical block id); token position p lives in
slot `block_table[p // block_size] * block_size + p % block_size`.

Prefix caching. A FULL block is content-addressed by a hash chained over (parent block
hash, the block's token ids, the namespace) -- the namespace (e.g. the artifact digest)
keeps caches of different models apart. A hash hit is never trusted alone: the stored
token ids must equal the request's, and the stored block's parent must be the very
physical block (same id, same allocation generation) that the lookup matched just
before. So a cached block is reused only when the whole token prefix is identical, even
if the hash function collides.

Lifetime of a block:
    free (uncached) -> allocated (ref >= 1) -> [registered in the cache when full]
    ref drops to 0: cached -> evictable (still hittable), uncached -> free
    a fresh block is taken from the free blocks first; only when none is left is the
    least recently freed evictable block evicted (its cache entry dropped).
A request's blocks are released last-to-first, so a chain's tail is evicted before its
head (a child is useless without its parent).

Registration timing: blocks are registered when the call that covers their last token
is made (`allocate` / `append_slots`), i.e. when the step that computes them is
scheduled, as in vLLM v1. A request scheduled in the same step may hit them; the model
runner must therefore write the KV of all tokens of a step before attention reads it
(store-then-attend within each layer). `token_ids` passed here must hold only committed
tokens (never speculative drafts): slots for drafts are covered with `num_new_tokens`.

KV groups (runtime/kv_groups.py). Layers of different attention windows keep block tables
of their own, all drawn from this one pool: a request holds one table per group, all of
the same length, and its prefix hit is the shortest of its groups' hits (each group hashes
under its own namespace). A sliding group gives back, at each `allocate`/`append_slots`,
the blocks that lie wholly before the window of the first position the step computes:
no later step reads them. Their table entries then read `RELEASED` (a valid block id
the attention kernels never use: those positions are outside every query's window).
With one group (every layer attends to the whole context) nothing is given back early.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], namespace: str) -> bytes:
    """Content hash of one full block, chained over its parent's hash (None for block 0)."""
    h = hashlib.sha256()
    h.update(namespace.encode("utf-8"))
    h.update(b"\x00")
    h.update(parent_hash if parent_hash is not None else b"<root>")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


RELEASED = 0  # table entry of a block a sliding group gave back (never read: out of window)


class Allocation(NamedTuple):
    """Result of `BlockManager.allocate`. The ids belong to the request until `free`."""

    block_table: list[int]  # group 0's physical block ids, logical order (a copy)
    num_cached_tokens: int  # leading tokens whose KV is already in the cache


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    generation: int = 0  # bumped each time the block is handed out fresh
    hash: bytes | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # the tokens it was registered with
    parent: tuple[int, int] | None = None  # (block id, generation) of the parent block


@dataclass
class _GroupBlocks:
    """One request's blocks in one KV group."""

    table: list[int] = field(default_factory=list)  # physical ids; [:released] are RELEASED
    hashes: list[bytes] = field(default_factory=list)  # one per full block so far
    # (block id, generation) of block i while it is the cached block of hashes[i], else None
    links: list[tuple[int, int] | None] = field(default_factory=list)
    released: int = 0  # leading blocks given back (behind the window)


@dataclass
class _RequestBlocks:
    groups: list[_GroupBlocks]
    num_slots: int = 0  # token slots covered

    @property
    def num_blocks(self) -> int:  # per group: every group's table has this length
        return len(self.groups[0].table)


class BlockManager:
    """Allocates KV blocks to requests, with reference counts and a prefix cache.

    Not thread-safe: call it from the engine loop only.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, namespace: str,
                 windows: tuple[int | None, ...] = (None,)):
        """windows: per KV group, its layers' attention window (None: full attention),
        e.g. KVCache.groups.windows."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace must be a non-empty string, e.g. the artifact digest.")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows needs one entry per KV group, each None or >= 1, "
                             f"got {windows!r}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.windows = tuple(windows)
        # group 0 hashes under the namespace itself; others under their own
        self._namespaces = [namespace] + [f"{namespace}#kv-group-{g}"
                                          for g in range(1, len(self.windows))]
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # uncached, ref 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._cache: dict[bytes, int] = {}  # block hash -> block id
        self._requests: dict[str, _RequestBlocks] = {}
        self._queried_tokens = 0
        self._hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take (free + evictable cached). Read-only."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]. Read-only."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (referenced or not)."""
        return len(self._cache)

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens served from cache / prompt tokens asked for, over all `allocate` calls."""
        return self._hit_tokens / self._queried_tokens if self._queried_tokens else 0.0

    @property
    def prefix_stats(self) -> tuple[int, int]:
        """(hit tokens, queried tokens) over all successful `allocate` calls."""
        return self._hit_tokens, self._queried_tokens

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's group-0 block table. Read-only."""
        return list(self._get(request_id).groups[0].table)

    def block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table in every group. Read-only."""
        return tuple(tuple(g.table) for g in self._get(request_id).groups)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references over all groups (released ones not counted)."""
        return sum(len(g.table) - g.released for g in self._get(request_id).groups)

    def num_slots(self, request_id: str) -> int:
        """Token slots covered for the request. Read-only."""
        return self._get(request_id).num_slots

    def ref_count(self, block_id: int) -> int:
        """Reference count of a physical block (for tests and debugging). Read-only."""
        return self._blocks[block_id].ref_count

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks one group's table needs to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """Most blocks, over all groups, a request of `num_tokens` slots holds at once when
        a step computes at most `step_tokens` of them."""
        full = self.blocks_needed(num_tokens)
        total = 0
        for w in self.windows:
            # a sliding group holds the window before a step's first position + the step
            total += full if w is None else min(full, self.blocks_needed(w + step_tokens) + 1)
        return total

    def probe_prefix(self, token_ids: Sequence[int]) -> int:
        """Number of leading tokens of `token_ids` an `allocate` would serve from cache.

        Read-only (does not touch LRU order or stats). The answer is exact for an
        `allocate` made before any other mutating call; afterwards evictions may lower it.
        At most len(token_ids) - 1 rounded down to a block boundary: the last prompt
        token is always computed, to produce the logits for the first output token.
        """
        return min(len(self._match_prefix(token_ids, g)[0])
                   for g in range(self.num_groups)) * self.block_size

    def block_hashes(self, token_ids: Sequence[int]) -> tuple[tuple[bytes, ...], ...]:
        """Per KV group, the chained hash of each full block of `token_ids` under this
        manager's namespaces (what `allocate` registers them as). Read-only."""
        bs = self.block_size
        out = []
        for namespace in self._namespaces:
            hashes: list[bytes] = []
            for i in range(len(token_ids) // bs):
                parent = hashes[-1] if hashes else None
                hashes.append(hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs],
                                                namespace))
            out.append(tuple(hashes))
        return tuple(out)

    def cached_prefix_blocks(self, token_ids: Sequence[int]
                             ) -> tuple[tuple[tuple[int, bytes], ...], ...]:
        """Per KV group, (block id, hash) of each leading full block of `token_ids` whose
        KV is in the prefix cache, verified as `allocate` verifies a hit (stored tokens and
        parent link). Unlike `probe_prefix`, the last full block counts too (no token is
        kept back to compute). Groups may report runs of different lengths.

        Read-only: no reference count, LRU order or stat changes. The ids stay valid only
        until the next mutating call (a cached block with no reference may be evicted)."""
        # one token past the full blocks lifts _match_prefix's cap (it keeps the last
        # token to compute); that token is never hashed
        padded = list(token_ids[:len(token_ids) // self.block_size * self.block_size]) + [0]
        out = []
        for g in range(self.num_groups):
            hits, hashes = self._match_prefix(padded, g)
            out.append(tuple((b.block_id, h) for b, h in zip(hits, hashes)))
        return tuple(out)

    def slot_mapping(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        """KV slot of each token position in [start, end): block_id * block_size + offset."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}.")
        if end > len(block_table) * self.block_size:
            raise ValueError(f"positions up to {end} need {self.blocks_needed(end)} blocks, "
                             f"the block table has {len(block_table)}.")
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------------ mutations
    def allocate(self, request_id: str, token_ids: Sequence[int],
                 num_tokens_to_cover: int, use_cache: bool = True,
                 register: bool = True) -> Allocation | None:
        """Give a new request blocks for its first `num_tokens_to_cover` token slots.

        Mutates state. Leading full blocks found in the prefix cache are shared (their
        reference counts go up) and reported as `num_cached_tokens`; the table covers
        max(num_tokens_to_cover, num_cached_tokens) slots. Full blocks among the covered,
        known tokens are registered in the cache. Returns None, with nothing changed
        (stats included), when there are not enough free blocks. A scheduler with a token
        budget calls `probe_prefix` first, then covers probe + chunk tokens.
        `use_cache=False` computes every token (e.g. when the prompt's own logprobs are
        wanted) but still registers the new full blocks for later requests.
        `register=False` leaves the new blocks out of the prefix cache until
        `register(request_id, token_ids)`, so that no request can hit them before their
        contents are written (an import written off the engine's thread).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has blocks; use append_slots "
                             f"to grow it, or free it first.")
        if num_tokens_to_cover < 0:
            raise ValueError(f"num_tokens_to_cover must be >= 0, got {num_tokens_to_cover}.")
        matches = [self._match_prefix(token_ids, g) for g in range(self.num_groups)]
        num_hits = min(len(hits) for hits, _ in matches) if use_cache else 0
        num_cached_tokens = num_hits * self.block_size
        num_slots = max(num_tokens_to_cover, num_cached_tokens)
        num_fresh = (self.blocks_needed(num_slots) - num_hits) * self.num_groups
        # hits with ref 0 leave the evictable pool, so they count against free blocks too
        num_revived = sum(1 for hits, _ in matches for b in hits[:num_hits] if b.ref_count == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return None
        req = _RequestBlocks([], num_slots)
        for hits, hashes in matches:
            hits = hits[:num_hits]
            for block in hits:
                self._take(block)
            group = _GroupBlocks([b.block_id for b in hits], hashes[:num_hits],
                                 [(b.block_id, b.generation) for b in hits])
            group.table.extend(self._fresh_block()
                               for _ in range(self.blocks_needed(num_slots) - num_hits))
            req.groups.append(group)
        self._requests[request_id] = req
        if register:
            self._register_full_blocks(req, token_ids)
        self._release_behind_windows(req, num_cached_tokens)
        self._queried_tokens += len(token_ids)
        self._hit_tokens += num_cached_tokens
        return Allocation(list(req.groups[0].table), num_cached_tokens)

    def append_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                     num_computed_tokens: int | None = None) -> list[int] | None:
        """Grow a request to cover `num_computed_tokens + num_new_tokens` slots.

        Mutates state. `token_ids` are all committed tokens of the request (prompt and
        outputs); `num_computed_tokens` defaults to the slots covered so far, so a plain
        decode step is `append_slots(rid, ids, 1)`. Pass it explicitly when the covered
        slots ran ahead (rejected speculative tokens). Never shrinks. Blocks that became
        full with known tokens are registered in the prefix cache; sliding groups give
        back blocks behind the window of position `num_computed_tokens`. Returns the new
        group-0 block table (a copy), or None with nothing changed when there are not
        enough free blocks.
        """
        req = self._get(request_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}.")
        base = req.num_slots if num_computed_tokens is None else num_computed_tokens
        if base < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {base}.")
        target = max(req.num_slots, base + num_new_tokens)
        num_fresh = self.blocks_needed(target) - req.num_blocks
        # blocks behind the windows of `base` count as free: they are given back before the
        # fresh ones are taken (what max_blocks_held assumes; without it a request that fits
        # alone preempted itself forever once its sliding groups filled the pool)
        if num_fresh * self.num_groups > self.num_free_blocks + self._releasable(req, base):
            return None
        self._register_full_blocks(req, token_ids)  # every block behind `base` is full, known
        self._release_behind_windows(req, base)
        for group in req.groups:
            group.table.extend(self._fresh_block() for _ in range(num_fresh))
        req.num_slots = target
        self._register_full_blocks(req, token_ids)
        return list(req.groups[0].table)

    def register(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Register a request's full blocks of `token_ids` in the prefix cache (those an
        `allocate(..., register=False)` left out; a no-op for blocks registered before).
        Mutates state."""
        self._register_full_blocks(self._get(request_id), token_ids)

    def fork(self, parent_id: str, child_id: str) -> list[tuple[int, int]] | None:
        """Give `child_id` the parent's blocks as they are now (n > 1 samples of one
        prompt): full blocks are shared (reference counts go up, hashes and cache links are
        copied, so the child's later blocks chain on), blocks a sliding group released stay
        released, and a partly filled last block is given as a fresh copy (copy-on-write:
        both will write into it). Mutates state. Returns the (source, destination) block
        pairs whose contents the caller copies (KVCache.copy_blocks), or None with nothing
        changed when there are not enough free blocks for the copies."""
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already has blocks.")
        full = parent.num_slots // self.block_size
        partial = parent.num_blocks > full
        if partial and self.num_groups > self.num_free_blocks:
            return None
        child = _RequestBlocks([], parent.num_slots)
        copies = []
        for g in parent.groups:
            table = list(g.table[:full])
            for block_id in table[g.released:]:
                self._blocks[block_id].ref_count += 1  # held by the parent: ref >= 1 already
            if partial:
                fresh = self._fresh_block()
                copies.append((g.table[full], fresh))
                table.append(fresh)
            child.groups.append(_GroupBlocks(table, list(g.hashes[:full]),
                                             list(g.links[:full]), min(g.released, len(table))))
        self._requests[child_id] = child
        return copies

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink a request to cover `num_tokens` slots (rejected speculative tokens),
        freeing trailing blocks it no longer needs. Mutates state; returns the number of
        blocks freed (over all groups). Only blocks past the committed tokens go, and those
        were never registered in the prefix cache (registration needs committed, known
        tokens)."""
        req = self._get(request_id)
        low = len(req.groups[0].hashes) * self.block_size  # full blocks of committed tokens
        if not low <= num_tokens <= req.num_slots:
            raise ValueError(f"can trim request {request_id!r} to [{low}, {req.num_slots}] "
                             f"slots, not {num_tokens}.")
        keep = self.blocks_needed(num_tokens)
        freed = 0
        for group in req.groups:
            dropped = group.table[max(keep, group.released):]
            del group.table[keep:]
            group.released = min(group.released, keep)
            for block_id in reversed(dropped):
                self._release(block_id)
            freed += len(dropped)
        req.num_slots = num_tokens
        return freed

    def free(self, request_id: str) -> None:
        """Release a request's blocks (finished, aborted or preempted). Mutates state.

        Reference counts drop; a block reaching 0 becomes evictable if cached, else free.
        Blocks are released last-to-first so the tail of a chain is evicted first.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"request {request_id!r} has no blocks to free.")
        for group in req.groups:
            for block_id in reversed(group.table[group.released:]):
                self._release(block_id)

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached block. Mutates state. Returns False (and does
        nothing) while a request holds blocks, since their entries cannot be dropped."""
        if self._requests:
            return False
        for block_id in list(self._evictable):
            self._uncache(self._blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        return True

    # ------------------------------------------------------------------ internals
    def _get(self, request_id: str) -> _RequestBlocks:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}: allocate it first.")
        return req

    def _match_prefix(self, token_ids: Sequence[int], group: int
                      ) -> tuple[list[_Block], list[bytes]]:
        """Longest verified run of cached leading blocks of one group, capped so a token is
        left to compute. Read-only."""
        bs, namespace = self.block_size, self._namespaces[group]
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        hits: list[_Block] = []
        hashes: list[bytes] = []
        parent_hash: bytes | None = None
        parent_link: tuple[int, int] | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block_tokens(parent_hash, tokens, namespace)
            block_id = self._cache.get(h)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.token_ids != tokens or block.parent != parent_link:
                break  # hash collision (or a stale chain): not the same prefix
            hits.append(block)
            hashes.append(h)
            parent_hash, parent_link = h, (block.block_id, block.generation)
        return hits, hashes

    def _take(self, block: _Block) -> None:
        """Add a reference to a cached block, reviving it from the evictable pool."""
        if block.ref_count == 0:
            del self._evictable[block.block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        """Drop a reference; at 0 the block becomes evictable if cached, else free."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _fresh_block(self) -> int:
        """An unreferenced block with no cache entry; evicts the LRU cached one if needed.
        Callers check `num_free_blocks` first."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self._blocks[block_id])
        block = self._blocks[block_id]
        block.ref_count = 1
        block.generation += 1
        return block_id

    def _uncache(self, block: _Block) -> None:
        if block.hash is not None and self._cache.get(block.hash) == block.block_id:
            del self._cache[block.hash]
        block.hash = block.token_ids = block.parent = None

    def _behind_window(self, group: "_GroupBlocks", window: int | None,
                       first_position: int) -> range:
        """Table indices of `group`'s blocks, not yet given back, that lie wholly before
        the window of `first_position` (none for a group without a window)."""
        if window is None:
            return range(0)
        behind = max(0, first_position - window + 1) // self.block_size
        return range(group.released, min(behind, len(group.table)))

    def _releasable(self, req: _RequestBlocks, first_position: int) -> int:
        """Blocks _release_behind_windows(req, first_position) would make free (those no
        other request holds). Read-only."""
        return sum(self._blocks[group.table[i]].ref_count == 1
                   for group, window in zip(req.groups, self.windows)
                   for i in self._behind_window(group, window, first_position))

    def _release_behind_windows(self, req: _RequestBlocks, first_position: int) -> None:
        """Give back each sliding group's blocks that lie wholly before the window of
        `first_position` (the first position the step computes): key j is visible to
        query p iff p - j < window, so blocks ending before first_position - window + 1
        are never read again."""
        for group, window in zip(req.groups, self.windows):
            behind = self._behind_window(group, window, first_position)
            for i in behind:
                self._release(group.table[i])
                group.table[i] = RELEASED
            group.released = max(group.released, behind.stop)

    def _register_full_blocks(self, req: _RequestBlocks, token_ids: Sequence[int]) -> None:
        """Hash the request's newly full, known blocks in every group and register each
        one whose hash is free and whose parent is registered (the first block with given
        content stays the cached one; a block under an uncached parent could never be
        reached)."""
        bs = self.block_size
        num_full = min(req.num_slots, len(token_ids)) // bs
        for group, namespace in zip(req.groups, self._namespaces):
            for i in range(len(group.hashes), num_full):
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                parent_hash = group.hashes[i - 1] if i > 0 else None
                h = hash_block_tokens(parent_hash, tokens, namespace)
                group.hashes.append(h)
                block = self._blocks[group.table[i]]  # full blocks are never released yet
                parent_link = group.links[i - 1] if i > 0 else None
                if block.hash is None and h not in self._cache and (i == 0 or parent_link):
                    block.hash, block.token_ids, block.parent = h, tokens, parent_link
                    self._cache[h] = block.block_id
                registered = block.hash == h
                group.links.append((block.block_id, block.generation) if registered else None)
