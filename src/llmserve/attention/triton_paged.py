"""Paged attention on the GPU: Triton kernels over a KV layout of their own.

The cache of one layer is ``[blocks, block_size, Hkv, D]`` for keys and for values (a
token's heads side by side, each head's vector contiguous: what a kernel tile of keys
loads as rows), in bfloat16, float16, float32 or fp8 (e4m3, with one float32 scale per
token and KV head, as on CPU). New keys and values are written by slot with one indexed
copy each, which CUDA graphs capture.

Attention itself is ``triton_kernels.paged_attention_kernel``: prefill chunks, decodes and
speculative verification rows in one launch, each query tile reading only the blocks its
rows can see; contexts longer than ``SEGMENT`` keys are split over programs (split-K) and
folded by a second kernel. The kernels' docstring says why a row gets the same bits alone
and in any batch. This module imports Triton on construction only: the CPU backends never
need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from llmserve.attention.backend import BatchLayout, Rope, register_attention_backend
from llmserve.attention.kv_format import GPU_ONLY_KV_CACHE_DTYPES, KV_CACHE_DTYPES
from llmserve.layers.gpu_kernels import gpu_ops_for

SEGMENT = 512  # keys per split-K segment
BLOCK_N = 64  # keys per tile
BLOCK_M = 64  # query rows per program: BLOCK_Q tokens x the query heads of one KV head
WARPS = 4  # per program of the attention kernel
STAGES = 3  # of its key loop's software pipeline (Triton's default)
# The key loop loads tile i + 1 before it attends tile i (``paged_attention_kernel``'s
# PREFETCH; the same arithmetic); False leaves the loads to Triton's pipeliner. Not for a
# scaled (fp8) cache: its scales and dequantized values take the registers (sm_90: 254 a
# thread, and spills). Read at call time.
PREFETCH = True
# The rotary and the KV store in one kernel (``triton_ops.rotary_and_store_kv``) where the
# cache is stored as is; False: the rotary's kernel, then the store's. Read at call time.
ROPE_STORE = True
assert SEGMENT % BLOCK_N == 0, "a segment is whole key tiles"

# name -> (storage dtype, largest code for scaled formats, or None when stored as is)
GPU_KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, float | None]] = {
    name: spec for name, spec in {**KV_CACHE_DTYPES, **GPU_ONLY_KV_CACHE_DTYPES}.items()
    if name != "int8"  # the CPU kernel's format
}


@dataclass
class TritonKVCache:
    """One layer's cache in the GPU layout (see the module docstring)."""

    key: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value: torch.Tensor
    key_scale: torch.Tensor | None  # [num_blocks, block_size, Hkv] float32
    value_scale: torch.Tensor | None
    max_code: float | None

    @classmethod
    def allocate(cls, name: str, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device) -> TritonKVCache:
        if name not in GPU_KV_CACHE_DTYPES:
            raise ValueError(f"the triton_paged backend stores the KV cache as one of "
                             f"{sorted(GPU_KV_CACHE_DTYPES)}, not {name!r}")
        dtype, max_code = GPU_KV_CACHE_DTYPES[name]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        scales = (None, None) if max_code is None else tuple(
            torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(2))
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), *scales, max_code)

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key.shape[3]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` [T, Hkv, D] at cache slots ``slots`` [T] int64."""
        gpu = gpu_ops_for(k)
        if self.key_scale is None and gpu is not None:
            gpu.store_kv(k, v, self.key, self.value, slots)
            return
        for cache, scales, x in ((self.key, self.key_scale, k), (self.value, self.value_scale, v)):
            flat = cache.view(-1, self.num_kv_heads, self.head_dim)
            if scales is None:
                flat.index_copy_(0, slots, x.to(cache.dtype))
                continue
            x = x.float()
            s = x.abs().amax(dim=-1).clamp_(min=torch.finfo(torch.float32).tiny)
            s.div_(self.max_code)  # [T, Hkv]
            codes = (x / s.unsqueeze(-1)).to(cache.dtype)
            # As bytes: index_copy_ has no float8 kernel.
            flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
            scales.view(-1, self.num_kv_heads).index_copy_(0, slots, s)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` as float32 [n, Hkv, D] (for tests and checks)."""
        out = []
        for cache, scales in ((self.key, self.key_scale), (self.value, self.value_scale)):
            x = cache.view(-1, self.num_kv_heads, self.head_dim)[slots].float()
            if scales is not None:
                x = x * scales.view(-1, self.num_kv_heads)[slots].unsqueeze(-1)
            out.append(x)
        return out[0], out[1]


@dataclass
class TritonPagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int32: context after this step
    query_start: torch.Tensor  # [B + 1] int32
    positions: torch.Tensor  # [T] int64
    query_lens: list[int]
    num_segments: int  # the grid's third dimension
    split: bool  # partials and a fold (always for contexts past one segment)
    # With split: each token's first entry of partials (a token at position p has
    # p // SEGMENT + 1 of them), and the entries of the whole step.
    part_start: torch.Tensor | None = None  # [T] int32
    part_entries: int = 0
    # Query tiles per tokens-per-tile: (tile -> sequence, tile -> first token, count).
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)

    def tiles_for(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if block_q not in self.tiles:
            seqs, firsts, start = [], [], 0
            for b, n in enumerate(self.query_lens):
                for first in range(start, start + n, block_q):
                    seqs.append(b)
                    firsts.append(first)
                start += n
            both = torch.tensor([seqs, firsts], dtype=torch.int32).to(self.positions.device)
            self.tiles[block_q] = (both[0], both[1], len(seqs))
        return self.tiles[block_q]


@register_attention_backend("triton_paged")
class TritonPagedBackend:
    name = "triton_paged"

    def __init__(self) -> None:
        try:
            from llmserve.attention import triton_kernels
        except ImportError as e:
            raise RuntimeError(f"the triton_paged attention backend needs Triton ({e})"
                               ) from None
        self._kernels = triton_kernels

    def allocate_kv_cache(self, name: str, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int,
                          device: torch.device) -> TritonKVCache:
        return TritonKVCache.allocate(name, num_blocks, block_size, num_kv_heads, head_dim,
                                      device)

    def build_metadata(self, layout: BatchLayout) -> TritonPagedMetadata:
        starts = [0]
        for n in layout.query_lens:
            starts.append(starts[-1] + n)
        num_b = len(layout.seq_lens)
        num_segments = -(-max(layout.seq_lens) // SEGMENT)
        host = torch.tensor(layout.seq_lens + starts, dtype=torch.int32)
        part_entries = 0
        if num_segments > 1:  # each token's partials where the previous token's end
            positions = torch.cat([torch.arange(s - n, s, dtype=torch.int32)
                                   for n, s in zip(layout.query_lens, layout.seq_lens)])
            entries = positions // SEGMENT + 1
            part_entries = int(entries.sum())
            host = torch.cat([host, torch.cumsum(entries, 0, dtype=torch.int32) - entries])
        # One transfer: sequence lengths, query starts, and the partials' starts.
        ints = host.to(layout.positions.device)
        return TritonPagedMetadata(
            layout.slot_mapping, layout.block_tables, ints[:num_b], ints[num_b:2 * num_b + 1],
            layout.positions, list(layout.query_lens), num_segments, num_segments > 1,
            ints[2 * num_b + 1:] if num_segments > 1 else None, part_entries)

    def build_graph_metadata(self, layout: BatchLayout, seq_lens: torch.Tensor,
                             max_seq_len: int) -> TritonPagedMetadata:
        """Metadata of a decode batch (one query per sequence) whose tensors are a CUDA
        graph's static inputs: ``seq_lens`` is filled before each replay, and the grid
        covers ``max_seq_len`` keys (segments past a row's context do nothing; within one
        segment, there is no split)."""
        num_b = len(layout.query_lens)
        device = layout.positions.device
        arange = torch.arange(num_b + 1, dtype=torch.int32, device=device)
        num_segments = -(-max_seq_len // SEGMENT)
        split = num_segments > 1
        # Every row may reach every segment: num_segments entries of partials each.
        meta = TritonPagedMetadata(layout.slot_mapping, layout.block_tables, seq_lens,
                                   arange, layout.positions, [1] * num_b, num_segments, split,
                                   arange[:num_b] * num_segments if split else None,
                                   num_b * num_segments if split else 0)
        block_q = BLOCK_M
        while block_q >= 1:  # one tile per sequence whatever the tile's tokens
            meta.tiles[block_q] = (arange[:num_b], arange[:num_b], num_b)
            block_q //= 2
        return meta

    @staticmethod
    def graph_context_limits(max_seq_len: int) -> list[int]:
        """The context limits worth a decode graph each (``runner/cuda_graphs.py``): one
        segment, attended without the split and its fold, and ``max_seq_len``."""
        return sorted({min(SEGMENT, max_seq_len), max_seq_len})

    def rebind(self, metadata: TritonPagedMetadata, layout: BatchLayout) -> TritonPagedMetadata:
        return replace(metadata, slot_mapping=layout.slot_mapping,
                       block_tables=layout.block_tables)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: TritonKVCache, metadata: TritonPagedMetadata,
                scale: float, window: int | None = None,
                rope: Rope | None = None) -> torch.Tensor:
        q = self._rotate_and_store(q, k, v, kv_cache, metadata, rope)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.num_kv_heads
        group = num_heads // num_kv_heads
        group_p = _pow2(group)
        block_q = max(1, BLOCK_M // group_p)
        head_p = max(16, _pow2(head_dim))
        tile_seq, tile_first, num_tiles = metadata.tiles_for(block_q)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = q.new_empty(num_tokens, num_heads, head_dim)
        nseg = metadata.num_segments
        if metadata.split:
            entries = metadata.part_entries
            part_m = torch.empty(entries, num_heads, dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty(entries, num_heads, head_p, dtype=torch.float32,
                                   device=q.device)
            part_start = metadata.part_start
        else:
            part_m = part_l = part_acc = part_start = out  # unused
        scaled = kv_cache.key_scale is not None
        k_scale = kv_cache.key_scale if scaled else kv_cache.key
        v_scale = kv_cache.value_scale if scaled else kv_cache.value
        key, value = kv_cache.key, kv_cache.value
        kern = self._kernels
        launch = kern.pdl_launch(kern.pdl_for(q))
        kern.paged_attention_kernel[(num_tiles, num_kv_heads, nseg)](
            q, key, value, k_scale, v_scale,
            metadata.block_tables, metadata.seq_lens, metadata.query_start, tile_seq,
            tile_first, out, part_m, part_l, part_acc, part_start,
            scale, window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            num_kv_heads * kv_cache.block_size if scaled else 0, num_kv_heads if scaled else 0,
            metadata.block_tables.stride(0), num_heads,
            GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, HEAD_DIM=head_dim, HEAD_P=head_p,
            BLOCK_SIZE=kv_cache.block_size, BLOCK_N=BLOCK_N, SEGMENT=SEGMENT, SCALED=scaled,
            WINDOWED=window is not None, SPLIT=metadata.split, UPCAST=kern.INTERPRETED,
            PREFETCH=PREFETCH and not scaled, num_warps=WARPS, num_stages=STAGES, **launch)
        if metadata.split:
            kern.combine_segments_kernel[(num_tokens, num_heads)](
                metadata.positions, part_m, part_l, part_acc, part_start, out, window or 0,
                num_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, HEAD_P=head_p, SEGMENT=SEGMENT,
                WINDOWED=window is not None, **launch)
        return out.view(num_tokens, num_heads * head_dim)

    @staticmethod
    def _rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: TritonKVCache, metadata: TritonPagedMetadata,
                          rope: Rope | None) -> torch.Tensor:
        """The step's rotary, and its keys and values into the cache: one kernel on a GPU
        where the cache needs no scales, else one after the other. Returns the rotated q."""
        gpu = gpu_ops_for(k)
        if (rope is not None and ROPE_STORE and gpu is not None
                and kv_cache.key_scale is None
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
            gpu.rotary_and_store_kv(q, k, v, rope.positions, *rope.rotary.kernel_tables(),
                                    kv_cache.key, kv_cache.value, metadata.slot_mapping)
            return q
        if rope is not None:
            q, k = rope.apply(q, k)
        kv_cache.store(metadata.slot_mapping, k, v)
        return q


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
