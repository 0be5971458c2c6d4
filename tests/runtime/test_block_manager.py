"""KV block manager: exact block ids, ref counts, eviction order, collision safety."""

import pytest

from qserve.runtime import block_manager as bm_module
from qserve.runtime.block_manager import Allocation, BlockManager, hash_block_tokens

BS = 4  # small blocks keep the token lists readable


def make(num_blocks: int) -> BlockManager:
    return BlockManager(num_blocks, BS, namespace="artifact-sha")


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def state(bm: BlockManager):
    """Everything observable, to check that a failed call changed nothing."""
    return (bm.num_free_blocks, bm.num_cached_blocks, bm.prefix_stats,
            [bm.ref_count(i) for i in range(bm.num_blocks)],
            list(bm._free), list(bm._evictable), dict(bm._cache))


def test_fresh_allocation_and_slot_mapping():
    bm = make(10)
    alloc = bm.allocate("a", toks(100, 10), 10)
    assert alloc == Allocation([0, 1, 2], 0)
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_cached_blocks == 2  # two full blocks; the third holds 2 of 4 tokens
    assert bm.slot_mapping(alloc.block_table, 0, 10) == list(range(10))
    assert bm.slot_mapping([3, 7], 2, 6) == [14, 15, 28, 29]
    assert bm.slot_mapping([3, 7], 5, 5) == []
    with pytest.raises(ValueError, match="need 3 blocks"):
        bm.slot_mapping([3, 7], 0, 9)


def test_shared_prefix_is_reused_with_ref_counts():
    bm = make(10)
    prompt = toks(100, 10)
    assert bm.allocate("a", prompt, 10) == Allocation([0, 1, 2], 0)
    assert bm.probe_prefix(prompt) == 8
    assert bm.allocate("b", prompt, 10) == Allocation([0, 1, 3], 8)
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 6
    assert bm.prefix_stats == (8, 20)
    assert bm.prefix_hit_rate == pytest.approx(0.4)
    # a different second block shares only the first
    other = prompt[:4] + [7, 7, 7, 7, 7]
    assert bm.allocate("c", other, 9) == Allocation([0, 4, 5], 4)
    assert bm.ref_count(0) == 3


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = make(10)
    prompt = toks(0, 8)  # exactly two full blocks
    assert bm.allocate("a", prompt, 8) == Allocation([0, 1], 0)
    assert bm.num_cached_blocks == 2
    # cap at len-1 = 7 rounded down to a block boundary: one block
    assert bm.probe_prefix(prompt) == 4
    assert bm.allocate("b", prompt, 8) == Allocation([0, 2], 4)
    assert bm.probe_prefix(prompt + [99]) == 8
    assert bm.probe_prefix(prompt[:1]) == 0
    assert bm.probe_prefix([]) == 0


def test_eviction_is_lru_and_tail_first_and_only_when_needed():
    bm = make(6)
    a, b = toks(0, 12), toks(50, 8)
    assert bm.allocate("a", a, 12).block_table == [0, 1, 2]
    assert bm.allocate("b", b, 8).block_table == [3, 4]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    assert bm.num_cached_blocks == 5  # freed blocks stay cached
    assert list(bm._evictable) == [2, 1, 0, 4, 3]  # a's tail first, then b's
    # the uncached free block 5 is used before any cached block is evicted
    assert bm.allocate("c", toks(200, 4), 4).block_table == [5]
    assert bm.probe_prefix(a + [1]) == 12
    bm.free("c")  # c's full block is cached too: now the newest evictable
    assert bm.allocate("d", toks(300, 16), 16).block_table == [2, 1, 0, 4]
    assert bm.probe_prefix(a + [1]) == 0
    assert bm.probe_prefix(b + [1]) == 4  # b's first block survives, its tail did not
    assert bm.probe_prefix(toks(200, 4) + [1]) == 4
    assert list(bm._evictable) == [3, 5]


