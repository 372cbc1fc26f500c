"""A pool of fixed-size KV blocks: ref counts, a free queue in LRU order, a prefix-hash map.

A block with ref_cnt 0 sits in the free queue. If it is full and was hashed, it also stays in
the hash map: a later request with the same prefix can take it back (a prefix-cache hit)
until it is evicted, which happens only when it reaches the head of the free queue and is
handed out as a new block. Requests free their blocks tail first, so a sequence's last
blocks are evicted before its first ones, which more requests share.
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

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes;
        returned in increasing block order. The head often holds a finished sequence's
        blocks, freed last first: handed out as they sit, a new sequence would get them in
        decreasing order, and the CPU attention kernel reads a sequence's blocks in
        increasing addresses 1.2-1.4x faster than in decreasing ones (BENCHMARKS.md)."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=lambda block: block.block_id)
        return out

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
