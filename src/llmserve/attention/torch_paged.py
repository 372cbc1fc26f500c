"""Paged attention in plain PyTorch: one batched matmul-softmax-matmul over the whole step.

Every sequence's context is gathered from its block table into a padded
``[B, max_blocks * block_size]`` key/value tensor, and its queries into a padded
``[B, max_query_len]`` tensor, so one forward covers prefill chunks and decodes together
with no Python loop over sequences. Padding is masked, never read into a result: keys past a
query's own position get -inf. The arithmetic of a row does not depend on the padding or on
the other rows, which keeps greedy output batch-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.attention.backend import BatchLayout, register_attention_backend


@dataclass
class TorchPagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, NB] int64, NB = blocks of the longest context
    num_seqs: int
    max_query_len: int
    context_len: int  # NB * block_size
    q_index: torch.Tensor | None  # [T] int64: row of each token in the padded [B * Qm] layout
    mask: torch.Tensor  # [B, Qm, L] bool, True where a key must be ignored


@register_attention_backend("torch_paged")
class TorchPagedBackend:
    name = "torch_paged"

    def build_metadata(self, layout: BatchLayout) -> TorchPagedMetadata:
        """1. Trim block tables to the blocks of the longest context.
        2. Map each flattened token to its row in the padded query layout.
        3. Build one causal mask for all layers: key j is visible to a query at position p
           iff j <= p (which also hides everything past the sequence's own length).
        """
        device = layout.positions.device
        num_seqs = len(layout.query_lens)
        max_q = max(layout.query_lens)
        num_blocks = -(-max(layout.seq_lens) // layout.block_size)
        block_tables = layout.block_tables[:, :num_blocks]
        context_len = num_blocks * layout.block_size

        if max_q == 1:
            q_index = None
            q_pos = layout.positions.view(num_seqs, 1)
        else:
            starts = torch.tensor([b * max_q for b in range(num_seqs)], dtype=torch.int64)
            lens = torch.tensor(layout.query_lens, dtype=torch.int64)
            offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(
                torch.cumsum(lens, 0) - lens, lens)
            q_index = (torch.repeat_interleave(starts, lens) + offsets).to(device)
            q_pos = torch.zeros(num_seqs * max_q, dtype=torch.int64, device=device)
            q_pos.index_copy_(0, q_index, layout.positions)
            q_pos = q_pos.view(num_seqs, max_q)
        key_pos = torch.arange(context_len, device=device)
        mask = key_pos.view(1, 1, -1) > q_pos.unsqueeze(-1)  # [B, Qm, L]
        return TorchPagedMetadata(layout.slot_mapping, block_tables, num_seqs, max_q,
                                  context_len, q_index, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: TorchPagedMetadata,
                scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache  # [num_blocks, block_size, Hkv, D]
        _, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        b, qm, ctx = metadata.num_seqs, metadata.max_query_len, metadata.context_len

        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, metadata.slot_mapping, k.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, metadata.slot_mapping, v.to(value_cache.dtype))

        if metadata.q_index is None:
            q_pad = q
        else:
            q_pad = q.new_zeros(b * qm, num_heads, head_dim)
            q_pad.index_copy_(0, metadata.q_index, q)
        # [B, Hkv, G * Qm, D]
        q_pad = (q_pad.view(b, qm, num_kv_heads, group, head_dim)
                 .permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, group * qm, head_dim))
        keys = key_cache[metadata.block_tables].view(b, ctx, num_kv_heads, head_dim)
        values = value_cache[metadata.block_tables].view(b, ctx, num_kv_heads, head_dim)
        keys = keys.to(q.dtype).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        values = values.to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]

        scores = torch.matmul(q_pad, keys).mul_(scale)  # [B, Hkv, G * Qm, L]
        scores = scores.view(b, num_kv_heads, group, qm, ctx)
        scores.masked_fill_(metadata.mask.view(b, 1, 1, qm, ctx), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs.view(b, num_kv_heads, group * qm, ctx), values)
        # [B, Hkv, G * Qm, D] -> [B * Qm, Hq * D]
        out = (out.view(b, num_kv_heads, group, qm, head_dim).permute(0, 3, 1, 2, 4)
               .reshape(b * qm, num_heads * head_dim))
        if metadata.q_index is not None:
            out = out.index_select(0, metadata.q_index)
        return out
