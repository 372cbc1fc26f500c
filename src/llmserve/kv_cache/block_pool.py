"""A pool of fixed-size KV blocks: ref counts, a free queue in LRU order, a prefix-hash map.

A block with ref_cnt 0 sits in the free queue. If it is full and was hashed, it also stays in
the hash map: a later request with the same prefix can take it back (a prefix-cache hit)
until it is evicted, which happens only when it reaches the head of the free queue and is
handed out as a new block. Requests free their blocks tail first, so a sequence's last
blocks are evicted before its first ones, which more requests share.

Where that leaves a choice, blocks are handed out to keep each sequence's blocks one after
another in the pool: the CPU attention reads a sequence's blocks in increasing addresses,
and fastest when they are consecutive (the hardware prefetcher runs on from one block into
the next: 64 decodes of ~640 tokens read in 0.83x the time of the tables the pool left when
it took every block from the head of the queue, BENCHMARKS.md). A sequence grows into the
block after its last one where that block is free and uncached (`get_new_blocks`'
``after``), and a new run of blocks leaves the free uncached blocks above it for its
sequence to grow into (``room``): they go to the tail of the queue, so that others take
them last, but nobody holds them. Cached blocks keep their LRU order: taking one before its
turn evicts a prefix while older ones stay, and the run after it in the pool is another
prefix's (in a simulated multi-turn chat load that cost a fifth of the prefix-cache hits).
So a fresh pool, or one larger than the load cycles through, keeps tables in runs; a pool
whose free blocks are all cached hands out its head, as LRU says, each call's blocks in
increasing order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # LRU order: head is evicted first. OrderedDict gives O(1) removal from the middle.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int, after: int | None = None, room: int = 0) -> list[KVBlock]:
        """Take ``n`` free blocks, evicting their cached hashes.

        ``after``: the id of the caller's last block; the free, uncached blocks right after
        it come first. The rest come from the head of the free queue (LRU), in increasing
        order: a finished sequence's blocks sit there as it freed them, last first, and the
        CPU attention reads decreasing addresses 1.2-1.4x slower. ``room``: how many more
        blocks the caller expects to grow into; where these blocks do not continue
        ``after``, the up to ``room`` free, uncached blocks after the last of them (to the
        first other one) move to the tail of the queue, so that other sequences take them
        last. Nobody holds them: when the queue runs short they are handed out as any
        other free block."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = [] if after is None else self._take_uncached_run(after + 1, n)
        continued = bool(out)
        head = [self._take(self._free.popitem(last=False)[1]) for _ in range(n - len(out))]
        out += sorted(head, key=lambda block: block.block_id)
        if room and out and not continued:
            last = out[-1].block_id
            for block_id in range(last + 1, min(last + 1 + room, self.num_blocks)):
                if not self._free_and_uncached(block_id):
                    break
                self._free.move_to_end(block_id)
        return out

    def _take_uncached_run(self, start: int, limit: int) -> list[KVBlock]:
        """Blocks ``start``, ``start`` + 1, ... while free and uncached, up to ``limit``."""
        out = []
        for block_id in range(start, min(start + limit, self.num_blocks)):
            if not self._free_and_uncached(block_id):
                break
            out.append(self._take(self._free.pop(block_id)))
        return out

    def _free_and_uncached(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.ref_cnt == 0 and block.block_hash is None

    def _take(self, block: KVBlock) -> KVBlock:
        """A block out of the free queue, handed out: its hash evicted, one reference."""
        self._evict(block)
        block.ref_cnt = 1
        return block

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Record a full block under its hash; a block already cached keeps its first hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # the same content is cached in another block already
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 go to the tail of the free queue,
        in the order given (pass a sequence's blocks last-first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free), "duplicate block in free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
            in_free = block.block_id in free_ids
            assert in_free == (block.ref_cnt == 0), f"free queue disagrees with ref count: {block}"
        for h, block in self._cached.items():
            assert block.block_hash == h, f"hash map entry does not match block: {block}"
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_use + len(self._free) == self.num_blocks, "free + in use != total"
