"""Paged attention in plain PyTorch: gather the blocks, then one fused attention call.

Sequences of the step are grouped by shape class (query length and context length, each
rounded up to a power of two). Within a group every sequence's context is gathered from
its block table into a padded ``[G, L]`` key/value tensor and its queries into a padded
``[G, Qm]`` tensor, so one ``scaled_dot_product_attention`` (PyTorch's CPU flash kernel;
grouped-query heads read their shared KV head in place) covers the whole group with no
Python loop over sequences or heads; the loop is over the few shape classes present in a
step (decodes, and a prefill chunk or two). Grouping keeps padding below 2x, so a long
prefill chunk never inflates the decodes it is batched with.

Padding is masked, never read into a result. A row's context always starts at offset 0
and padding only ever follows it, so the arithmetic of a row does not depend on the other
rows, which keeps greedy output batch-invariant (tests/model/test_runner_invariance.py).

Cost-conscious details: blocks are gathered with one ``index_select`` of whole blocks into
buffers allocated once per step; long query groups (prefill chunks) are processed in tiles
of rows, each against only the keys its rows can see, which skips most of the masked upper
triangle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.attention.backend import BatchLayout, register_attention_backend
from llmserve.attention.kv_format import PagedKVCache

_QUERY_TILE = 128  # rows of a prefill chunk attended together


@dataclass
class AttentionGroup:
    token_index: torch.Tensor | None  # [Tg] int64 rows of the flat batch; None: all rows
    block_ids: torch.Tensor  # [G * NB] int64, the block tables flattened
    num_seqs: int
    max_query_len: int  # Qm
    context_len: int  # NB * block_size = L
    q_index: torch.Tensor | None  # [Tg] row of each token in the padded [G * Qm] layout
    allowed: torch.Tensor  # [G, 1, Qm, L] bool, True where a query may see a key
    # (first row, end row, first key some row must not see, keys any row can see)
    tiles: list[tuple[int, int, int, int]]
    # Gather buffers, allocated once per step and reused by every layer.
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


@dataclass
class TorchPagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    groups: list[AttentionGroup]


@register_attention_backend("torch_paged")
class TorchPagedBackend:
    name = "torch_paged"

    def build_metadata(self, layout: BatchLayout) -> TorchPagedMetadata:
        """1. Group sequences by (query length, context length) rounded up to powers of 2.
        2. Per group: trim block tables to the longest context, map each token to its row
           in the padded query layout, and build the causal mask once for all layers: key j
           is visible to a query at position p iff j <= p.
        """
        classes: dict[tuple[int, int], list[int]] = defaultdict(list)
        for b, (q, s) in enumerate(zip(layout.query_lens, layout.seq_lens)):
            classes[(_pow2(q), _pow2(s))].append(b)
        starts = [0]
        for q in layout.query_lens:
            starts.append(starts[-1] + q)
        single = len(classes) == 1
        groups = [self._group(layout, seqs, starts, single) for seqs in classes.values()]
        return TorchPagedMetadata(layout.slot_mapping, groups)

    def _group(self, layout: BatchLayout, seqs: list[int], starts: list[int],
               single: bool) -> AttentionGroup:
        device = layout.positions.device
        qlens = [layout.query_lens[b] for b in seqs]
        max_q = max(qlens)
        num_blocks = -(-max(layout.seq_lens[b] for b in seqs) // layout.block_size)
        context_len = num_blocks * layout.block_size
        tokens = None if single else torch.tensor(
            [t for b in seqs for t in range(starts[b], starts[b + 1])], dtype=torch.int64,
            device=device)
        positions = layout.positions if tokens is None else layout.positions[tokens]
        rows = torch.tensor(seqs, dtype=torch.int64, device=device)
        tables = layout.block_tables.index_select(0, rows)[:, :num_blocks]
        if max_q == 1:
            q_index = None
            q_pos = positions.view(len(seqs), 1)
        else:
            q_index = torch.tensor([g * max_q + i for g, n in enumerate(qlens) for i in range(n)],
                                   dtype=torch.int64, device=device)
            q_pos = torch.zeros(len(seqs) * max_q, dtype=torch.int64, device=device)
            q_pos.index_copy_(0, q_index, positions)
            q_pos = q_pos.view(len(seqs), max_q)
        key_pos = torch.arange(context_len, device=device)
        allowed = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [G,1,Qm,L]
        tiles = []
        last_pos = q_pos.amax(dim=0).tolist()  # per padded row, the furthest position
        real = torch.zeros_like(q_pos, dtype=torch.bool)
        if q_index is None:
            real.fill_(True)
        else:
            real.view(-1)[q_index] = True
        first_pos = torch.where(real, q_pos, torch.iinfo(torch.int64).max).amin(dim=0).tolist()
        for start in range(0, max_q, _QUERY_TILE):
            end = min(max_q, start + _QUERY_TILE)
            visible = max(last_pos[start:end]) + 1
            keys = min(context_len, -(-visible // layout.block_size) * layout.block_size)
            # Keys before every real row's own position are visible to all of them (padded
            # rows are discarded, so what they see does not matter).
            mask_from = min(keys, min(first_pos[start:end]) + 1)
            tiles.append((start, end, mask_from, keys))
        return AttentionGroup(tokens, tables.reshape(-1), len(seqs), max_q, context_len,
                              q_index, allowed, tiles)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: PagedKVCache, metadata: TorchPagedMetadata,
                scale: float) -> torch.Tensor:
        kv_cache.store(metadata.slot_mapping, k, v)
        if len(metadata.groups) == 1:
            return _attend(q, kv_cache, metadata.groups[0], scale)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for group in metadata.groups:
            qg = q.index_select(0, group.token_index)
            out.index_copy_(0, group.token_index, _attend(qg, kv_cache, group, scale))
        return out


def _attend(q: torch.Tensor, kv_cache: PagedKVCache, group: AttentionGroup,
            scale: float) -> torch.Tensor:
    """``q``: [Tg, Hq, D] -> [Tg, Hq * D] for one group.

    1. Gather the group's blocks: [G, L, Hkv, D] keys and values (one index_select each).
    2. Per query tile: one fused scaled-dot-product attention over all sequences and heads
       (grouped-query heads share their KV head without a copy), against only the keys the
       tile's rows can see, with the causal/padding mask.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.key.shape[2]
    b, qm, ctx = group.num_seqs, group.max_query_len, group.context_len
    if group.q_index is None:
        q_pad = q
    else:
        q_pad = q.new_zeros(b * qm, num_heads, head_dim)
        q_pad.index_copy_(0, group.q_index, q)
    q_hm = q_pad.view(b, qm, num_heads, head_dim).transpose(1, 2)  # [G, Hq, Qm, D]
    if group.keys is None:  # first layer of the step: allocate the gather buffers
        group.keys = kv_cache.gather_buffer(group.block_ids.numel())
        group.values = kv_cache.gather_buffer(group.block_ids.numel())
    keys, values = kv_cache.gather(group.block_ids, group.keys, group.values)
    keys = keys.view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)  # [G, Hkv, L, D]
    values = values.view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)

    out = q.new_empty(b, qm, num_heads, head_dim)
    for start, end, mask_from, visible in group.tiles:
        mask = None
        if mask_from < visible:
            mask = group.allowed[:, :, start:end, :visible]  # [G, 1, rows, Lt]
        o = F.scaled_dot_product_attention(
            q_hm[:, :, start:end], keys[:, :, :visible], values[:, :, :visible],
            attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[:, start:end] = o.transpose(1, 2)
    out = out.view(b * qm, num_heads * head_dim)
    if group.q_index is not None:
        out = out.index_select(0, group.q_index)
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
