from __future__ import annotations

import itertools
import random

import pytest

from llmserve.kv_cache import BlockPool, KVCacheManager
from llmserve.kv_cache.manager import hash_block
from tests.helpers.kv_requests import FakeReq


def test_cached_blocks_are_evicted_in_lru_order():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1) and pool.num_free_blocks == 2
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free_blocks([b, a])  # tail-first: b is evicted before a
    assert sorted(blk.block_id for blk in pool.get_new_blocks(3)) == [1, 2, 3]  # 0 stays
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"b") is None
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


def test_a_sequence_grows_into_the_block_after_its_last():
    """``after``: the free blocks right after the caller's last block first (even from the
    middle of the queue), the rest from the head; a held block ends the run."""
    pool = BlockPool(8)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(b[::-1])  # queue: 4 5 6 7 3 2
    held = pool.get_new_blocks(1, after=5)  # 6
    assert [blk.block_id for blk in held] == [6]
    grown = pool.get_new_blocks(3, after=a[-1].block_id)
    assert [blk.block_id for blk in grown] == [2, 3, 4]  # 2, 3 in a row, then the head
    assert [blk.block_id for blk in pool.get_new_blocks(1, after=7)] == [5]  # past the end
    pool.check_integrity()


def test_growth_takes_a_cached_block_out_of_lru_order_only_from_the_older_half():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, bytes([i]))
    pool.free_blocks([blocks[i] for i in (2, 3, 4, 5)])  # 2 and 3 older than 4 and 5
    assert [blk.block_id for blk in pool.get_new_blocks(1, after=1)] == [2]
    assert pool.get_cached_block(bytes([2])) is None  # evicted
    # 3 is now the oldest free block; 4 and 5 are in the newer half of the queue.
    assert [blk.block_id for blk in pool.get_new_blocks(1, after=2)] == [3]
    pool.free_blocks([blocks[0]])  # the newest
    grown = pool.get_new_blocks(1, after=3)  # 4 is in the older half now (4, 5, 0)
    assert [blk.block_id for blk in grown] == [4]
    assert [blk.block_id for blk in pool.get_new_blocks(1, after=4)] == [5]  # oldest again
    pool.free_blocks([blocks[1]])  # queue: 0 (cached), 1 (cached, newest)
    assert [blk.block_id for blk in pool.get_new_blocks(1, after=0)] == [0]  # not 1: LRU
    assert pool.get_cached_block(bytes([1])) is blocks[1]
    pool.check_integrity()


def test_room_is_left_above_a_new_run_and_taken_last():
    pool = BlockPool(8)
    a = pool.get_new_blocks(2, room=3)  # 0, 1; room: 2, 3, 4, to the tail of the queue
    assert [blk.block_id for blk in a] == [0, 1]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [5, 6]
    assert [blk.block_id for blk in pool.get_new_blocks(2, after=1)] == [2, 3]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [7, 4]  # the room last
    pool.check_integrity()


def test_a_new_run_starts_below_the_head_and_leaves_room_above():
    """A finished sequence's blocks sit at the head last first; the next sequence takes them
    from the bottom up, and the ones above stay free for it to grow into."""
    pool = BlockPool(12)
    old = pool.get_new_blocks(6)  # 0-5
    for i, blk in enumerate(old):
        pool.cache_block(blk, bytes([i]))
    pool.get_new_blocks(6)  # 6-11, held
    pool.free_blocks(old[::-1])  # queue: 5 4 3 2 1 0
    new = pool.get_new_blocks(2, room=3)
    assert [blk.block_id for blk in new] == [1, 2]  # 5 is the head: 1-5 are its old run
    assert [blk.block_id for blk in pool.get_new_blocks(1)] == [0]  # 3, 4, 5 left as room
    assert [blk.block_id for blk in pool.get_new_blocks(3, after=2)] == [3, 4, 5]
    pool.check_integrity()


def test_room_keeps_old_cached_blocks_until_taken_and_stops_at_recent_ones():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(10)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, bytes([i]))
    for i in (0, 1, 2, 4, 5, 6, 7, 8, 9, 3):  # 3 freed last
        pool.free_blocks([blocks[i]])
    (a,) = pool.get_new_blocks(1, room=3)  # 0; room: 1 and 2, old; 3 is recent: it stops
    assert a.block_id == 0
    assert pool.get_cached_block(bytes([1])) is blocks[1]  # still a prefix until taken
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [4, 5, 6]  # not the room
    assert [blk.block_id for blk in pool.get_new_blocks(2, after=0)] == [1, 2]
    assert pool.get_cached_block(bytes([1])) is None
    assert pool.get_cached_block(bytes([3])) is blocks[3]
    pool.check_integrity()


def test_manager_leaves_room_after_a_prompt_and_grows_into_it():
    """Two requests' prompts, then both decode: each table stays one run of blocks."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = FakeReq("a", list(range(10)), max_tokens=6)  # 16 tokens in all: 4 blocks
    b = FakeReq("b", list(range(100, 110)), max_tokens=6)
    kv.allocate_slots(a, 10)
    kv.allocate_slots(b, 10)
    assert kv.get_block_ids("a") == [[0, 1, 2]] and kv.get_block_ids("b") == [[4, 5, 6]]
    for r in (a, b):
        r.num_computed_tokens = 10
    for step in range(6):
        for r in (a, b):
            kv.allocate_slots(r, 1)
            r.all_token_ids.append(step)
            r.num_computed_tokens += 1
    assert kv.get_block_ids("a") == [[0, 1, 2, 3]] and kv.get_block_ids("b") == [[4, 5, 6, 7]]
    kv.check_integrity()
    for r in (a, b):
        kv.free(r)
    kv.check_integrity()


def test_no_blocks_from_an_empty_pool():
    pool = BlockPool(2)
    held = pool.get_new_blocks(2)
    assert pool.get_new_blocks(0, after=held[-1].block_id, room=4) == []


def test_tables_stay_in_runs_under_a_mixed_load():
    """Requests of mixed lengths arrive as others finish (some early, as at an EOS), in a
    pool about twice what they hold: their block tables of ~13 blocks stay in one or two
    runs (1.2 jumps a table; each call's blocks from the head of the queue, as the pool
    handed them out before: 11.4)."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=256, block_size=8)
    running: list[tuple[FakeReq, int]] = []
    jumps, blocks = [], []
    for step in range(1500):
        while len(running) < 8:
            prompt, max_tokens = rng.randrange(10, 120), rng.randrange(10, 120)
            stop = max_tokens if rng.random() < 0.5 else rng.randrange(1, max_tokens + 1)
            r = FakeReq(f"r{step}-{len(running)}", [rng.randrange(1000) for _ in range(prompt)],
                        max_tokens=max_tokens)
            assert kv.allocate_slots(r, prompt) is not None
            r.num_computed_tokens = prompt
            running.append((r, stop))
        for r, stop in list(running):
            if r.num_computed_tokens - r.num_prompt_tokens >= stop:
                kv.free(r)
                running.remove((r, stop))
                continue
            assert kv.allocate_slots(r, 1) is not None
            r.all_token_ids.append(rng.randrange(1000))
            r.num_computed_tokens += 1
        if step >= 500 and step % 50 == 0:
            for r, _ in running:
                table = kv.get_block_ids(r.request_id)[0]
                jumps.append(sum(b != a + 1 for a, b in itertools.pairwise(table)))
                blocks.append(len(table))
    kv.check_integrity()
    assert sum(blocks) / len(blocks) > 10
    assert sum(jumps) / len(jumps) < 2.0, sum(jumps) / len(jumps)
