"""The Triton paged-attention backend against a plain reference, and its batch invariance.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before they are imported) on CPU tensors; on a GPU the same tests run on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # read when Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from llmserve.attention.backend import BatchLayout  # noqa: E402
from llmserve.attention.triton_paged import (  # noqa: E402
    SEGMENT,
    TritonKVCache,
    TritonPagedBackend,
)

DEVICE = torch.device("cuda" if CUDA else "cpu")
BLOCK = 16
FP32_TOL = 2e-3 if CUDA else 1e-5  # GPUs multiply float32 tiles in tf32


class Batch:
    """Sequences with a context already cached and a chunk of new queries each."""

    def __init__(self, specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                 head_dim: int, kv_dtype: str, q_dtype: torch.dtype, seed: int = 0) -> None:
        """``specs``: per sequence (tokens already cached, tokens computed this step)."""
        gen = torch.Generator().manual_seed(seed)
        self.specs = specs
        self.hq, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        blocks_needed = [-(-(c + n) // BLOCK) for c, n in specs]
        self.cache = TritonKVCache.allocate(kv_dtype, sum(blocks_needed) + 3, BLOCK,
                                            num_kv_heads, head_dim, DEVICE)
        # Scattered block ids, so that a wrong table lookup shows.
        order = torch.randperm(sum(blocks_needed) + 3, generator=gen)[:sum(blocks_needed)]
        self.tables, used = [], 0
        for n in blocks_needed:
            self.tables.append(order[used:used + n].tolist())
            used += n
        self.past = []  # per sequence: (keys, values) of its cached context
        for b, (cached, _) in enumerate(specs):
            k = torch.randn(cached, num_kv_heads, head_dim, generator=gen)
            v = torch.randn(cached, num_kv_heads, head_dim, generator=gen)
            if cached:
                self.cache.store(self.slots(b, range(cached)), k.to(DEVICE), v.to(DEVICE))
        total = sum(n for _, n in specs)
        self.q = torch.randn(total, num_heads, head_dim, generator=gen).to(DEVICE, q_dtype)
        self.k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(DEVICE, q_dtype)
        self.v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(DEVICE, q_dtype)

    def slots(self, b: int, positions) -> torch.Tensor:
        table = self.tables[b]
        return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in positions],
                            dtype=torch.int64, device=DEVICE)

    def layout(self, seqs: list[int] | None = None) -> tuple[BatchLayout, torch.Tensor]:
        """The layout of sequences ``seqs`` (default all) and their rows of q/k/v."""
        seqs = list(range(len(self.specs))) if seqs is None else seqs
        starts = [0]
        for _, n in self.specs:
            starts.append(starts[-1] + n)
        rows = torch.tensor([t for b in seqs for t in range(starts[b], starts[b + 1])])
        positions = [p for b in seqs for p in range(self.specs[b][0], sum(self.specs[b]))]
        width = max(len(self.tables[b]) for b in seqs)
        tables = torch.tensor([self.tables[b] + [0] * (width - len(self.tables[b]))
                               for b in seqs], dtype=torch.int64, device=DEVICE)
        slots = torch.cat([self.slots(b, range(self.specs[b][0], sum(self.specs[b])))
                           for b in seqs])
        layout = BatchLayout(slots, tables, torch.tensor(positions, device=DEVICE),
                             [self.specs[b][1] for b in seqs], [sum(self.specs[b]) for b in seqs],
                             BLOCK)
        return layout, rows.to(DEVICE)

    def run(self, seqs: list[int] | None = None, window: int | None = None) -> torch.Tensor:
        backend = TritonPagedBackend()
        layout, rows = self.layout(seqs)
        meta = backend.build_metadata(layout)
        return backend.forward(self.q[rows], self.k[rows], self.v[rows], self.cache, meta,
                               self.d ** -0.5, window)

    def reference(self, window: int | None = None) -> torch.Tensor:
        """float64 softmax attention over each row's own keys, read back from the cache
        (after ``run`` stored them)."""
        out, t = [], 0
        group = self.hq // self.hkv
        for b, (cached, n) in enumerate(self.specs):
            keys, values = self.cache.read(self.slots(b, range(cached + n)))
            for i in range(n):
                pos = cached + i
                lo = 0 if window is None else max(0, pos - window + 1)
                heads = []
                for h in range(self.hq):
                    kk = keys[lo:pos + 1, h // group].double()
                    vv = values[lo:pos + 1, h // group].double()
                    scores = kk @ self.q[t, h].double() * self.d ** -0.5
                    heads.append(torch.softmax(scores, 0) @ vv)
                out.append(torch.cat(heads))
                t += 1
        return torch.stack(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


# (cached, new) per sequence: decodes, prefill chunks from zero and after a cached prefix,
# speculative verification rows, and contexts crossing one and two segments (split-K).
MIXED = [(0, 37), (40, 1), (SEGMENT + 30, 1), (5, 4), (SEGMENT - 3, 9), (2 * SEGMENT + 7, 1)]


@pytest.mark.parametrize("heads", [(6, 2, 32), (4, 4, 16), (8, 1, 64)],
                         ids=["gqa3-d32", "mha-d16", "mqa8-d64"])
def test_mixed_batch_matches_the_reference_float32(heads):
    batch = Batch(MIXED, *heads, "float32", torch.float32)
    out = batch.run()
    assert out.shape == (sum(n for _, n in MIXED), heads[0] * heads[2])
    assert rel_err(out, batch.reference()) < FP32_TOL


@pytest.mark.parametrize("kv_dtype,tol", [("bfloat16", 1e-2), ("float16", 2e-3),
                                          ("fp8_e4m3", 1e-2)])
def test_low_precision_caches_match_the_reference(kv_dtype, tol):
    q_dtype = torch.float16 if kv_dtype == "float16" else torch.bfloat16
    batch = Batch(MIXED[:4], 6, 2, 32, kv_dtype, q_dtype, seed=1)
    out = batch.run()
    assert out.dtype == q_dtype
    assert rel_err(out, batch.reference()) < tol  # reference: the stored values, exact


def test_fp8_cache_keeps_a_scale_per_token_and_head():
    cache = TritonKVCache.allocate("fp8_e4m3", 4, BLOCK, 2, 16, DEVICE)
    k = torch.randn(5, 2, 16, device=DEVICE) * torch.tensor([1.0, 100.0], device=DEVICE
                                                            ).view(1, 2, 1)
    slots = torch.tensor([0, 17, 18, 40, 63], device=DEVICE)
    cache.store(slots, k, k)
    keys, _ = cache.read(slots)
    assert rel_err(keys, k) < 0.05  # e4m3: 3 mantissa bits, each vector scaled on its own
    scales = cache.key_scale.view(-1, 2)[slots].cpu()
    torch.testing.assert_close(scales, k.abs().amax(-1).cpu() / 448, rtol=1e-6, atol=0)


def test_sliding_window_matches_the_reference():
    batch = Batch(MIXED, 6, 2, 32, "float32", torch.float32, seed=2)
    for window in (1, 50, SEGMENT + 10):
        assert rel_err(batch.run(window=window), batch.reference(window)) < FP32_TOL


@pytest.mark.parametrize("window", [None, 100])
def test_each_row_gets_the_same_bits_alone_and_in_any_batch(window):
    """Alone, a short sequence fits one segment (written directly); batched with a long one
    the step is split and folded: same bits. So are rows of a prefill chunk batched with
    decodes, and every subset."""
    batch = Batch(MIXED, 6, 2, 32, "bfloat16", torch.bfloat16, seed=3)
    together = batch.run(window=window)
    starts = [0]
    for _, n in MIXED:
        starts.append(starts[-1] + n)
    for b in range(len(MIXED)):
        alone = batch.run([b], window=window)
        assert torch.equal(alone, together[starts[b]:starts[b + 1]]), b
    pair = batch.run([3, 1], window=window)
    assert torch.equal(pair[:4], together[starts[3]:starts[4]])


def test_graph_metadata_gives_the_eager_result():
    """The decode metadata a CUDA graph captures (static tensors, every segment of the
    longest context in the grid) computes what the eager step does."""
    specs = [(40, 1), (SEGMENT + 30, 1), (3, 1)]
    batch = Batch(specs, 6, 2, 32, "bfloat16", torch.bfloat16, seed=4)
    eager = batch.run()
    backend = TritonPagedBackend()
    layout, rows = batch.layout()
    seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int32, device=DEVICE)
    meta = backend.build_graph_metadata(layout, seq_lens, max_seq_len=4 * SEGMENT)
    graph = backend.forward(batch.q[rows], batch.k[rows], batch.v[rows], batch.cache, meta,
                            batch.d ** -0.5)
    assert torch.equal(graph, eager)


def test_graphs_for_one_segment_attend_without_the_split():
    """The decode graphs of contexts up to one segment run no split and no fold, and give
    the bits of the graphs for long contexts (one segment folded) and of the eager step."""
    backend = TritonPagedBackend()
    assert backend.graph_context_limits(4 * SEGMENT) == [SEGMENT, 4 * SEGMENT]
    assert backend.graph_context_limits(SEGMENT // 2) == [SEGMENT // 2]
    batch = Batch([(40, 1), (SEGMENT - 1, 1), (3, 1), (SEGMENT - 200, 1)], 6, 2, 32, "bfloat16",
                  torch.bfloat16, seed=6)
    eager = batch.run()
    layout, rows = batch.layout()
    seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int32, device=DEVICE)
    outs = {}
    for limit in backend.graph_context_limits(4 * SEGMENT):
        meta = backend.build_graph_metadata(layout, seq_lens, max_seq_len=limit)
        assert meta.split == (limit > SEGMENT) and (meta.part_start is None) == (not meta.split)
        outs[limit] = backend.forward(batch.q[rows], batch.k[rows], batch.v[rows], batch.cache,
                                      meta, batch.d ** -0.5)
    assert torch.equal(outs[SEGMENT], outs[4 * SEGMENT])
    assert torch.equal(outs[SEGMENT], eager)


def test_unknown_kv_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        TritonKVCache.allocate("int8", 2, BLOCK, 1, 16, DEVICE)


def test_partials_hold_only_the_segments_each_row_reaches():
    """A long-context decode batched with a prefill chunk: the chunk's rows keep one entry
    of partials each, not one per segment of the longest context."""
    backend = TritonPagedBackend()
    batch = Batch([(0, 40), (3 * SEGMENT + 5, 1)], 4, 2, 16, "float32", torch.float32, seed=5)
    layout, _ = batch.layout()
    meta = backend.build_metadata(layout)
    assert meta.split and meta.num_segments == 4
    assert meta.part_entries == 40 * 1 + 4
    assert meta.part_start.tolist() == list(range(41))


def test_rotary_in_the_kv_store_gives_the_bits_of_rotating_first(monkeypatch):
    """With the step's rotary passed down, the backend rotates q and k in the kernel that
    stores the keys (here run under the interpreter as the GPU would): the output and the
    cache of rotating first, then storing."""
    from llmserve.attention import Rope, triton_paged
    from llmserve.layers import rotary as rotary_module
    from llmserve.layers import triton_ops
    from llmserve.layers.rotary import RotaryEmbedding
    from llmserve.models.arch_config import RopeScaling

    for module in (triton_paged, rotary_module):  # the GPU's kernels for CPU tensors
        monkeypatch.setattr(module, "gpu_ops_for", lambda x: triton_ops)
    rotary = RotaryEmbedding(32, 4 * SEGMENT, 10000.0, RopeScaling()).to(DEVICE)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(triton_paged, "ROPE_STORE", fused)
        batch = Batch(MIXED, 6, 2, 32, "bfloat16", torch.bfloat16, seed=8)
        layout, rows = batch.layout()
        meta = TritonPagedBackend().build_metadata(layout)
        q, k, v = batch.q[rows].clone(), batch.k[rows].clone(), batch.v[rows]
        out = TritonPagedBackend().forward(q, k, v, batch.cache, meta, batch.d ** -0.5,
                                           rope=Rope(rotary, layout.positions))
        results[fused] = (out, batch.cache.key.clone(), batch.cache.value.clone())
    for i, (got, want) in enumerate(zip(results[True], results[False])):
        assert torch.equal(got, want), i
    rotated = batch.q[rows].clone(), batch.k[rows].clone()
    triton_ops.rotary_(*rotated, layout.positions, *rotary.kernel_tables())
    assert not torch.equal(rotated[1], batch.k[rows])
    assert torch.equal(batch.cache.read(layout.slot_mapping)[0],
                       rotated[1].float())  # the cache holds the rotated keys


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("window", [None, 100])
def test_the_key_loop_s_prefetch_changes_no_bit(monkeypatch, kv_dtype, window):
    """The key loop loads the next tile before it attends the current one (``PREFETCH``;
    caches stored as they are); left to Triton's pipeliner instead, the same arithmetic
    gives the same bits: prefill chunks, decodes, split contexts, a window."""
    from llmserve.attention import triton_paged

    outs = []
    for prefetch in (True, False):
        monkeypatch.setattr(triton_paged, "PREFETCH", prefetch)
        outs.append(Batch(MIXED, 8, 2, 64, kv_dtype, torch.bfloat16, seed=9).run(window=window))
    assert torch.equal(outs[0], outs[1])
