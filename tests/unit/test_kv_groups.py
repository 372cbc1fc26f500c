"""KV cache groups: layers grouped by window, sliding-window groups releasing the blocks their
window no longer reaches, prefix hits that every group can resume from, and the sizing
arithmetic, each against a slow simulation or by hand."""

from __future__ import annotations

import random

import pytest

from llmserve.kv_cache import KVCacheGroup, KVCacheManager, KVCacheSpec, group_layers
from llmserve.kv_cache.groups import blocks_per_sequence, first_needed_block
from llmserve.kv_cache.manager import hash_block
from tests.helpers.kv_requests import FakeReq as Req

W, BS = 8, 4  # window, block size of the manager tests


def gemma_windows(num_layers: int, window: int = 512, every: int = 6) -> list[int | None]:
    return [None if (i + 1) % every == 0 else window for i in range(num_layers)]


def test_a_model_without_windows_is_one_group():
    assert group_layers([None] * 30) == [KVCacheGroup(tuple(range(30)), None)]


def test_gemma3_270m_splits_into_groups_of_three():
    groups = group_layers(gemma_windows(18))
    assert [len(g.layers) for g in groups] == [3] * 6
    assert [g for g in groups if g.window is None] == [KVCacheGroup((5, 11, 17), None)]
    assert sorted(i for g in groups for i in g.layers) == list(range(18))
    assert groups[0] == KVCacheGroup((0, 1, 2), 512)


def test_uneven_classes_take_their_greatest_common_divisor():
    groups = group_layers(gemma_windows(26))  # Gemma 3 1B: 22 sliding, 4 global
    assert {len(g.layers) for g in groups} == {2} and len(groups) == 13
    assert len(group_layers([None, 4, 4, 4, 4, 4])) == 6  # 1 and 5: one layer each


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="layer 1: sliding window must be at least 1"):
        group_layers([None, 0])


def test_first_needed_block():
    assert first_needed_block(100, None, 16) == 0
    assert first_needed_block(31, 32, 16) == 0  # keys 0..31
    assert first_needed_block(48, 32, 16) == 1  # keys 17..48
    assert first_needed_block(63, 32, 16) == 2  # keys 32..63


def _manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=[KVCacheGroup((0,), W),
                                                  KVCacheGroup((1,), None)])


