import numpy as np

from rollout.prefix_cache import RadixCache


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def test_match_insert_split_and_reuse():
    freed = []
    cache = RadixCache(lambda s: freed.extend(s.tolist()))
    assert cache.insert(arr(1, 2, 3, 4), arr(10, 11, 12, 13)) == 0
    slots, node = cache.match_prefix(arr(1, 2, 3, 9))
    assert slots.tolist() == [10, 11, 12]  # split inside the edge
    assert cache.insert(arr(1, 2, 3, 9, 8), arr(20, 21, 22, 23, 24)) == 3  # first 3 already cached
    assert cache.match_prefix(arr(1, 2, 3, 9, 8, 7))[0].tolist() == [10, 11, 12, 23, 24]
    assert cache.total_tokens == 6
    assert cache.match_prefix(arr(5))[0].size == 0


def test_locked_paths_survive_eviction_and_lru_order():
    freed = []
    cache = RadixCache(lambda s: freed.extend(s.tolist()))
    cache.insert(arr(1, 2), arr(0, 1))
    cache.insert(arr(3, 4), arr(2, 3))
    cache.insert(arr(5, 6), arr(4, 5))
    _, node = cache.match_prefix(arr(1, 2))
    cache.lock(node)
    cache.match_prefix(arr(5, 6))  # touch: 3,4 is now least recently used
    assert cache.evictable_tokens == 4
    assert cache.evict(2) == 2 and freed == [2, 3]
    assert cache.evict(100) == 2 and freed == [2, 3, 4, 5]
    assert cache.match_prefix(arr(1, 2))[0].tolist() == [0, 1]  # locked: kept
    cache.unlock(node)
    assert cache.evict(100) == 2 and cache.total_tokens == 0


def test_evicting_a_leaf_exposes_its_parent():
    freed = []
    cache = RadixCache(lambda s: freed.extend(s.tolist()))
    cache.insert(arr(1, 2, 3), arr(0, 1, 2))
    cache.insert(arr(1, 2, 4), arr(0, 1, 5))  # shares [1, 2]; child edges [3] and [4]
    assert cache.evict(3) == 4 and sorted(freed) == [0, 1, 2, 5]


def test_flush_frees_unlocked_now_and_locked_on_last_unlock():
    freed = []
    cache = RadixCache(lambda s: freed.extend(s.tolist()))
    cache.insert(arr(1, 2, 3), arr(0, 1, 2))
    cache.insert(arr(7, 8), arr(5, 6))
    _, node = cache.match_prefix(arr(1, 2, 3))
    cache.lock(node)
    cache.flush()
    assert sorted(freed) == [5, 6] and cache.total_tokens == 0
    assert cache.match_prefix(arr(1, 2, 3))[0].size == 0  # stale prefix no longer matches
    cache.unlock(node)
    assert sorted(freed) == [0, 1, 2, 5, 6]