def test_hit_revives_a_block_and_refreeing_makes_it_recent():
    bm = make(3)
    a, b = toks(0, 4), toks(10, 4)
    assert bm.allocate("a", a, 4).block_table == [0]
    assert bm.allocate("b", b, 4).block_table == [1]
    bm.free("a")
    bm.free("b")
    assert list(bm._evictable) == [0, 1]
    assert bm.allocate("c", a + [99], 5) == Allocation([0, 2], 4)
    assert bm.ref_count(0) == 1 and list(bm._evictable) == [1]
    bm.free("c")
    assert list(bm._evictable) == [1, 0] and list(bm._free) == [2]  # partial block: uncached
    assert bm.allocate("d", toks(20, 8), 8).block_table == [2, 1]  # evicts b's, keeps a's
    assert bm.probe_prefix(b + [1]) == 0
    assert bm.probe_prefix(a + [1]) == 4


def test_failed_allocation_changes_nothing():
    bm = make(4)
    a = toks(0, 8)
    assert bm.allocate("a", a, 8).block_table == [0, 1]
    bm.free("a")
    before = state(bm)
    # 2 cached hits (both evictable, so they use up free blocks) + 3 fresh > 4 free
    assert bm.allocate("b", a + toks(100, 12), 20) is None
    assert state(bm) == before
    assert not bm.has_request("b")
    assert bm.allocate("b", toks(100, 20), 20) is None  # 5 fresh > 4
    assert state(bm) == before
    # 2 hits + 2 fresh fit exactly
    assert bm.allocate("b", a + toks(100, 5), 13) == Allocation([0, 1, 2, 3], 8)
    assert bm.num_free_blocks == 0
    before = state(bm)
    assert bm.append_slots("b", a + toks(100, 5), 4) is None  # 17 slots need a 5th block
    assert state(bm) == before
    assert bm.num_slots("b") == 13
    assert bm.allocate("c", [1], 1) is None
    assert state(bm) == before


def test_hash_collision_with_different_tokens_is_not_reused(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, ns: b"same")
    bm = make(8)
    assert bm.allocate("a", [1, 2, 3, 4, 5], 5) == Allocation([0, 1], 0)
    assert bm.probe_prefix([9, 9, 9, 9, 5]) == 0
    assert bm.allocate("b", [9, 9, 9, 9, 5], 5) == Allocation([2, 3], 0)
    assert bm.ref_count(0) == 1
    assert bm.num_cached_blocks == 1  # b's block could not take the occupied hash
    # the genuine owner of the hash still hits
    assert bm.allocate("c", [1, 2, 3, 4, 6], 5) == Allocation([0, 4], 4)


def test_same_tokens_under_a_different_prefix_are_not_reused(monkeypatch):
    # a hash that ignores the parent: block content B at position 1 of `a` collides
    # with content B at position 0 of `b`; the tokens match, the prefix does not.
    monkeypatch.setattr(bm_module, "hash_block_tokens",
                        lambda parent, tokens, ns: repr(tuple(tokens)).encode())
    bm = make(8)
    A, B = [1, 2, 3, 4], [5, 6, 7, 8]
    assert bm.allocate("a", A + B + [0], 9) == Allocation([0, 1, 2], 0)
    assert bm.probe_prefix(B + B + [0]) == 0
    assert bm.allocate("b", B + B + [0], 9) == Allocation([3, 4, 5], 0)
    assert bm.ref_count(1) == 1


def test_evicted_parent_breaks_the_chain():
    bm = make(3)
    a = toks(0, 8)
    assert bm.allocate("a", a, 8).block_table == [0, 1]
    bm.free("a")  # evictable order: 1 (tail), 0
    assert bm.allocate("x", toks(50, 8), 8).block_table == [2, 1]
    # block 0 survives and still hits; the chain ends there
    assert bm.probe_prefix(a + [1]) == 4


