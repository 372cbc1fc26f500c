"""The scheduler's view of the KV cache: which blocks each request holds, prefix hits.

Pure bookkeeping, no tensors: the runner owns the KV tensors and reads the block ids this
manager hands out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from llmserve.kv_cache.block_pool import BlockPool, KVBlock


class CachedRequest(Protocol):
    """What the manager reads of a request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]
    cache_salt: str | None

    @property
    def num_tokens(self) -> int: ...


def hash_block(parent: bytes, token_ids: Sequence[int], extra: str | None = None) -> bytes:
    """Content hash of one full block: the parent block's hash, its tokens, extra keys."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra.encode())
    return h.digest()[:16]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_num_hashed: dict[str, int] = {}
        # Prefix-cache statistics in tokens, as vLLM counts them.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: CachedRequest) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks that starts the request's tokens.

        At least one token is always left to compute, so the step that finishes the prompt
        produces logits to sample from.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (retries of a request that did not fit are
        not counted twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: CachedRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if it cannot.

        1. Blocks needed = blocks to cover computed + new tokens, minus blocks held.
        2. Prefix-hit blocks with ref_cnt 0 sit in the free queue; taking them shrinks what
           is left for new blocks, so they are counted against the free blocks first.
        3. Blocks that will be full after this step are hashed and cached now: the step that
           fills them always runs, and in each layer keys are written before attention reads.
        """
        rid = request.request_id
        blocks = self._req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self._req_blocks[rid]
            return None
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return new_blocks

    def free(self, request: CachedRequest) -> None:
        """Release every block of the request, last block first (evicted first)."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_num_hashed.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

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
        """Pool invariants, plus: each block's ref count equals the requests that hold it."""
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        for blocks in self._req_blocks.values():
            holders.update(b.block_id for b in blocks)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block}: held by {holders[block.block_id]} requests")

    def _cache_full_blocks(self, request: CachedRequest, blocks: list[KVBlock],
                           num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self._req_num_hashed.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
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
