from __future__ import annotations

import pytest

from llmserve.kv_cache import BlockPool, KVCacheManager
from llmserve.kv_cache.manager import hash_block
from tests.helpers.kv_requests import FakeReq


def test_allocate_and_free_in_lru_order():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1) and pool.num_free_blocks == 2
    pool.free_blocks([b, a])  # tail-first: b is evicted before a
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [1, 2, 3]  # 0 stays free
    assert [blk.block_id for blk in pool.get_new_blocks(1)] == [0]
    pool.check_integrity()


def test_a_run_of_freed_blocks_is_handed_out_in_increasing_order():
    """A finished sequence frees its blocks last first; the next sequence to take them gets
    them back in increasing order (the CPU attention reads increasing addresses faster)."""
    pool = BlockPool(8)
    first = pool.get_new_blocks(4)
    rest = pool.get_new_blocks(4)
    pool.free_blocks(first[::-1])
    pool.free_blocks(rest[::-1])
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [1, 2, 3]
    assert [blk.block_id for blk in pool.get_new_blocks(5)] == [0, 4, 5, 6, 7]
    pool.check_integrity()


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h")
    pool.free_blocks([a])
    assert pool.get_cached_block(b"h") is a and a.ref_cnt == 0
    pool.touch([a])  # a prefix hit takes it back out of the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # reaching the head of the queue evicts the hash
    assert pool.get_cached_block(b"h") is None and a.block_hash is None
    pool.check_integrity()


def test_double_free_is_an_error():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])


def test_over_allocation_is_an_error():
    with pytest.raises(ValueError, match="cannot allocate 3 blocks, 2 free"):
        BlockPool(2).get_new_blocks(3)


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h")
    assert pool.get_cached_block(b"h") is None


def test_block_hash_depends_on_parent_tokens_and_extra_keys():
    h = hash_block(b"", [1, 2, 3])
    assert h == hash_block(b"", [1, 2, 3])
    assert h != hash_block(b"x", [1, 2, 3])
    assert h != hash_block(b"", [1, 2, 4])
    assert h != hash_block(b"", [1, 2, 3], "salt")


def test_manager_allocates_by_block_and_frees_everything():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = FakeReq("a", list(range(10)))
    new = kv.allocate_slots(r, 10)
    assert len(new) == 3 and kv.get_block_ids("a") == [[0, 1, 2]]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # 12 tokens still fit in 3 blocks
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 1)) == 1
    kv.check_integrity()
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.num_requests() == 0
    kv.check_integrity()


def test_manager_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = FakeReq("a", list(range(12)))
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 2 and kv.num_requests() == 0
    kv.check_integrity()


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = FakeReq("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = FakeReq("b", list(range(12)))  # same 12 tokens: 2 blocks hit, the last is recomputed
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [blk.block_id for blk in hits[0]] == [0, 1]
    kv.allocate_slots(b, 4, hits)
    assert kv.get_block_ids("b")[0][:2] == [0, 1] and kv.pool.blocks[0].ref_cnt == 2
    c = FakeReq("c", [*range(8), 99, 98, 97, 96])
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    kv.check_integrity()
    for r in (a, b):
        kv.free(r)
    kv.check_integrity()


def test_prefix_hit_reclaims_free_cached_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = FakeReq("a", list(range(12)))
    kv.allocate_slots(a, 12)
    kv.free(a)  # all three blocks free but cached
    b = FakeReq("b", [*range(8), 50, 51, 52, 53])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 4, hits) is not None  # 2 reclaimed + 1 new = all 3 blocks
    assert kv.num_free_blocks == 0
    kv.check_integrity()
    kv.free(b)
    kv.check_integrity()


def test_reset_prefix_cache_forgets_every_prefix_only_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = FakeReq("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    with pytest.raises(RuntimeError, match="1 requests hold KV blocks"):
        kv.reset_prefix_cache()
    kv.free(a)
    assert kv.get_computed_blocks(FakeReq("b", list(range(12))))[1] == 8  # cached
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(FakeReq("c", list(range(12))))[1] == 0
    assert kv.num_free_blocks == 4
    kv.check_integrity()
