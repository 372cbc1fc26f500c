"""The block pool's placement simulated through the KV cache manager alone (no model, no
tensors): how often block tables jump, and the prefix cache's hit rate, for the pool as it
is against every block from the head of the free queue (the LRU order alone, the pool
before session 43). Deterministic (seeded); runs in seconds.

- Jumps: 64 requests at a time of 50-600 prompt and 20-600 output tokens, half stopping
  early, blocks of 32; the mean number of places where a table's next block is not the one
  after, sampled every 100 steps after the first 1,000.
- Hits: 16 chats at a time over 60 conversations (each turn's prompt is its conversation's
  history after a shared 96-token system prompt, plus a new message), blocks of 16.

    .venv/bin/python benchmarks/block_pool_sim.py
"""

from __future__ import annotations

import itertools
import random
import statistics

from llmserve.kv_cache import BlockPool, KVCacheManager
from llmserve.kv_cache.block_pool import KVBlock


class HeadOnlyPool(BlockPool):
    """Every block from the head of the free queue, each call's in increasing order."""

    def get_new_blocks(self, n: int, after: int | None = None, room: int = 0) -> list[KVBlock]:
        return super().get_new_blocks(n)


class Req:
    """The request fields the manager reads."""

    def __init__(self, rid: str, tokens: list[int], max_tokens: int, stop: int) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_prompt_tokens = len(tokens)
        self.max_tokens = max_tokens
        self.stop = stop  # output tokens before it ends (an EOS, or max_tokens)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.cache_salt = None
        self.conversation = -1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def done(self) -> bool:
        return self.num_computed_tokens - self.num_prompt_tokens >= self.stop


def jumps(pool: BlockPool, steps: int = 6000, seed: int = 0) -> float:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=pool.num_blocks, block_size=32)
    kv.pool = pool
    running: list[Req] = []
    samples = []
    for step in range(steps):
        while len(running) < 64:
            max_tokens = rng.randrange(20, 600)
            stop = max_tokens if rng.random() < 0.5 else rng.randrange(1, max_tokens + 1)
            r = Req(f"r{step}-{len(running)}",
                    [rng.randrange(50000) for _ in range(rng.randrange(50, 600))],
                    max_tokens, stop)
            if kv.allocate_slots(r, r.num_tokens) is None:
                break
            r.num_computed_tokens = r.num_tokens
            running.append(r)
        for r in list(running):
            if r.done() or kv.allocate_slots(r, 1) is None:  # no room: dropped, as preempted
                kv.free(r)
                running.remove(r)
                continue
            r.all_token_ids.append(rng.randrange(50000))
            r.num_computed_tokens += 1
        if step % 100 == 99 and step > 1000:
            for r in running:
                table = kv.get_block_ids(r.request_id)[0]
                samples.append(sum(b != a + 1 for a, b in itertools.pairwise(table)))
    kv.check_integrity()
    return statistics.mean(samples)


def hit_rate(pool: BlockPool, steps: int = 4000, seed: int = 0) -> float:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=pool.num_blocks, block_size=16)
    kv.pool = pool
    system = [rng.randrange(1000) for _ in range(96)]
    history = {c: system + [rng.randrange(1000) for _ in range(rng.randrange(20, 100))]
               for c in range(60)}
    running: list[Req] = []
    for step in range(steps):
        while len(running) < 16:
            busy = {r.conversation for r in running}
            conversation = rng.choice([c for c in history if c not in busy])
            prompt = history[conversation] + [rng.randrange(1000)
                                              for _ in range(rng.randrange(10, 60))]
            if len(prompt) > 1500:
                prompt = system + prompt[-200:]
            max_tokens = rng.randrange(20, 200)
            r = Req(f"r{step}-{len(running)}", prompt, max_tokens,
                    rng.randrange(10, max_tokens + 1))
            r.conversation = conversation
            hits, num_hit = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, len(prompt) - num_hit, hits) is None:
                break
            kv.record_prefix_lookup(len(prompt), num_hit)
            r.num_computed_tokens = len(prompt)
            running.append(r)
        for r in list(running):
            if r.done():
                history[r.conversation] = list(r.all_token_ids)
            if r.done() or kv.allocate_slots(r, 1) is None:
                kv.free(r)
                running.remove(r)
                continue
            r.all_token_ids.append(rng.randrange(1000))
            r.num_computed_tokens += 1
    kv.check_integrity()
    return kv.prefix_hits / kv.prefix_queries


def main() -> None:
    print("| pool blocks | jumps a table: head only | now |\n|---|---|---|")
    for blocks in (2048, 5482, 20000):
        print(f"| {blocks} | {jumps(HeadOnlyPool(blocks)):.1f} | {jumps(BlockPool(blocks)):.1f} |",
              flush=True)
    print("\n| pool blocks | prefix hit rate: head only | now |\n|---|---|---|")
    for blocks in (512, 1024, 2048):
        print(f"| {blocks} | {hit_rate(HeadOnlyPool(blocks)):.3f} | "
              f"{hit_rate(BlockPool(blocks)):.3f} |", flush=True)


if __name__ == "__main__":
    main()