def test_decode_growth_registers_blocks_as_they_fill():
    bm = make(8)
    ids = toks(0, 6)
    assert bm.allocate("a", ids, 6) == Allocation([0, 1], 0)
    assert bm.num_cached_blocks == 1
    ids.append(6)
    assert bm.append_slots("a", ids, 1) == [0, 1]
    assert bm.num_cached_blocks == 1
    ids.append(7)
    assert bm.append_slots("a", ids, 1) == [0, 1]
    assert bm.num_slots("a") == 8
    assert bm.num_cached_blocks == 2  # block 1 is full now
    assert bm.probe_prefix(ids + [1]) == 8
    ids.append(8)
    assert bm.append_slots("a", ids, 1) == [0, 1, 2]


def test_speculative_slots_are_covered_but_never_registered():
    bm = make(8)
    ids = toks(0, 9)
    assert bm.allocate("a", ids, 9).block_table == [0, 1, 2]
    # 1 bonus + 3 draft tokens: slots 9..12; only 9 tokens are committed
    assert bm.append_slots("a", ids, 4) == [0, 1, 2, 3]
    assert bm.num_slots("a") == 13
    assert bm.num_cached_blocks == 2
    # one token accepted: 10 computed; the next step's 4 tokens fit in the slots' blocks
    ids += [9, 10]
    assert bm.append_slots("a", ids, 4, num_computed_tokens=10) == [0, 1, 2, 3]
    assert bm.num_slots("a") == 14
    assert bm.num_cached_blocks == 2  # block 2 holds 11 committed of 12 tokens
    ids.append(11)
    assert bm.append_slots("a", ids, 0) == [0, 1, 2, 3]
    assert bm.num_cached_blocks == 3


def test_chunked_prefill_then_a_second_request_hits():
    bm = make(8)
    prompt = toks(0, 12)
    assert bm.probe_prefix(prompt) == 0
    assert bm.allocate("a", prompt, 4) == Allocation([0], 0)
    assert bm.num_cached_blocks == 1
    assert bm.append_slots("a", prompt, 4) == [0, 1]
    assert bm.append_slots("a", prompt, 4) == [0, 1, 2]
    assert bm.num_cached_blocks == 3
    # b covers less than its cached prefix: it still gets every hit
    assert bm.allocate("b", prompt + [5], 4) == Allocation([0, 1, 2], 12)
    assert bm.num_slots("b") == 12


def test_no_leak_after_mixed_workload():
    bm = make(12)
    system = toks(1000, 8)
    live = []
    for i in range(20):
        rid = f"r{i}"
        prompt = system + toks(10 * i, 3 + i % 5)
        alloc = bm.allocate(rid, prompt, len(prompt))
        while alloc is None:  # preempt the oldest until it fits
            bm.free(live.pop(0))
            alloc = bm.allocate(rid, prompt, len(prompt))
        live.append(rid)
        ids = list(prompt)
        for step in range(i % 4):
            ids.append(step)
            if bm.append_slots(rid, ids, 1) is None:
                break
        if i % 3 == 0:
            bm.free(live.pop())
    assert bm.prefix_hit_rate > 0
    for rid in live:
        bm.free(rid)
    assert bm.num_free_blocks == 12 and bm.usage == 0.0
    assert all(bm.ref_count(i) == 0 for i in range(12))
    assert sorted(list(bm._free) + list(bm._evictable)) == list(range(12))
    assert bm.num_cached_blocks == len(bm._evictable)
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.probe_prefix(system + [1]) == 0


def test_hash_is_chained_and_namespaced():
    h0 = hash_block_tokens(None, [1, 2, 3, 4], "m1")
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4], "m1")
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], "m2")
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5], "m1")
    assert hash_block_tokens(h0, [5], "m1") != hash_block_tokens(None, [5], "m1")
    # different namespaces never share a cached block
    bm1, bm2 = make(4), BlockManager(4, BS, namespace="other")
    bm1.allocate("a", toks(0, 8), 8)
    bm2.allocate("a", toks(0, 8), 8)
    assert set(bm1._cache).isdisjoint(bm2._cache)


