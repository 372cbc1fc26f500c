"""Paged attention by a compiled CPU kernel that reads the KV cache blocks in place.

No gather, no padding, no mask: each query row walks its own sequence's block table over
keys ``0..position``, or with a sliding window only the last ``window`` of them, never
reading a block that lies wholly before it (see ``csrc/paged_attention.cpp``). A row's
arithmetic is a fixed sequence of operations that depends only on its own context, so the
result is the same alone, in any batch, in any prefill chunk and after preemption. Work is
split over (sequence, tile of query rows, KV head, segment of 512 keys) across the CPU's
threads: a row of a longer context leaves partial sums per segment, merged in segment order
(flash-decoding), so that one long sequence spreads over every thread too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmserve.attention.backend import BatchLayout, Rope, register_attention_backend
from llmserve.attention.kv_format import PagedKVCache
from llmserve.csrc import cpu_ops


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    query_start: torch.Tensor  # [B + 1] int64
    positions: torch.Tensor  # [T] int64


@register_attention_backend("cpu_paged")
class CpuPagedBackend:
    name = "cpu_paged"

    def __init__(self) -> None:
        ops = cpu_ops()
        if ops is None:
            raise RuntimeError("the cpu_paged attention backend needs the compiled CPU "
                               "kernels (a C++ compiler; LLMSERVE_CPU_KERNELS not 0)")
        self._ops = ops

    def build_metadata(self, layout: BatchLayout) -> CpuPagedMetadata:
        starts = [0]
        for n in layout.query_lens:
            starts.append(starts[-1] + n)
        query_start = torch.tensor(starts, dtype=torch.int64)
        return CpuPagedMetadata(layout.slot_mapping, layout.block_tables.contiguous(),
                                query_start, layout.positions)

    def allocate_kv_cache(self, name: str, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int,
                          device: torch.device) -> PagedKVCache:
        return PagedKVCache.allocate(name, num_blocks, block_size, num_kv_heads, head_dim,
                                     device)

    def rebind(self, metadata: CpuPagedMetadata, layout: BatchLayout) -> CpuPagedMetadata:
        return replace(metadata, slot_mapping=layout.slot_mapping,
                       block_tables=layout.block_tables.contiguous())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: PagedKVCache, metadata: CpuPagedMetadata,
                scale: float, window: int | None = None,
                rope: Rope | None = None) -> torch.Tensor:
        if rope is not None:
            q, k = rope.apply(q, k)
        max_code = kv_cache.max_code or 0.0
        slots = metadata.slot_mapping
        self._ops.store_kv(k, kv_cache.key, kv_cache.key_scale, slots, max_code, True)
        self._ops.store_kv(v, kv_cache.value, kv_cache.value_scale, slots, max_code, False)
        return self._ops.paged_attention(q, kv_cache.key, kv_cache.value, kv_cache.key_scale,
                            kv_cache.value_scale, metadata.block_tables, metadata.query_start,
                            metadata.positions, scale, window or 0)
