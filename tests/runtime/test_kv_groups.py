"""KV layer groups: which layers share a block table, and how a block's slots are shared."""

import pytest

from qserve.runtime.kv_cache import KVCache, KVCacheSpec
from qserve.runtime.kv_groups import KVGroups


def test_one_window_class_is_one_group_of_every_layer():
    for windows in ((None, None, None), (4, 4)):
        g = KVGroups.of(windows)
        assert g.windows == (windows[0],) and g.slots == len(windows)
        assert g.layer_group == (0,) * len(windows)
        assert g.layer_slot == tuple(range(len(windows)))


def test_gemma3_pattern_groups_of_the_smallest_class():
    # Gemma 3 270M: 18 layers, every 6th global -> 1 full group + 5 sliding, 3 slots each
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    g = KVGroups.of(windows)
    assert g.slots == 3 and g.windows == (None,) + (512,) * 5
    assert [g.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [g.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    sliding = [i for i in range(18) if windows[i]]
    assert [g.layer_group[i] for i in sliding] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5]
    assert [g.layer_slot[i] for i in sliding] == [0, 1, 2] * 5
    # no two layers share a (group, slot): each has memory of its own for a given block id
    assert len({(g.layer_group[i], g.layer_slot[i]) for i in range(18)}) == 18


def test_uneven_class_leaves_last_group_short():
    windows = (8, 8, None, 8, 8, 8, None)  # 2 full, 5 sliding -> groups of 2
    g = KVGroups.of(windows)
    assert g.slots == 2 and g.windows == (None, 8, 8, 8)
    assert g.layer_group == (1, 1, 0, 2, 2, 3, 0) and g.layer_slot == (0, 1, 0, 0, 1, 0, 1)


def test_bad_windows_refused():
    with pytest.raises(ValueError, match="positive int"):
        KVGroups.of((0, None))
    with pytest.raises(ValueError, match="at least one layer"):
        KVGroups.of(())
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        KVCacheSpec(2, 1, 8, 4, "bf16", layer_windows=(None, 4, 4))


def test_cache_pools_are_shared_by_slot_and_sized_by_it():
    spec = KVCacheSpec(6, 2, 8, 4, "bf16", layer_windows=(4, 4, None, 4, 4, None))
    assert spec.bytes_per_block == 2 * 2 * 2 * 8 * 2 * 4  # K+V, 2 slots, 2 heads, dim 8, bf16
    cache = KVCache(spec, 10)
    assert cache.nbytes == 10 * spec.bytes_per_block
    assert cache.groups.windows == (None, 4, 4)
    pool = [cache.layer(i).k_pool.data_ptr() for i in range(6)]
    assert pool[0] == pool[3] == pool[2]  # slot 0 of groups 1, 2 and 0
    assert pool[1] == pool[4] == pool[5] != pool[0]
    assert [cache.group_of(i) for i in range(6)] == [1, 1, 0, 2, 2, 0]
    assert cache.blocks_per_group == 3  # what a single-group cache of as many tokens needs
    # without windows: one pool pair per layer, as before
    plain = KVCache(KVCacheSpec(3, 2, 8, 4, "bf16"), 10)
    assert len({plain.layer(i).k_pool.data_ptr() for i in range(3)}) == 3
    assert plain.nbytes == 10 * 2 * 3 * 2 * 8 * 2 * 4
