"""Paged attention in plain PyTorch: batched matmul-softmax-matmul over padded groups.

Sequences of the step are grouped by shape class (query length and context length, each
rounded up to a power of two). Within a group every sequence's context is gathered from
its block table into a padded ``[G, L]`` key/value tensor and its queries into a padded
``[G, Qm]`` tensor, so one batched computation covers the whole group with no Python loop
over sequences; the loop is over the few shape classes present in a step (decodes, and a
prefill chunk or two). Grouping keeps padding below 2x, so a long prefill chunk never
inflates the decodes it is batched with.

Padding is masked, never read into a result: keys past a query's own position get -inf.
A row's context always starts at offset 0 and padding only ever follows it, so the
arithmetic of a row does not depend on the other rows, which keeps greedy output
batch-invariant.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from llmserve.attention.backend import BatchLayout, register_attention_backend


@dataclass
class AttentionGroup:
    token_index: torch.Tensor | None  # [Tg] int64 rows of the flat batch; None: all rows
    block_tables: torch.Tensor  # [G, NB] int64
    num_seqs: int
    max_query_len: int  # Qm
    context_len: int  # NB * block_size = L
    q_index: torch.Tensor | None  # [Tg] row of each token in the padded [G * Qm] layout
    mask: torch.Tensor  # [G, Qm, L] bool, True where a key must be ignored


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
        mask = key_pos.view(1, 1, -1) > q_pos.unsqueeze(-1)  # [G, Qm, L]
        return AttentionGroup(tokens, tables, len(seqs), max_q, context_len, q_index, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: TorchPagedMetadata,
                scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache  # [num_blocks, block_size, Hkv, D]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, metadata.slot_mapping, k.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, metadata.slot_mapping, v.to(value_cache.dtype))
        if len(metadata.groups) == 1:
            return _attend(q, key_cache, value_cache, metadata.groups[0], scale)
        out = q.new_empty(q.shape[0], q.shape[1] * head_dim)
        for group in metadata.groups:
            qg = q.index_select(0, group.token_index)
            out.index_copy_(0, group.token_index,
                            _attend(qg, key_cache, value_cache, group, scale))
        return out


def _attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            group: AttentionGroup, scale: float) -> torch.Tensor:
    """``q``: [Tg, Hq, D] -> [Tg, Hq * D] for one group."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    heads_per_kv = num_heads // num_kv_heads
    b, qm, ctx = group.num_seqs, group.max_query_len, group.context_len
    if group.q_index is None:
        q_pad = q
    else:
        q_pad = q.new_zeros(b * qm, num_heads, head_dim)
        q_pad.index_copy_(0, group.q_index, q)
    # [G, Hkv, heads_per_kv * Qm, D]
    q_pad = (q_pad.view(b, qm, num_kv_heads, heads_per_kv, head_dim)
             .permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, heads_per_kv * qm, head_dim))
    keys = key_cache[group.block_tables].view(b, ctx, num_kv_heads, head_dim)
    values = value_cache[group.block_tables].view(b, ctx, num_kv_heads, head_dim)
    keys = keys.to(q.dtype).permute(0, 2, 3, 1)  # [G, Hkv, D, L]
    values = values.to(q.dtype).transpose(1, 2)  # [G, Hkv, L, D]

    scores = torch.matmul(q_pad, keys).mul_(scale)  # [G, Hkv, heads_per_kv * Qm, L]
    scores = scores.view(b, num_kv_heads, heads_per_kv, qm, ctx)
    scores.masked_fill_(group.mask.view(b, 1, 1, qm, ctx), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs.view(b, num_kv_heads, heads_per_kv * qm, ctx), values)
    # [G, Hkv, heads_per_kv * Qm, D] -> [G * Qm, Hq * D]
    out = (out.view(b, num_kv_heads, heads_per_kv, qm, head_dim).permute(0, 3, 1, 2, 4)
           .reshape(b * qm, num_heads * head_dim))
    if group.q_index is not None:
        out = out.index_select(0, group.q_index)
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
