"""Triton kernels of the ``triton_paged`` backend: paged attention over a block table.

One program attends a tile of ``BLOCK_M`` query rows (``BLOCK_Q`` tokens of one sequence
times the ``GROUP`` query heads that share one KV head) over one segment of ``SEGMENT``
keys, in tiles of ``BLOCK_N`` keys read through the sequence's block table, with an online
softmax in float32. Every row's arithmetic depends on its own position alone:

- key tiles start at fixed offsets (multiples of ``BLOCK_N`` from the segment's start), so
  a key meets the same others in its tile whatever the batch;
- a tile that holds none of a row's keys leaves that row's state exactly as it was
  (its maximum stays, its rescale factor is exp(0) = 1, it adds exact zeros), so a row
  batched with longer rows (a prefill chunk, a longer sequence) gets the same bits as alone;
- contexts longer than one segment are always split the same way (split-K): each segment
  writes its partial maximum, sum and output, and ``_combine_segments`` folds a row's
  segments in order. A row of one segment folded that way gives the bits of writing it
  directly (its weight is exp(0) = 1), which the kernel does when every row of a step fits
  one segment.

**Loads a tile ahead** (``PREFETCH``). At batch 1 a layer's attention is a few programs
(one per KV head) walking their keys in series, and its time is the memory latency of each
tile: left to Triton's pipeliner, the loop waits for a tile's keys and values at the top
of the iteration that attends it, and issues the next tile's loads only at its end (sm_90,
Triton 3.6-3.9). With PREFETCH the loop loads tile i + 1's keys and values (and tile
i + 2's block ids) into registers before it attends tile i, so their latency overlaps its
products. The arithmetic is the same, and so are the bits.

Both kernels wait for the kernel before them first (``wait_for_inputs``: programmatic
dependent launch on Hopper and later, see ``layers/triton_launch.py``).

The kernels are written against Triton's basic language only, so they also run under its
interpreter (``TRITON_INTERPRET=1``) on CPU tensors, where the tests check them. The
interpreter multiplies 16-bit matrices wrongly (Triton 3.9), so there ``UPCAST`` widens
the operands of each product to float32 first: the products of 16-bit values are exact in
float32 either way, and the GPU path keeps its 16-bit operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Re-exported for the backend, which launches the kernels (triton_paged.py).
from llmserve.layers.triton_launch import (  # noqa: F401
    INTERPRETED,
    pdl_for,
    pdl_launch,
    wait_for_inputs,
)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def _kv_tile(block, keys, hi, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
             kv_head, dims, dim_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
             stride_vh, stride_sb, stride_ss, BLOCK_N: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, SCALED: tl.constexpr):
    """A tile of keys' cache entries, read through their blocks (``block``: each key's, from
    the sequence's block table): keys [HEAD_P, BLOCK_N], values [BLOCK_N, HEAD_P] and,
    for a scaled cache, their float32 scales [BLOCK_N] (else zeros, unused). Keys at or
    past ``hi`` read nothing and come back as zeros."""
    key_ok = keys < hi
    slot = keys % BLOCK_SIZE
    k = tl.load(k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks
                + kv_head * stride_kh + dims[:, None],
                mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                + kv_head * stride_vh + dims[None, :],
                mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    if SCALED:
        k_scale = tl.load(k_scale_ptr + block * stride_sb + slot * stride_ss + kv_head,
                          mask=key_ok, other=0.0)
        v_scale = tl.load(v_scale_ptr + block * stride_sb + slot * stride_ss + kv_head,
                          mask=key_ok, other=0.0)
    else:
        k_scale = tl.zeros([BLOCK_N], tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, tile_seq_ptr, tile_first_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, part_start_ptr,
    scale, window,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss,
    stride_bt,
    num_heads,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr,
    SCALED: tl.constexpr, WINDOWED: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Grid: (query tiles, KV heads, segments). ``tile_seq``/``tile_first``: each tile's
    sequence and first token (a row of the flat batch); ``seq_lens``: each sequence's
    context after this step; ``query_start``: [B + 1] first token of each sequence.
    With SPLIT, token t's partials for segment s are at entry ``part_start[t] + s`` of
    [entries, query heads] (maximum, sum) and [entries, query heads, HEAD_P] (output):
    a token has entries for segments 0 .. position // SEGMENT only."""
    wait_for_inputs(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_end = tl.load(query_start_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - (q_end - q_start)  # position of the sequence's first query

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP_P
    head_in_group = rows % GROUP_P
    valid = (token < q_end) & (head_in_group < GROUP)
    position = context_start + (token - q_start)
    last = tl.minimum(q_end, first + BLOCK_Q) - 1
    max_pos = context_start + (last - q_start)
    min_pos = context_start + (first - q_start)

    seg_lo = segment * SEGMENT
    hi = tl.minimum(seg_lo + SEGMENT, max_pos + 1)
    lo = seg_lo
    if WINDOWED:
        # Whole key tiles before every row's window hold nothing for them: skipped.
        first_key = tl.maximum(min_pos - window + 1, 0)
        lo = tl.maximum(seg_lo, (first_key // BLOCK_N) * BLOCK_N)

    dims = tl.arange(0, HEAD_P)
    dim_ok = dims < HEAD_DIM
    q_head = kv_head * GROUP + head_in_group
    q = tl.load(q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh
                + dims[None, :], mask=valid[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    tables = block_tables_ptr + seq * stride_bt
    if PREFETCH:
        # The loop's loads run a tile ahead of its arithmetic: the keys and values of tile
        # i + 1 (and the block ids of tile i + 2) are loaded into registers before tile i
        # is attended, so their memory latency overlaps its products. Past ``hi`` the loads
        # are masked off (no memory is read). The arithmetic is the same either way.
        k, v, k_scale, v_scale = _kv_tile(
            tl.load(tables + (lo + offsets) // BLOCK_SIZE, mask=lo + offsets < hi,
                            other=0),
            lo + offsets, hi, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head,
            dims, dim_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_sb, stride_ss, BLOCK_N, BLOCK_SIZE, SCALED)
        next_keys = lo + BLOCK_N + offsets
        next_block = tl.load(tables + next_keys // BLOCK_SIZE, mask=next_keys < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offsets
        key_ok = keys < hi
        if PREFETCH:
            k_next, v_next, k_scale_next, v_scale_next = _kv_tile(
                next_block, keys + BLOCK_N, hi, k_cache_ptr, v_cache_ptr,
                k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, BLOCK_N,
                BLOCK_SIZE, SCALED)
            after_next = keys + 2 * BLOCK_N
            next_block = tl.load(tables + after_next // BLOCK_SIZE, mask=after_next < hi,
                                 other=0)
        else:
            block = tl.load(tables + keys // BLOCK_SIZE, mask=key_ok, other=0)
            k, v, k_scale, v_scale = _kv_tile(
                block, keys, hi, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                kv_head, dims, dim_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, stride_sb, stride_ss, BLOCK_N, BLOCK_SIZE, SCALED)
        s = _dot(q, k.to(q.dtype), UPCAST)  # [BLOCK_M, BLOCK_N] float32
        if SCALED:
            s = s * k_scale[None, :]
        s = s * scale
        visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
        if WINDOWED:
            visible = visible & (keys[None, :] > position[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if SCALED:  # values dequantized: scaled probabilities would underflow in float16
            v = v.to(tl.float32) * v_scale[:, None]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), UPCAST)
        m_i = m_new
        if PREFETCH:
            k, v, k_scale, v_scale = k_next, v_next, k_scale_next, v_scale_next

    if SPLIT:
        # Only the segments a row's keys reach have entries (the rest of the tile's do not).
        has = valid & (segment <= position // SEGMENT)
        start = tl.load(part_start_ptr + token, mask=has, other=0).to(tl.int64)
        part = (start + segment) * num_heads + q_head
        tl.store(part_m_ptr + part, m_i, mask=has)
        tl.store(part_l_ptr + part, l_i, mask=has)
        tl.store(part_acc_ptr + part[:, None] * HEAD_P + dims[None, :], acc,
                 mask=has[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & dim_ok[None, :])


@triton.jit
def combine_segments_kernel(
    positions_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, part_start_ptr, out_ptr, window,
    num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, SEGMENT: tl.constexpr,
    WINDOWED: tl.constexpr, PDL: tl.constexpr,
):
    """Grid: (tokens, query heads). Folds the segments a row's keys fall in, in order:
    ``out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)``, M the largest m_s."""
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + token)
    first = 0
    if WINDOWED:
        first = tl.maximum(position - window + 1, 0) // SEGMENT
    last = position // SEGMENT
    start = tl.load(part_start_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_P)
    m_max = tl.load(part_m_ptr + (start + first) * num_heads + head)
    for s in range(first + 1, last + 1):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + (start + s) * num_heads + head))
    part = (start + first) * num_heads + head
    w = tl.exp(tl.load(part_m_ptr + part) - m_max)
    total = tl.load(part_l_ptr + part) * w
    acc = tl.load(part_acc_ptr + part * HEAD_P + dims) * w
    for s in range(first + 1, last + 1):
        part = (start + s) * num_heads + head
        w = tl.exp(tl.load(part_m_ptr + part) - m_max)
        total = total + tl.load(part_l_ptr + part) * w
        acc = acc + tl.load(part_acc_ptr + part * HEAD_P + dims) * w
    out = acc / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
