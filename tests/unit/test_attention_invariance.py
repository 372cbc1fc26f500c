"""The paged attention backend: a sequence's output rows are bitwise the same alone and
batched with sequences of other lengths (which changes the padded key length of its group),
with SmolLM2's head layout (9 query heads over 3 KV heads of 64)."""

from __future__ import annotations

import torch

from llmserve.attention import get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.attention.kv_format import PagedKVCache

HQ, HKV, D, BS = 9, 3, 64, 16


def _run(seqs: list[tuple[int, int, list[int]]], cache: PagedKVCache,
         kv: dict[int, tuple[torch.Tensor, torch.Tensor]], q_all: dict[int, torch.Tensor]):
    """seqs: (seq id, tokens computed this step, block ids); context = all of seq's kv."""
    backend = get_attention_backend("torch_paged")
    query_lens, seq_lens, slots, positions, qs, ks, vs = [], [], [], [], [], [], []
    width = max(len(b) for _, _, b in seqs)
    tables = []
    for sid, n, blocks in seqs:
        k, v = kv[sid]
        total = k.shape[0]
        pos = torch.arange(total - n, total)
        query_lens.append(n)
        seq_lens.append(total)
        positions.append(pos)
        slots.append(torch.tensor(blocks)[pos // BS] * BS + pos % BS)
        qs.append(q_all[sid][-n:])
        ks.append(k[-n:])
        vs.append(v[-n:])
        tables.append(blocks + [0] * (width - len(blocks)))
        # the earlier context is already in the cache
        earlier = torch.arange(0, total - n)
        cache.store(torch.tensor(blocks)[earlier // BS] * BS + earlier % BS,
                    k[: total - n], v[: total - n])
    layout = BatchLayout(torch.cat(slots), torch.tensor(tables), torch.cat(positions),
                         query_lens, seq_lens, BS)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache,
                          backend.build_metadata(layout), D**-0.5)
    return out.split(query_lens)


def test_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    lengths = {0: 300, 1: 600, 2: 40, 3: 517}
    kv = {s: (torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen))
          for s, n in lengths.items()}
    q = {s: torch.randn(n, HQ, D, generator=gen) for s, n in lengths.items()}
    blocks, start = {}, 1
    for s, n in lengths.items():
        count = -(-n // BS)
        blocks[s] = list(range(start + count - 1, start - 1, -1))  # scattered, reversed
        start += count

    def cache() -> PagedKVCache:
        return PagedKVCache.allocate("float32", start, BS, HKV, D, torch.device("cpu"))

    for n_query in (1, 37):  # decode, and a prefill chunk
        alone = {s: _run([(s, n_query, blocks[s])], cache(), kv, q)[0] for s in lengths}
        batched = _run([(s, n_query, blocks[s]) for s in lengths], cache(), kv, q)
        for s, out in zip(lengths, batched):
            assert torch.equal(out, alone[s]), f"seq {s} ({lengths[s]} tokens), {n_query} rows"
        mixed = _run([(1, 37, blocks[1]), (0, 1, blocks[0]), (3, 1, blocks[3])], cache(), kv, q)
        assert torch.equal(mixed[1], _run([(0, 1, blocks[0])], cache(), kv, q)[0])
