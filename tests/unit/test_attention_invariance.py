"""The paged attention backends: a sequence's output rows are bitwise the same alone and
batched with sequences of other lengths (which changes the padded key length of a group),
with SmolLM2's head layout (9 query heads over 3 KV heads of 64); and each backend agrees
with a float64 softmax(q k^T) v per row, for every KV cache format (with an int8 cache the
compiled kernel's integer dot products round q to 16 bits, and so does its reference).

The compiled kernel takes long contexts in segments of ``attention_segment_keys`` keys
merged in order (flash-decoding): lengths here span one, two and three segments, and
chunks that straddle a segment's end."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention import get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.attention.kv_format import KV_CACHE_DTYPES, PagedKVCache
from llmserve.csrc import cpu_ops

HQ, HKV, D, BS = 9, 3, 64, 16
SEGMENT = cpu_ops().attention_segment_keys if cpu_ops() is not None else 512
NO_KERNELS = "compiled CPU kernels unavailable (no C++ compiler, or LLMSERVE_CPU_KERNELS=0)"
BACKENDS = ["torch_paged",
            pytest.param("cpu_paged", marks=pytest.mark.skipif(
                cpu_ops() is None, reason=NO_KERNELS))]


def _run(backend_name: str, seqs: list[tuple[int, int, list[int]]], cache: PagedKVCache,
         kv: dict[int, tuple[torch.Tensor, torch.Tensor]], q_all: dict[int, torch.Tensor],
         window: int | None = None):
    """seqs: (seq id, tokens computed this step, block ids); context = all of seq's kv."""
    backend = get_attention_backend(backend_name)
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
                          backend.build_metadata(layout), cache.head_dim**-0.5, window)
    return out.split(query_lens)


def _problem(lengths: dict[int, int], d: int = D):
    gen = torch.Generator().manual_seed(0)
    kv = {s: (torch.randn(n, HKV, d, generator=gen), torch.randn(n, HKV, d, generator=gen))
          for s, n in lengths.items()}
    q = {s: torch.randn(n, HQ, d, generator=gen) for s, n in lengths.items()}
    blocks, start = {}, 1
    for s, n in lengths.items():
        count = -(-n // BS)
        blocks[s] = list(range(start + count - 1, start - 1, -1))  # scattered, reversed
        start += count
    return kv, q, blocks, start


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_do_not_depend_on_the_batch(backend: str, kv_dtype: str, window: int | None):
    """Also on a sliding-window layer (40 keys: the window starts inside a block, and the
    compiled kernel skips the blocks before it, which depend on the item's other rows)."""
    lengths = {0: 300, 1: 600, 2: 40, 3: 517}
    kv, q, blocks, num_blocks = _problem(lengths)

    def cache() -> PagedKVCache:
        return PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, D, torch.device("cpu"))

    w = window
    for n_query in (1, 37):  # decode, and a prefill chunk
        alone = {s: _run(backend, [(s, n_query, blocks[s])], cache(), kv, q, w)[0]
                 for s in lengths}
        batched = _run(backend, [(s, n_query, blocks[s]) for s in lengths], cache(), kv, q, w)
        for s, out in zip(lengths, batched):
            assert torch.equal(out, alone[s]), f"seq {s} ({lengths[s]} tokens), {n_query} rows"
        mixed = _run(backend, [(1, 37, blocks[1]), (0, 1, blocks[0]), (3, 1, blocks[3])],
                     cache(), kv, q, w)
        assert torch.equal(mixed[1], _run(backend, [(0, 1, blocks[0])], cache(), kv, q, w)[0])