def test_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16, namespace="x")
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0, namespace="x")
    with pytest.raises(ValueError, match="namespace"):
        BlockManager(4, 16, namespace="")
    bm = make(4)
    bm.allocate("a", [1], 1)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", [1], 1)
    with pytest.raises(ValueError, match="unknown request"):
        bm.append_slots("zz", [1], 1)
    with pytest.raises(ValueError, match="no blocks to free"):
        bm.free("zz")
    assert not bm.reset_prefix_cache()  # "a" still holds a block


# ---------------------------------------------------------------- KV groups (sliding windows)
def make_grouped(num_blocks: int, window: int = 6) -> BlockManager:
    return BlockManager(num_blocks, BS, namespace="artifact-sha", windows=(None, window))


@pytest.mark.parametrize("step", [4, 8, 12])
def test_a_request_that_fits_alone_grows_in_chunks_to_its_end_in_that_many_blocks(step):
    """max_blocks_held is what a request needs alone; chunks of `step` slots must then
    always find room: the sliding group's blocks behind the window of a chunk's first
    position count as free before the fresh ones are taken (they were given back only
    afterwards, so such a request preempted itself forever once the pool was full)."""
    ids = toks(100, 60)
    probe = make_grouped(1, window=6)
    need = probe.max_blocks_held(60, step)
    bm = make_grouped(need, window=6)
    assert bm.allocate("a", ids, step) is not None
    for start in range(step, 60, step):
        assert bm.append_slots("a", ids[:start + step], min(step, 60 - start), start) \
            is not None, f"no room for positions {start}.. in {need} blocks"
    assert bm.num_held_blocks("a") <= need
    # what counts as free is exactly what the release frees: a block another request also
    # holds (b shares a's first 8 blocks; its sliding group holds 6 and 7) is not counted
    shared = make_grouped(2 * need, window=6)
    shared.allocate("a", ids, 48)
    shared.allocate("b", ids[:32] + toks(900, 4), 36)
    free = shared.num_free_blocks
    releasable = shared._releasable(shared._requests["a"], 48)
    assert releasable == 10 - 2  # blocks 0-9 lie behind position 48's window
    shared.append_slots("a", ids[:49], 1, 48)  # block 12 in both groups
    assert shared.num_free_blocks == free + releasable - 2


def test_sliding_group_gives_back_blocks_behind_its_window():
    bm = make_grouped(40, window=6)
    ids = toks(100, 30)
    alloc = bm.allocate("a", ids, 12)  # positions 0..11 computed next: nothing behind yet
    full, sliding = bm.block_tables("a")
    assert alloc.block_table == list(full) and len(full) == len(sliding) == 3
    assert bm.num_held_blocks("a") == 6
    # the next step starts at position 12: keys before 12 - 6 + 1 = 7 are never read again,
    # so block 0 (positions 0-3) goes, block 1 (4-7) stays
    bm.append_slots("a", ids[:13], 1, 12)
    full, sliding = bm.block_tables("a")
    assert sliding[0] == bm_module.RELEASED and len(sliding) == len(full) == 4
    assert bm.num_held_blocks("a") == 4 + 3
    for pos in range(13, 30):  # decode on: the sliding group holds at most 3 blocks
        bm.append_slots("a", ids[:pos + 1], 1, pos)
        assert bm.num_held_blocks("a") - len(bm.block_table("a")) <= 3
    free_before = bm.num_free_blocks
    held = bm.num_held_blocks("a")
    bm.free("a")
    assert bm.num_free_blocks == free_before + held
    assert all(bm.ref_count(i) == 0 for i in range(bm.num_blocks))