def _check_held(kv: KVCacheManager, req: Req, step_end: int) -> None:
    """A sliding group holds exactly the blocks from the first its next query sees up to the
    step's end; the full group every block up to it."""
    tables = kv._req_blocks[req.request_id]
    first = first_needed_block(req.num_computed_tokens, W, BS)
    end = -(-step_end // BS)
    assert all(b is None for b in tables[0][:first])
    assert all(b is not None for b in tables[0][first:end])
    assert all(b is not None for b in tables[1][:end])


def test_decoding_releases_what_the_window_leaves_and_frees_everything():
    kv = _manager(64)
    req = Req("a", list(range(200)))
    kv.allocate_slots(req, 20)  # a 20-token prompt
    req.num_computed_tokens = 20
    most = 0
    for _ in range(150):  # then one token per step
        assert kv.allocate_slots(req, 1) is not None
        _check_held(kv, req, req.num_computed_tokens + 1)
        req.num_computed_tokens += 1
        most = max(most, sum(b is not None for b in kv._req_blocks["a"][0]))
        kv.check_integrity()
    assert most == blocks_per_sequence([KVCacheGroup((0,), W)], 171, BS, step_tokens=1) == 3
    assert kv.num_held_blocks("a") == 3 + 43  # sliding: keys 163..170; full: 171 tokens
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 64 and kv.num_requests() == 0


def test_a_chunk_holds_its_own_blocks_and_the_window_before_it():
    kv = _manager(64)
    req = Req("a", list(range(100)))
    kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    kv.allocate_slots(req, 40)  # queries 40..79 see keys from 33: blocks 8..19 held
    _check_held(kv, req, 80)
    assert sum(b is not None for b in kv._req_blocks["a"][0]) == 12
    kv.check_integrity()


def test_a_cached_prefix_longer_than_the_window_is_resumed():
    kv = _manager(64)
    shared = list(range(1000, 1060))  # 60 tokens: 15 blocks, longer than the 8-key window
    a = Req("a", [*shared, 1, 2, 3])
    for n in (17, 17, 17, 12):  # a chunked prefill; the window releases as it goes
        kv.allocate_slots(a, n)
        a.num_computed_tokens += n
    kv.free(a)  # everything free, every full block still cached
    b = Req("b", [*shared, 7, 8, 9, 10, 11])
    hits, n = kv.get_computed_blocks(b)
    assert n == 60
    first = first_needed_block(60, W, BS)  # the query at 60 sees keys 53..60
    assert hits[0][:first] == [None] * first and None not in hits[0][first:]
    assert None not in hits[1] and len(hits[0]) == len(hits[1]) == 15
    assert kv.allocate_slots(b, 5, hits) is not None
    b.num_computed_tokens = 65
    kv.check_integrity()
    assert kv.get_block_ids("b")[1][:15] == [blk.block_id for blk in hits[1]]


def test_a_hit_stops_where_a_sliding_group_misses_a_block_of_its_window():
    kv = _manager(64)
    shared = list(range(1000, 1060))  # 15 blocks
    a = Req("a", [*shared, 1])
    kv.allocate_slots(a, 61)  # one chunk: every block of both groups computed and cached
    a.num_computed_tokens = 61
    kv.free(a)
    # Evict the sliding group's block 14 alone: it is the only free block left when a new
    # block is taken.
    target = kv.pool.get_cached_block(_sliding_key(shared, 14))
    others = [b for b in kv.pool.blocks if b.ref_cnt == 0 and b is not target]
    kv.pool.touch(others)
    assert kv.pool.get_new_blocks(1) == [target] and target.block_hash is None
    kv.pool.free_blocks([target, *others])
    # A query at 60 would need sliding blocks 13 and 14; one at 56 needs 12 and 13.
    hits, n = kv.get_computed_blocks(Req("d", [*shared, 5]))
    assert n == 56 and len(hits[1]) == 14 and None not in hits[1]
    assert hits[0][:12] == [None] * 12 and None not in hits[0][12:]


def _sliding_key(tokens: list[int], index: int) -> bytes:
    h = b""
    for i in range(index + 1):
        h = hash_block(h, tokens[i * BS:(i + 1) * BS])
    return h


def test_random_workload_keeps_every_hit_exact_and_the_pool_consistent():
    """Requests sharing prefixes, in random chunks, under a pool small enough to evict; a
    slow record of what each physical block holds checks every prefix hit."""
    rng = random.Random(0)
    kv = _manager(48)
    holds: dict[int, tuple[int, bytes]] = {}  # block id -> (group, hash of its tokens)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    running: list[Req] = []
    for step in range(400):
        if len(running) < 3 and rng.random() < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
            req = Req(f"r{step}", tokens)
            hits, n = kv.get_computed_blocks(req)
            hashes = req.block_hashes
            for g, table in enumerate(hits):
                window = kv.windows[g]
                first = first_needed_block(n, window, BS)
                assert all(b is not None for b in table[first:])
                for i, b in enumerate(table):
                    if b is not None:
                        assert holds.get(b.block_id) == (g, hashes[i]), "a hit on stale KV"
            if kv.allocate_slots(req, min(req.num_tokens - n, 12), hits) is None:
                continue
            req.num_computed_tokens = n
            running.append(req)
            _record(kv, req, holds, min(req.num_tokens, n + 12))
            req.num_computed_tokens = min(req.num_tokens, n + 12)
        for req in list(running):
            if req.num_computed_tokens >= req.num_tokens or rng.random() < 0.05:
                kv.free(req)
                running.remove(req)
                continue
            k = min(req.num_tokens - req.num_computed_tokens, rng.randint(1, 12))
            if kv.allocate_slots(req, k) is None:
                kv.free(req)
                running.remove(req)
                continue
            _check_held(kv, req, req.num_computed_tokens + k)
            _record(kv, req, holds, req.num_computed_tokens + k)
            req.num_computed_tokens += k
        kv.check_integrity()
    for req in running:
        kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_decodes_within_their_blocks_take_nothing_and_hand_out_the_same_ids():
    """Without windows, a request that grows within the blocks it holds gets no block (the
    fast path); at a block's end it gets one, or None when the pool is dry. The block ids
    handed out each step are the tables' own, and a caller's copy is its own."""
    kv = KVCacheManager(6, BS)
    reqs = [Req(name, list(range(40))) for name in "ab"]
    for req in reqs:
        assert len(kv.allocate_slots(req, 5)) == 2  # 5 tokens: blocks of 4
        req.num_computed_tokens = 5
    got = []
    for _ in range(8):
        for req in reqs:
            new = kv.allocate_slots(req, 1)
            got.append(None if new is None else len(new))
            if new is not None:
                req.num_computed_tokens += 1
            kv.check_integrity()
    # Tokens 6..8 fit the second block; the 9th takes a third each (6 blocks in all);
    # 10..12 fit it; the 13th finds the pool dry and changes nothing.
    assert got == [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, None, None]
    again = [kv.allocate_slots(req, 1) for req in reqs]
    assert again == [None, None] and kv.num_free_blocks == 0
    kv.check_integrity()
    ids = kv.get_block_ids("a")
    ids[0].append(99)
    assert kv.get_block_ids("a") == [[b.block_id for b in kv._req_blocks["a"][0]]]
    for req in reqs:
        kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 6 and kv.get_block_ids("a") == [[]]


def _record(kv: KVCacheManager, req: Req, holds: dict, end: int) -> None:
    """The step computes tokens up to ``end``: their blocks now hold them (a block written
    this step holds its tokens once full; partial ones hold nothing checkable)."""
    tables = kv._req_blocks[req.request_id]
    hashes = kv._block_hashes(req)
    for g, table in enumerate(tables):
        for i in range(req.num_computed_tokens // BS, -(-end // BS)):
            b = table[i]
            if b is None:
                continue
            if (i + 1) * BS <= end:
                holds[b.block_id] = (g, hashes[i])
            else:
                holds.pop(b.block_id, None)


def test_blocks_per_sequence_by_hand():
    groups = [KVCacheGroup((0,), None), KVCacheGroup((1,), 512)]
    assert blocks_per_sequence(groups, 8192, 16) == 512 + 512  # one step: every block
    # Decode (a step of one token): the window's 511 earlier keys and the new one span at
    # most 33 blocks.
    assert blocks_per_sequence(groups, 8192, 16, step_tokens=1) == 512 + 33
    assert blocks_per_sequence(groups, 100, 16, step_tokens=1) == 7 + 7


def test_spec_sizes_blocks_by_the_layers_they_hold():
    groups = tuple(group_layers(gemma_windows(18)))
    spec = KVCacheSpec(18, 1, 256, 16, 512, "bfloat16", groups)
    assert spec.layers_per_block == 3
    assert spec.bytes_per_block == 2 * 3 * 512 * 16
    assert spec.bytes_per_token == 2 * 18 * 512
    window = spec.bytes_per_sequence(8192, step_tokens=1)
    every = spec.bytes_per_sequence_without_windows(8192)
    assert every == 8192 * spec.bytes_per_token
    assert window == spec.bytes_per_block * (512 + 5 * 33)
    # The longest sequence that fits: the full group's blocks grow, the windows' do not.
    assert spec.max_sequence_tokens(1000, step_tokens=1) == (1000 - 5 * 33) * 16
    plain = KVCacheSpec(30, 3, 64, 16, 128)
    assert plain.max_sequence_tokens(100) == 1600 and not plain.has_windows
