"""Paged attention in plain PyTorch: batched matmul-softmax-matmul over padded groups.

Sequences of the step are grouped by shape class (query length and context length, each
rounded up to a power of two). Within a group every sequence's context is gathered from
its block table into a padded ``[G, L]`` key/value tensor and its queries into a padded
``[G, Qm]`` tensor, so one batched computation covers the whole group with no Python loop
over sequences; the loop is over the few shape classes present in a step (decodes, and a
prefill chunk or two). Grouping keeps padding below 2x, so a long prefill chunk never
inflates the decodes it is batched with.

Padding is masked, never read into a result: keys past a query's own position get -inf
(and, on a sliding-window layer, keys before its window).
A row's context always starts at offset 0 and padding only ever follows it, so the
arithmetic of a row does not depend on the other rows, which keeps greedy output
batch-invariant.

Cost-conscious details: blocks are gathered with one ``index_select`` of whole blocks;
each KV head is a strided view handed to ``bmm`` without a transposing copy; long query
groups (prefill chunks) are processed in tiles of rows, each against only the keys its
rows can see, which skips most of the masked upper triangle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from llmserve.attention.backend import BatchLayout, Rope, register_attention_backend
from llmserve.attention.kv_format import PagedKVCache

_QUERY_TILE = 128  # rows of a prefill chunk attended together
# Keys are summed over in fixed chunks of this many, each by its own matrix product, in
# order: a row's sum then has the same shape however long the padded context of its group
# is (the chunks past its own context add exact zeros). One product over the whole padded
# length would let MKL block the sum differently for different lengths.
_KEY_CHUNK = 128


@dataclass
class AttentionGroup:
    token_index: torch.Tensor | None  # [Tg] int64 rows of the flat batch; None: all rows
    block_ids: torch.Tensor  # [G * NB] int64, the block tables flattened
    seq_rows: torch.Tensor  # [G] int64, the group's sequences in the batch
    num_seqs: int
    max_query_len: int  # Qm
    context_len: int  # NB * block_size = L
    q_index: torch.Tensor | None  # [Tg] row of each token in the padded [G * Qm] layout
    mask: torch.Tensor  # [G, Qm, L] bool, True where a key must be ignored
    q_pos: torch.Tensor  # [G, Qm] int64 position of each padded query row
    # (first row, end row, first key some row must not see, keys any row can see)
    tiles: list[tuple[int, int, int, int]]
    key_chunk: int  # keys per matrix product of probabilities and values
    # Gather buffers ("keys", "values"), allocated once per step and reused by every layer
    # (the KV cache groups' copies of a step share them: each layer fills them whole).
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # Sliding windows: the mask with keys before each row's window ignored too, and the
    # tiles with their masked span from the first key, built once per window and step.
    windowed: dict[int, tuple[torch.Tensor, list[tuple[int, int, int, int]]]] = field(
        default_factory=dict)

    def for_window(self, window: int | None
                   ) -> tuple[torch.Tensor, list[tuple[int, int, int, int]]]:
        if window is None:
            return self.mask, self.tiles
        if window not in self.windowed:
            key_pos = torch.arange(self.context_len, device=self.mask.device)
            before = key_pos.view(1, 1, -1) <= (self.q_pos - window).unsqueeze(-1)
            self.windowed[window] = (self.mask | before,
                                     [(s, e, 0, keys) for s, e, _, keys in self.tiles])
        return self.windowed[window]


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
        chunk_blocks = max(1, _KEY_CHUNK // layout.block_size)
        num_blocks = -(-max(layout.seq_lens[b] for b in seqs) // layout.block_size)
        num_blocks = -(-num_blocks // chunk_blocks) * chunk_blocks
        context_len = num_blocks * layout.block_size
        chunk = chunk_blocks * layout.block_size
        tokens = None if single else torch.tensor(
            [t for b in seqs for t in range(starts[b], starts[b + 1])], dtype=torch.int64,
            device=device)
        positions = layout.positions if tokens is None else layout.positions[tokens]
        rows = torch.tensor(seqs, dtype=torch.int64, device=device)
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
            keys = min(context_len, -(-visible // chunk) * chunk)
            # Keys before every real row's own position are visible to all of them (padded
            # rows are discarded, so what they see does not matter).
            mask_from = min(keys, min(first_pos[start:end]) + 1)
            tiles.append((start, end, mask_from, keys))
        return AttentionGroup(tokens, _block_ids(layout.block_tables, rows, num_blocks), rows,
                              len(seqs), max_q, context_len, q_index, mask, q_pos, tiles,
                              chunk)

    def allocate_kv_cache(self, name: str, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int,
                          device: torch.device) -> PagedKVCache:
        return PagedKVCache.allocate(name, num_blocks, block_size, num_kv_heads, head_dim,
                                     device)

    def rebind(self, metadata: TorchPagedMetadata, layout: BatchLayout) -> TorchPagedMetadata:
        """The step's metadata with another KV cache group's block tables and slots: the
        masks, tiles and gather buffers are shared, the gathered block ids are the group's."""
        groups = [replace(g, block_ids=_block_ids(layout.block_tables, g.seq_rows,
                                                  g.block_ids.numel() // g.num_seqs))
                  for g in metadata.groups]
        return TorchPagedMetadata(layout.slot_mapping, groups)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: PagedKVCache, metadata: TorchPagedMetadata,
                scale: float, window: int | None = None,
                rope: Rope | None = None) -> torch.Tensor:
        if rope is not None:
            q, k = rope.apply(q, k)
        kv_cache.store(metadata.slot_mapping, k, v)
        if len(metadata.groups) == 1:
            return _attend(q, kv_cache, metadata.groups[0], scale, window)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for group in metadata.groups:
            qg = q.index_select(0, group.token_index)
            out.index_copy_(0, group.token_index, _attend(qg, kv_cache, group, scale, window))
        return out


def _attend(q: torch.Tensor, kv_cache: PagedKVCache, group: AttentionGroup,
            scale: float, window: int | None = None) -> torch.Tensor:
    """``q``: [Tg, Hq, D] -> [Tg, Hq * D] for one group.

    1. Gather the group's blocks: [G, L, Hkv, D] for keys and values (one index_select).
    2. Lay queries out head-major: [G, Hkv, Qm * heads_per_kv, D].
    3. Per KV head and query tile: scores = q k^T (bmm on a strided view), mask, softmax
       in float32, times v.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.num_kv_heads
    group_size = num_heads // num_kv_heads
    b, qm, ctx = group.num_seqs, group.max_query_len, group.context_len
    if group.q_index is None:
        q_pad = q
    else:
        q_pad = q.new_zeros(b * qm, num_heads, head_dim)
        q_pad.index_copy_(0, group.q_index, q)
    # [G, Hkv, Qm, group_size, D]
    q_hm = q_pad.view(b, qm, num_kv_heads, group_size, head_dim).permute(0, 2, 1, 3, 4)
    q_hm = (q_hm * scale).contiguous()
    buffers = group.buffers
    if not buffers:  # first layer of the step: allocate the gather buffers
        buffers["keys"] = kv_cache.gather_buffer(group.block_ids.numel())
        buffers["values"] = kv_cache.gather_buffer(group.block_ids.numel())
    keys, values = kv_cache.gather(group.block_ids, buffers["keys"], buffers["values"])
    keys = keys.view(b, ctx, num_kv_heads, head_dim)
    values = values.view(b, ctx, num_kv_heads, head_dim)

    mask, tiles = group.for_window(window)
    out = q.new_empty(b, qm, num_kv_heads, group_size, head_dim)
    for h in range(num_kv_heads):
        k_h = keys[:, :, h]  # [G, L, D], rows strided by Hkv * D
        v_h = values[:, :, h]
        for start, end, mask_from, visible in tiles:
            rows = end - start
            q_t = q_hm[:, h, start:end].reshape(b, rows * group_size, head_dim)
            scores = _row_products(q_t, k_h[:, :visible].transpose(1, 2), rows)
            scores = scores.view(b, rows, group_size, visible)
            if mask_from < visible:
                scores[..., mask_from:].masked_fill_(
                    mask[:, start:end, None, mask_from:visible], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            o = _chunked_pv(probs.view(b, rows * group_size, visible), v_h[:, :visible],
                            group.key_chunk, rows)
            out[:, start:end, h] = o.view(b, rows, group_size, head_dim)
    out = out.view(b * qm, num_heads * head_dim)
    if group.q_index is not None:
        out = out.index_select(0, group.q_index)
    return out


def _chunked_pv(probs: torch.Tensor, values: torch.Tensor, chunk: int,
                rows: int) -> torch.Tensor:
    """``probs`` [G, R, L] times ``values`` [G, L, D], summed over ``L`` chunk by chunk in
    order (``L`` is a multiple of ``chunk``): one batched product of [R, chunk] x
    [chunk, D] per chunk (each of the ``rows`` query rows its own, ``_row_products``), then
    a sequential sum of the chunk results."""
    g, r, length = probs.shape
    n = length // chunk
    if n == 1:
        return _row_products(probs, values, rows)
    p = probs.view(g, r, n, chunk).transpose(1, 2).reshape(g * n, r, chunk)
    v = values.reshape(g * n, chunk, values.shape[-1])
    parts = _row_products(p, v, rows).view(g, n, r, -1)
    out = parts[:, 0].clone()
    for i in range(1, n):
        out += parts[:, i]
    return out


def _row_products(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """``a`` [G, R, K] times ``b`` [G, K, N] for R = ``rows`` query rows of R / rows
    matrix rows each (a query row's heads that share a KV head): one product per query row,
    of the same shape whether the row is a decode alone or one of a prefill chunk's. One
    product of all R rows would be faster, but MKL blocks a product's sums by its number of
    rows, and a row's result would change in its last bits between the two (a token could
    then change with the chunk size)."""
    if rows == 1:
        return torch.bmm(a, b)
    g, r, k = a.shape
    per = r // rows
    out = a.new_empty(g, r, b.shape[-1])
    for i in range(g):  # b[i] read by every row's product, not copied (a stride of 0)
        torch.bmm(a[i].view(rows, per, k), b[i].expand(rows, *b.shape[1:]),
                  out=out[i].view(rows, per, -1))
    return out


def _block_ids(block_tables: torch.Tensor, rows: torch.Tensor, num_blocks: int
               ) -> torch.Tensor:
    """The tables of sequences ``rows``, cut or padded (with block 0: masked, never
    counted) to ``num_blocks`` and flattened: [len(rows) * num_blocks]."""
    tables = block_tables.index_select(0, rows)[:, :num_blocks]
    if tables.shape[1] < num_blocks:
        tables = torch.nn.functional.pad(tables, (0, num_blocks - tables.shape[1]))
    return tables.reshape(-1)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