def test_grouped_prefix_hit_is_the_shortest_group_hit():
    bm = make_grouped(40, window=6)
    shared = toks(100, 16)
    bm.allocate("a", shared + [1, 2], 18)  # group 0: blocks 0-4, group 1: blocks 5-9
    bm.free("a")
    assert bm.probe_prefix(shared + [7, 8]) == 16
    alloc = bm.allocate("b", shared + [7, 8], 18)
    assert alloc.num_cached_tokens == 16 and alloc.block_table[:4] == [0, 1, 2, 3]
    full, sliding = bm.block_tables("b")
    # the sliding group keeps what the window of position 16 needs (keys from 11 on:
    # blocks 2-4); its hits 0-1 went straight back, still cached for later requests
    assert sliding[:2] == (bm_module.RELEASED,) * 2 and sliding[2:4] == (7, 8)
    assert bm.num_held_blocks("b") == 5 + 3
    assert bm.ref_count(5) == bm.ref_count(6) == 0 and bm.num_cached_blocks == 8
    bm.free("b")
    bm._uncache(bm._blocks[7])  # the sliding group loses its third block
    assert bm.probe_prefix(shared + [7, 8]) == 8  # ... so both groups hit two blocks


def test_grouped_allocation_needs_blocks_in_every_group():
    bm = make_grouped(5, window=6)
    assert bm.allocate("a", toks(0, 12), 12) is None  # 3 blocks x 2 groups > 5
    assert bm.num_free_blocks == 5 and not bm.has_request("a")
    assert bm.allocate("a", toks(0, 8), 8) is not None  # 2 x 2
    assert bm.max_blocks_held(1000, 8) == 250 + bm.blocks_needed(6 + 8) + 1


def test_trim_keeps_released_entries_released():
    bm = make_grouped(40, window=4)
    ids = toks(0, 20)
    bm.allocate("a", ids[:16], 16)
    bm.append_slots("a", ids[:17], 4, 16)  # decode + 3 drafts: slots 16..19, block 4
    held = bm.num_held_blocks("a")
    assert bm.trim("a", 17) == 0  # block 4 still needed for position 16
    bm.append_slots("a", ids[:17], 5, 17)  # 17..21 -> block 5
    assert bm.trim("a", 18) == 2  # block 5 of each group
    assert bm.num_held_blocks("a") == held
    assert bm.block_tables("a")[1][:3] == (bm_module.RELEASED,) * 3
    bm.free("a")
    assert all(bm.ref_count(i) == 0 for i in range(bm.num_blocks))


def test_bad_windows_are_refused():
    for windows in ((), (None, 0)):
        with pytest.raises(ValueError, match="one entry per KV group, each None or >= 1"):
            BlockManager(8, BS, namespace="n", windows=windows)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = make(10)
    prompt = toks(100, 10)  # blocks 0, 1 full; block 2 holds 2 tokens
    bm.allocate("p", prompt, 10)
    copies = bm.fork("p", "c")
    assert copies == [(2, 3)]
    assert bm.block_table("c") == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    # the child's next full block chains on the shared ones (its parent link is block 1)
    bm.append_slots("c", prompt + [7, 8], 2)
    assert bm.num_cached_blocks == 3
    bm.free("p")
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    bm.free("c")
    assert bm.num_free_blocks == 10


def test_fork_of_whole_blocks_copies_nothing_and_fails_cleanly_when_full():
    bm = make(3)
    bm.allocate("p", toks(0, 8), 8)
    assert bm.fork("p", "c") == [] and bm.block_table("c") == [0, 1]
    bm2 = make(3)
    bm2.allocate("p", toks(0, 9), 9)  # 3 blocks, the last partial: no block left to copy
    before = state(bm2)
    assert bm2.fork("p", "c") is None
    assert state(bm2) == before and not bm2.has_request("c")
    with pytest.raises(ValueError, match="already has blocks"):
        bm.fork("p", "c")
