"""A pool of fixed-size KV blocks: ref counts, a free queue in LRU order, a prefix-hash map.

A block with ref_cnt 0 sits in the free queue. If it is full and was hashed, it also stays in
the hash map: a later request with the same prefix can take it back (a prefix-cache hit)
until it is evicted, which happens when it is handed out as a new block: from the head of the
free queue, or out of turn from the queue's older half (below). Requests free their blocks
tail first, so a sequence's last blocks are evicted before its first ones, which more
requests share.

Blocks are handed out to keep each sequence's blocks one after another in the pool where
they can be: the CPU attention reads a sequence's blocks in increasing addresses, and reads
them fastest when they are consecutive (the hardware prefetcher runs on from one block into
the next: 64 decodes of ~640 tokens read in 0.83-0.85x the time of the tables the pool left
when it took every block from the head of the queue, BENCHMARKS.md). So a sequence grows
into the block after its last one where that block is free (`get_new_blocks`' ``after``), a
new run of blocks starts at the bottom of the free blocks around the queue's head, and
leaves the free blocks above it for its sequence to grow into (``room``). All of it only
chooses among free blocks: nothing is held that another request could need, and a cached
block is taken before its turn only from the older half of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
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
        # When each block last entered the free queue (a count of entries): blocks are taken
        # out of LRU order only from the older part of the queue (`get_new_blocks`).
        self._clock = num_blocks
        self._freed_at = list(range(num_blocks))

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
        """Take ``n`` free blocks, evicting their cached hashes, in runs of consecutive ids.

        ``after``: the id of the caller's last block; the blocks right after it come first,
        as long as they are free and uncached or old (see below). The rest come in runs of
        old blocks around the head of the free queue (the least recently used block), each
        from the lowest of the old free blocks just below the head: a finished sequence's
        blocks sit at the head as it freed them, last first, and the next sequence takes
        them from the bottom up, in increasing order (the CPU attention reads decreasing
        addresses 1.2-1.4x slower). ``room``: how many more blocks the caller expects to
        grow into; a new run leaves that many free blocks above it (uncached or old ones,
        moved to the tail of the queue so that others take them last, but neither held nor
        evicted before they are taken: the cached ones keep their age, so that the
        caller's growth can still take them).

        Old: among the older half of the free queue, or the first ``n`` + ``room`` blocks to
        enter it (by when blocks entered it): a prefix freed lately is not evicted before
        older ones, and room left for a sequence (which entered the queue last) is not
        taken for another."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        if n == 0:
            return []
        out = []
        if after is not None:
            before = self._old_before(n + room)
            out = self._take_run(after + 1, n, lambda block: self._growable(block, before))
        continued = bool(out)
        while len(out) < n:
            out += self._new_run(n - len(out), room)
            continued = False
        if room and not continued and self._free:
            self._leave_room(out[-1].block_id, room)
        return out

    def _new_run(self, want: int, room: int) -> list[KVBlock]:
        """Up to ``want`` old blocks in a row from the lowest of the old free blocks just
        below the head of the queue (at most ``want`` + ``room`` - 1 below it); at least
        the head."""
        before = self._old_before(want + room)  # the head is always old
        head = next(iter(self._free))
        start = head
        while (start > 0 and head - start + 1 < want + room
               and self._old(self.blocks[start - 1], before)):
            start -= 1
        return self._take_run(start, want, lambda block: self._old(block, before))

    def _leave_room(self, last: int, room: int) -> None:
        """Move the up to ``room`` blocks after block ``last`` that it could grow into (to
        the first other one) to the tail of the free queue."""
        before = self._old_before(room)
        for block_id in range(last + 1, min(last + 1 + room, self.num_blocks)):
            block = self.blocks[block_id]
            if not self._growable(block, before):
                break
            self._free.move_to_end(block_id)
            if block.block_hash is None:
                self._stamp(block)  # recent: not old, so no other run starts on it

    def _take_run(self, start: int, limit: int,
                  allowed: Callable[[KVBlock], bool]) -> list[KVBlock]:
        """Blocks ``start``, ``start`` + 1, ... while ``allowed``, up to ``limit``."""
        out = []
        for block_id in range(start, min(start + limit, self.num_blocks)):
            block = self.blocks[block_id]
            if not allowed(block):
                break
            del self._free[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _old_before(self, count: int) -> int:
        """Blocks that entered the free queue before this count are old: the older half of
        the queue, or its first ``count`` entries."""
        oldest = self._freed_at[next(iter(self._free))]
        return oldest + max((self._clock - oldest) // 2, count)

    def _old(self, block: KVBlock, before: int) -> bool:
        return block.ref_cnt == 0 and self._freed_at[block.block_id] < before

    def _growable(self, block: KVBlock, before: int) -> bool:
        """Free, and uncached (as room left for a sequence is) or old."""
        return block.ref_cnt == 0 and (block.block_hash is None or self._old(block, before))

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
                self._stamp(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._evict(block)

    def _stamp(self, block: KVBlock) -> None:
        self._freed_at[block.block_id] = self._clock
        self._clock += 1

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