@pytest.mark.skipif(cpu_ops() is None, reason=NO_KERNELS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_compiled_rows_do_not_depend_on_the_chunk(kv_dtype: str, window: int | None):
    """The compiled kernel's rows are the same computed as a decode (one row), inside a
    prefill chunk at any offset of its tiles, or in a chunk of a different length; and
    whatever the cache holds past a row's own position (written by a longer chunk, or not
    yet)."""
    for n in (200, 2 * SEGMENT + 100):  # one segment, and three
        _check_chunks(kv_dtype, window, n)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_torch_paged_rows_do_not_depend_on_the_chunk(kv_dtype: str, window: int | None):
    """The PyTorch backend's rows (block sizes the compiled kernel does not take, or no
    compiled kernels) are the same as a decode and inside a prefill chunk: a row's products
    are its own (one product of a whole chunk had its sums blocked differently by MKL, and a
    request's tokens changed with the chunk size)."""
    for n in (46, 300):
        kv, q, blocks, num_blocks = _problem({0: n})

        def cache(num_blocks: int = num_blocks) -> PagedKVCache:
            return PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, D, torch.device("cpu"))

        whole = _run("torch_paged", [(0, n, blocks[0])], cache(), kv, q, window)[0]
        for n_query in (1, 3, 13, 37):
            part = _run("torch_paged", [(0, n_query, blocks[0])], cache(), kv, q, window)[0]
            assert torch.equal(part, whole[-n_query:]), (n, n_query)


def _check_chunks(kv_dtype: str, window: int | None, n: int) -> None:
    lengths = {0: n}
    kv, q, blocks, num_blocks = _problem(lengths)

    def cache() -> PagedKVCache:
        return PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, D, torch.device("cpu"))

    whole = _run("cpu_paged", [(0, n, blocks[0])], cache(), kv, q, window)[0]
    for n_query in (1, 3, 13, 64):
        part = _run("cpu_paged", [(0, n_query, blocks[0])], cache(), kv, q, window)[0]
        assert torch.equal(part, whole[-n_query:]), n_query
    # The first 150 rows as one chunk: the cache then holds nothing past position 149.
    short = {0: (kv[0][0][:150], kv[0][1][:150])}
    first = _run("cpu_paged", [(0, 150, blocks[0])], cache(), short, {0: q[0][:150]},
                 window)[0]
    assert torch.equal(first, whole[:150])
    if n > SEGMENT + 20:
        # A chunk whose rows straddle the end of the first segment, against the same rows
        # decoded one at a time (one segment for the first, two for the rest).
        end = SEGMENT + 20
        upto = {0: (kv[0][0][:end], kv[0][1][:end])}
        chunk = _run("cpu_paged", [(0, 37, blocks[0])], cache(), upto, {0: q[0][:end]},
                     window)[0]
        assert torch.equal(chunk, whole[end - 37:end])


@pytest.mark.skipif(cpu_ops() is None, reason=NO_KERNELS)
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_compiled_rows_do_not_depend_on_the_threads(kv_dtype: str):
    """A lone decode's 3 KV heads do not share out over 2 threads: the kernel then splits
    them by query head. Rows are the same on 1, 2 and 3 threads, alone and batched."""
    lengths = {0: 300, 1: 600, 2: 40, 3: 517}
    kv, q, blocks, num_blocks = _problem(lengths)

    def cache() -> PagedKVCache:
        return PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, D, torch.device("cpu"))

    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for n_query in (1, 5):
                outs.append([_run("cpu_paged", [(s, n_query, blocks[s])], cache(), kv, q)[0]
                             for s in lengths])
                outs.append(list(_run("cpu_paged", [(s, n_query, blocks[s]) for s in lengths],
                                      cache(), kv, q)))
    finally:
        torch.set_num_threads(before)
    # Per thread count: alone and batched, for 1 query row, then for 5.
    for k, got in enumerate(outs):
        want = outs[0] if k % 4 < 2 else outs[2]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), k


@pytest.mark.skipif(cpu_ops() is None, reason=NO_KERNELS)
@pytest.mark.parametrize("kv_dtype", list(KV_CACHE_DTYPES))
def test_compiled_rows_do_not_depend_on_loading_ahead(kv_dtype: str):
    """With many decodes, a thread takes every KV head of a sequence at once and the first
    of them reads the blocks of all (``set_attention_load_ahead``): lengths of one to three
    segments, short ones within the float formats' byte budget, long ones past it, alone
    and beside a prefill chunk. The rows are bitwise those of prefetches alone."""
    lengths = {s: n for s, n in enumerate((40, 75, 130, 160, 300, 517, 600, 90, 1100, 33,
                                           250, 64))}
    kv, q, blocks, num_blocks = _problem(lengths)
    ops = cpu_ops()

    def run(on: bool, chunk: int):
        before = ops.set_attention_load_ahead(on)
        try:
            cache = PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, D, torch.device("cpu"))
            seqs = [(s, chunk if s == 5 else 1, blocks[s]) for s in lengths]
            return _run("cpu_paged", seqs, cache, kv, q)
        finally:
            ops.set_attention_load_ahead(before)

    for chunk in (1, 7):
        on, off = run(True, chunk), run(False, chunk)
        assert all(torch.equal(a, b) for a, b in zip(on, off)), chunk


