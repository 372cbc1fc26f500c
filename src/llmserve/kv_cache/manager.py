"""The scheduler's view of the KV cache: which blocks each request holds, prefix hits.

Pure bookkeeping, no tensors: the runner owns the KV tensors and reads the block ids this
manager hands out. A request holds one block table per KV cache group (see ``groups``);
in a sliding-window group, the entries its window can no longer reach are released to the
pool (as ``None``, read as block 0, which the attention kernels never touch there).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from llmserve.kv_cache.block_pool import BlockPool, KVBlock
from llmserve.kv_cache.groups import KVCacheGroup, first_needed_block

# One request's blocks: a table per group, ``None`` where a sliding window released one.
BlockTables = list[list[KVBlock | None]]

# How far past a request's blocks the pool leaves free blocks for it to grow into, where it
# starts a new run of blocks (`BlockPool.get_new_blocks`' room): the rest of its prompt and
# its max_tokens, up to this many tokens.
GROWTH_TOKENS = 1024


class CachedRequest(Protocol):
    """What the manager reads of a request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]
    cache_salt: str | None
    max_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


def hash_block(parent: bytes, token_ids: Sequence[int], extra: str | None = None) -> bytes:
    """Content hash of one full block: the parent block's hash, its tokens, extra keys."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra.encode())
    return h.digest()[:16]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroup] | None = None) -> None:
        """``groups``: the model's KV cache groups (None: one group without a window)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = [g.window for g in groups] if groups else [None]
        self._no_windows = all(w is None for w in self.windows)
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, BlockTables] = {}
        # The same tables as block ids (0 where released), kept beside them: every decode
        # step hands each running request's out (``get_block_ids``).
        self._req_block_ids: dict[str, list[list[int]]] = {}
        self._req_num_hashed: dict[str, int] = {}
        # Prefix-cache statistics in tokens, as vLLM counts them.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (0 where a window released a block)."""
        ids = self._req_block_ids.get(request_id)
        if ids is None:
            return [[] for _ in self.windows]
        return [list(group) for group in ids]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, over all groups."""
        return sum(self.held_blocks(request_id))

    def held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds now in each group."""
        tables = self._req_blocks.get(request_id)
        if tables is None:
            return [0] * self.num_groups
        return [sum(b is not None for b in blocks) for blocks in tables]

    def get_computed_blocks(self, request: CachedRequest) -> tuple[BlockTables, int]:
        """Longest cached prefix of the request's tokens that every group can resume from:
        per group, the blocks a query right after it can see (all of them in a full group,
        the window's last ones in a sliding group; ``None`` before that).

        At least one token is always left to compute, so the step that finishes the prompt
        produces logits to sample from.
        """
        empty: BlockTables = [[] for _ in self.windows]
        if not self.enable_caching:
            return empty, 0
        hashes = self._block_hashes(request)
        n = (request.num_tokens - 1) // self.block_size
        cached = []
        for g, window in enumerate(self.windows):
            cached.append([self.pool.get_cached_block(_key(h, g)) for h in hashes[:n]])
            if window is None:  # the hit ends at the group's first miss
                n = next((i for i, b in enumerate(cached[g]) if b is None), n)
        while n > 0 and not all(self._resumable(cached[g], n, w)
                                for g, w in enumerate(self.windows)):
            n -= 1
        if n == 0:
            return empty, 0
        bs = self.block_size
        hits = []
        for g, window in enumerate(self.windows):
            first = first_needed_block(n * bs, window, bs)
            hits.append([None] * first + cached[g][first:n])
        return hits, n * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (retries of a request that did not fit are
        not counted twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: CachedRequest, num_new_tokens: int,
                       new_computed_blocks: BlockTables | None = None) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; None if it cannot (then nothing
        changed but the release of step 1, which the request never needs again).

        1. In each sliding-window group, release the blocks before the first one the next
           query can see.
        2. Blocks needed = per group, the blocks from that first one up to the end of the
           computed + new tokens, minus those held (or taken as prefix hits).
        3. Prefix-hit blocks with ref_cnt 0 sit in the free queue; taking them shrinks what
           is left for new blocks, so they are counted against the free blocks first.
        4. Blocks that will be full after this step are hashed and cached now: the step that
           fills them always runs, and in each layer keys are written before attention reads.

        New blocks continue the request's table where the pool allows (the block after its
        last one); where they start a new run, they leave room after it for the rest of
        the prompt and max_tokens (see `BlockPool`).
        """
        rid = request.request_id
        bs = self.block_size
        tables = self._req_blocks.get(rid)
        if (tables and self._no_windows
                and (new_computed_blocks is None or not any(new_computed_blocks))):
            # Growing within the blocks it holds (a decode, 15 steps of 16): nothing to
            # release without a window, nothing to take; what follows would change nothing.
            total = request.num_computed_tokens + num_new_tokens
            if min(map(len, tables)) * bs >= total:
                full = min(total, request.num_tokens) // bs
                if self.enable_caching and full > self._req_num_hashed.get(rid, 0):
                    self._cache_full_blocks(request, tables, full * bs)
                return []
        hits = new_computed_blocks or [[] for _ in self.windows]
        tables = tables or [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + len(hits[0]) * bs
        total = num_computed + num_new_tokens
        end = -(-total // bs)
        firsts = [first_needed_block(num_computed, w, bs) for w in self.windows]
        for blocks, first in zip(tables, firsts):
            self._release_before(blocks, first)
        needed = sum(max(0, end - max(len(blocks) + len(hit), first))
                     for blocks, hit, first in zip(tables, hits, firsts))
        reclaimed = sum(1 for hit in hits for b in hit if b is not None and b.ref_cnt == 0)
        # Blocks the request will grow into after these: its prompt and max_tokens.
        final = min(request.num_prompt_tokens + request.max_tokens, total + GROWTH_TOKENS)
        room = max(0, -(-final // bs) - end)
        if needed > self.pool.num_free_blocks - reclaimed:
            if rid in self._req_block_ids:  # entries released above
                self._sync_ids(rid, tables)
            return None
        self._req_blocks[rid] = tables
        # Every group's hits leave the free queue before any new block is taken from it.
        self.pool.touch([b for hit in hits for b in hit if b is not None])
        new_blocks = []
        for blocks, hit, first in zip(tables, hits, firsts):
            blocks.extend(hit)
            if len(blocks) < first:  # never computed and already out of the window
                blocks.extend([None] * (first - len(blocks)))
            last = blocks[-1] if blocks else None
            fresh = self.pool.get_new_blocks(max(0, end - len(blocks)),
                                             after=None if last is None else last.block_id,
                                             room=room)
            blocks.extend(fresh)
            new_blocks.extend(fresh)
        self._sync_ids(rid, tables)
        if self.enable_caching:
            self._cache_full_blocks(request, tables, min(total, request.num_tokens))
        return new_blocks

    def free(self, request: CachedRequest) -> None:
        """Release every block of the request, last blocks first (evicted first)."""
        tables = self._req_blocks.pop(request.request_id, None)
        self._req_block_ids.pop(request.request_id, None)
        self._req_num_hashed.pop(request.request_id, None)
        if tables:
            longest = max(len(blocks) for blocks in tables)
            self.pool.free_blocks([blocks[i] for i in range(longest - 1, -1, -1)
                                   for blocks in tables
                                   if i < len(blocks) and blocks[i] is not None])

    def num_requests(self) -> int:
        return len(self._req_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten. Only while no
        request holds blocks (a running request's blocks stay shareable otherwise)."""
        if self._req_blocks:
            raise RuntimeError(f"{len(self._req_blocks)} requests hold KV blocks")
        count = self.pool.num_cached_blocks
        self.pool.reset_prefix_cache()
        return count

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the tables that hold it, and
        every table that holds a block holds it in the same group at the same index."""
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        places: dict[int, tuple[int, int]] = {}
        for tables in self._req_blocks.values():
            assert len(tables) == self.num_groups, f"{len(tables)} tables for {self.num_groups}"
            for g, blocks in enumerate(tables):
                for i, b in enumerate(blocks):
                    if b is None:
                        continue
                    holders[b.block_id] += 1
                    place = places.setdefault(b.block_id, (g, i))
                    assert place == (g, i), f"{b} held as (group, index) {place} and {(g, i)}"
        for rid, tables in self._req_blocks.items():
            want = [[0 if b is None else b.block_id for b in blocks] for blocks in tables]
            assert self._req_block_ids.get(rid) == want, f"{rid}: block ids out of step"
        assert self._req_block_ids.keys() == self._req_blocks.keys(), "block ids of others"
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block}: held by {holders[block.block_id]} tables")

    # ---- helpers ------------------------------------------------------------------------

    def _release_before(self, blocks: list[KVBlock | None], first: int) -> None:
        """Hand back the blocks before ``first``, last first (as ``free`` orders them)."""
        out = []
        for i in range(min(first, len(blocks)) - 1, -1, -1):
            if blocks[i] is None:
                break  # released by an earlier step, with everything before it
            out.append(blocks[i])
            blocks[i] = None
        if out:
            self.pool.free_blocks(out)

    def _sync_ids(self, rid: str, tables: BlockTables) -> None:
        self._req_block_ids[rid] = [[0 if b is None else b.block_id for b in blocks]
                                    for blocks in tables]

    def _resumable(self, cached: list[KVBlock | None], n: int, window: int | None) -> bool:
        """Whether a query at block ``n``'s first token finds every key it sees cached."""
        first = first_needed_block(n * self.block_size, window, self.block_size)
        return all(b is not None for b in cached[first:n])

    def _cache_full_blocks(self, request: CachedRequest, tables: BlockTables,
                           num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self._req_num_hashed.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for g, blocks in enumerate(tables):
            for i in range(start, num_full):
                if blocks[i] is not None:
                    self.pool.cache_block(blocks[i], _key(hashes[i], g))
        self._req_num_hashed[rid] = num_full

    def _block_hashes(self, request: CachedRequest) -> list[bytes]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs], request.cache_salt))
        return hashes


def _key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block in a group: the same tokens hold other layers' KV in
    another group."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