@pytest.mark.parametrize("kv_dtype", list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64_reference(backend: str, kv_dtype: str):
    _check_against_float64(backend, kv_dtype, D)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_matches_float64_reference(backend: str, kv_dtype: str, window: int):
    """A query at position p sees keys p - window + 1..p: windows of one key, inside a
    block, exactly a block, and spanning blocks."""
    _check_against_float64(backend, kv_dtype, D, window)


@pytest.mark.parametrize("window", [None, 40, SEGMENT + 100])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_contexts_match_float64_reference(backend: str, kv_dtype: str,
                                               window: int | None):
    """Rows of two and three segments, windows that start inside a segment or span two,
    and a prefill chunk that straddles a segment's end."""
    _check_against_float64(backend, kv_dtype, D, window,
                           lengths={0: 2 * SEGMENT + 70, 1: SEGMENT + 9}, n_query=20)


@pytest.mark.skipif(cpu_ops() is None, reason=NO_KERNELS)
@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_compiled_int8_pairs_any_head_dim(head_dim: int):
    """The integer path takes values 64 dimensions at a time: narrower, wider and uneven
    heads agree with the reference too."""
    _check_against_float64("cpu_paged", "int8", head_dim)


def _check_against_float64(backend: str, kv_dtype: str, d: int,
                           window: int | None = None, lengths: dict[int, int] | None = None,
                           n_query: int = 5) -> None:
    lengths = lengths or {0: 70, 1: 5, 2: 33}
    kv, q, blocks, num_blocks = _problem(lengths, d)
    cache = PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, d, torch.device("cpu"))
    outs = _run(backend, [(s, n_query, blocks[s]) for s in lengths], cache, kv, q, window)
    for s, out in zip(lengths, outs):
        # The reference reads what the cache holds, so only the attention math is compared.
        ids = torch.tensor(blocks[s])
        k_all, v_all = cache.gather(ids, cache.gather_buffer(len(ids)),
                                    cache.gather_buffer(len(ids)))
        k_all = k_all.reshape(-1, HKV, d)[: lengths[s]].double()
        v_all = v_all.reshape(-1, HKV, d)[: lengths[s]].double()
        integer = backend == "cpu_paged" and cache.pack == 2
        for i in range(min(n_query, lengths[s])):
            pos = lengths[s] - min(n_query, lengths[s]) + i
            lo = 0 if window is None else max(0, pos - window + 1)
            qi = q[s][pos].view(HKV, HQ // HKV, d)
            if integer:
                qi = _rounded_to_16_bits(qi)
            scores = torch.einsum("hgd,lhd->hgl", qi.double(), k_all[: pos + 1]) * d**-0.5
            scores[..., :lo] = float("-inf")
            p = (scores - scores.amax(-1, keepdim=True)).exp()
            weights = p
            if integer:
                vs = cache.value_scale[ids].transpose(1, 2).reshape(-1, HKV)[: pos + 1]
                weights = _weights_rounded_to_16_bits(scores, vs.double())
            ref = torch.einsum("hgl,lhd->hgd", weights / p.sum(-1, keepdim=True),
                               v_all[: pos + 1])
            # A weight on a rounding tie may land one code away from the reference's:
            # at most 1 / 32767 of the largest possible weight times the largest value.
            atol = 1e-5 + (v_all.abs().max().item() / 32767 if integer else 0.0)
            torch.testing.assert_close(out[i].double(), ref.reshape(-1), atol=atol, rtol=1e-5)


def _rounded_to_16_bits(q: torch.Tensor) -> torch.Tensor:
    """Each query vector as the compiled kernel multiplies it with an int8 cache stored in
    pairs: round(q / s) s with s = max|q| / 32767."""
    s = q.abs().amax(-1, keepdim=True) / 32767
    return torch.round(q * (1 / s)) * s


def _weights_rounded_to_16_bits(scores: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """Softmax numerators of ``scores`` [Hkv, G, L] (-inf where a key is not seen) as the
    same kernel weighs the values, segment by segment: ``p = exp(score - the segment's
    max)`` (at most 1), ``w = p vs`` (``vs`` [L, Hkv] the values' scales) rounded to 16 bits
    of each block's largest scale, ``round(w / sw) sw`` with ``sw = max vs / 32767``, then
    times ``exp(segment max - row max)`` as the segments are merged; returned divided by
    ``vs`` again, as weights of the dequantized values."""
    vs = vs.t().unsqueeze(1)
    out = torch.zeros_like(scores)
    row_max = scores.amax(-1, keepdim=True)
    for s in range(0, scores.shape[-1], SEGMENT):
        seg = scores[..., s:s + SEGMENT]
        seg_max = seg.amax(-1, keepdim=True)
        if torch.isinf(seg_max).all():
            continue  # no key of this segment is seen
        w = (seg - seg_max).exp() * vs[..., s:s + SEGMENT]
        for b in range(0, w.shape[-1], BS):
            sw = vs[..., s + b:s + b + BS].amax(-1, keepdim=True) / 32767
            out[..., s + b:s + b + BS] = torch.round(w[..., b:b + BS] / sw) * sw
        out[..., s:s + SEGMENT] *= (seg_max - row_max).exp()
    return out / vs


@pytest.mark.skipif(cpu_ops() is None, reason=NO_KERNELS)
@pytest.mark.parametrize("kv_dtype", list(KV_CACHE_DTYPES))
def test_compiled_store_matches_python_store(kv_dtype: str):
    """The compiled backend writes the same bytes (codes and scales) as PagedKVCache.store."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(21, HKV, D, generator=gen) * 3
    v = torch.randn(21, HKV, D, generator=gen)
    slots = torch.randperm(5 * BS, generator=gen)[:21]
    ours, ref = (PagedKVCache.allocate(kv_dtype, 5, BS, HKV, D, torch.device("cpu"))
                 for _ in range(2))
    ref.store(slots, k, v)
    code = ours.max_code or 0.0
    cpu_ops().store_kv(k, ours.key, ours.key_scale, slots, code, True)
    cpu_ops().store_kv(v, ours.value, ours.value_scale, slots, code, False)
    for a, b in ((ours.key, ref.key), (ours.value, ref.value)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if ref.key_scale is not None:
        assert torch.equal(ours.key_scale, ref.key_scale)
        assert torch.equal(ours.value_scale, ref.value_scale)


@pytest.mark.skipif(cpu_ops() is None, reason=NO_KERNELS)
@pytest.mark.parametrize("kv_dtype", list(KV_CACHE_DTYPES))
def test_compiled_dominant_key(kv_dtype: str):
    """One key scores ~100 above the rest: the others' softmax weights fall below float32's
    normal range (the kernel flushes them to zero rather than take the slow denormal path),
    the output is that key's value, and the calling thread's float state is left as it was:
    denormals still come out of PyTorch afterwards."""
    lengths = {0: 150}
    kv, q, blocks, num_blocks = _problem(lengths)
    k = kv[0][0]
    q[0][-1] = k[77].repeat_interleave(HQ // HKV, dim=0) * 16.0  # ~128 against ~+-20
    cache = PagedKVCache.allocate(kv_dtype, num_blocks, BS, HKV, D, torch.device("cpu"))
    out = _run("cpu_paged", [(0, 1, blocks[0])], cache, kv, q)[0]
    ids = torch.tensor(blocks[0])
    _, v_all = cache.gather(ids, cache.gather_buffer(len(ids)), cache.gather_buffer(len(ids)))
    expected = v_all.reshape(-1, HKV, D)[77].repeat_interleave(HQ // HKV, dim=0).reshape(-1)
    # With an int8 cache in pairs the weight is rounded to 16 bits of its block's largest
    # possible weight: one part in 2^16 of the block's largest value.
    atol = 1e-5 + (v_all.abs().max().item() / 32767 if cache.pack == 2 else 0.0)
    torch.testing.assert_close(out[0], expected, atol=atol, rtol=1e-5)
    tiny = torch.tensor([1e-30]) * torch.tensor([1e-10])
    assert tiny.item() > 0, "flush-to-zero leaked out of the attention kernel"
