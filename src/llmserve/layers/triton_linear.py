"""The linear layer's GPU kernel in Triton: ``x @ weight.T`` with the same bits for a row
alone and in any batch, and the gate/up product with its SiLU-and-multiply.

**Batch invariance.** cuBLAS picks its algorithm (tile shape, split-K) by the shape of the
product, so a row's result changes with the number of rows it is multiplied with, and
greedy output with the batch. ``linear`` tiles the product with a configuration chosen
from the weight's shape alone (never from the number of rows), sums each output over the
input in the same order for every batch, and does not specialise its kernel on the row
count: a row gets the same bits alone and in any batch.

**Split-K.** A decode (one row) streams the weight; a weight of fewer output tiles than
multiprocessors is also split over its inputs (``linear_config``). The parts are added in
the same launch: the last program to finish an output tile adds the tile's parts (see
``_linear_kernel``). ``LLMSERVE_SPLITK_REDUCE=kernel`` (read once, at import) brings back
the second launch, ``_sum_splits_kernel``, that adds them instead; both add the same
float32 parts in the same order, so they give the same bits, and the switch is there to
compare them (bits and time) on a GPU. With rows enough to fill the GPU without the split
(a prefill), one program per tile sums the parts one after another instead: the same
operations again, without writing the parts to memory.

**Gate/up.** ``linear_silu_and_mul`` writes ``silu(gate) * up`` from the product's tiles
(up to ``GATED_MAX_ROWS`` rows), with the bits of the product followed by
``silu_and_mul``, the activation's own kernel, which is here for that reason.

The functions take and return tensors in the weight's dtype (bfloat16, float16 or float32)
and sum in float32; on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), where the tests check them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmserve import envs
from llmserve.layers.triton_launch import INTERPRETED, pdl_for, pdl_launch, wait_for_inputs

_SMS = 132  # streaming multiprocessors of an H100/H200: enough tiles to fill them
# Split-K on a decode: programs per multiprocessor aimed at, and the output tile's width
# of a weight that splits. Part of the arithmetic (the parts), fixed per weight: read by
# ``linear_config``, whose cache a benchmark clears when it switches them.
TILES_PER_SM = 2
SPLIT_BLOCK_N = 64
_LINEAR_WARPS, _LINEAR_STAGES = 4, 3
# How the parts of a split linear are added (envs.LLMSERVE_SPLITK_REDUCE); read at call
# time from this module's global, so that tests can switch it.
SPLITK_REDUCE = envs.LLMSERVE_SPLITK_REDUCE
_MIN_COUNTERS = 1 << 16  # 256 KiB: every decode and a prefill of 8192 rows x 128 tiles
# A split linear of at least this many output tiles (four waves of a decode's programs)
# sums its parts in one program per tile (``in_order``); read at call time, so that tests
# and benchmarks can switch it. On an H200, 4096 rows: 1.3-2.0x faster than the parts in
# programs of their own (BENCHMARKS.md, session 38); 1024 rows (below it) not yet tried.
IN_ORDER_TILES = 4 * TILES_PER_SM * _SMS
# The gate/up projection of at most this many rows writes silu(gate) * up itself
# (``linear_silu_and_mul``: the same bits as the product and a second kernel, so the
# choice may follow the row count). H100: 16 us less a batch-1 step of a 1B model, 96 us
# more at 64 rows, where its epilogue costs more than the launch it saves (BENCHMARKS.md,
# session 44). 0: always two kernels. Read at call time.
GATED_MAX_ROWS = 8


@triton.jit
def _sum_part(a_ptr, w_ptr, rm, rn, n_ok, M, K, k_per_split, part, stride_am, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              UPCAST: tl.constexpr):
    """Part ``part`` of a tile (weight rows ``rn``, those of ``n_ok`` real): float32 sums
    from zero over its inputs [part * k_per_split, (part + 1) * k_per_split) (within K), in
    tiles of BLOCK_K, in order. The one place a part's inputs are chosen, whichever program
    sums it."""
    k_lo = part * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < k_hi), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + ks[:, None],
                    mask=n_ok[None, :] & (ks[:, None] < k_hi), other=0.0)  # [BK, BN]
        if UPCAST:  # the interpreter multiplies 16-bit matrices wrongly
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _store_tile(c_ptr, acc, rm, M, col, n_ok, stride_cm, GATED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's sums to C in its dtype; GATED: the tile's columns are (gate, up) pairs, and
    ``silu(gate) * up`` of the pairs goes to C (one column per pair), computed as
    ``silu_and_mul`` computes it from the rounded products."""
    if GATED:
        y = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        pair_col = tl.reshape(col, [BLOCK_N // 2, 2])  # a pair's two entries: one column
        pair_col, _ = tl.split(pair_col)
        pair_ok, _ = tl.split(tl.reshape(n_ok, [BLOCK_N // 2, 2]))
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(c_ptr + rm[:, None] * stride_cm + pair_col[None, :],
                 out.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & pair_ok[None, :])
    else:
        tl.store(c_ptr + rm[:, None] * stride_cm + col[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(a_ptr, w_ptr, c_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                   stride_am, stride_wn, stride_cm, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                   IN_ORDER: tl.constexpr, FUSED: tl.constexpr, GATED: tl.constexpr,
                   UPCAST: tl.constexpr, PDL: tl.constexpr):
    """C [M, N] = A [M, K] @ W [N, K]^T: float32 sums over K in tiles of BLOCK_K, in order.
    With SPLITS > 1 the inputs are cut into parts of ``k_per_split``, each summed from zero,
    and the parts' sums are added in order:
    - by one program per part: program (., ., s) writes its part to partials [S, M, N]
      (float32); ``_sum_splits_kernel`` adds them, or with FUSED the last program to finish
      the output tile does, as that kernel would: it counts the tile's finished parts in
      ``count_ptr[tile]`` (int32, 0 before the launch and left at 0 after it);
    - or, with IN_ORDER, by one program per tile, part after part: the same float32
      operations in the same order (the same bits), without the partials.
    GATED (W a fused gate/up projection [2d, K]): a tile of BLOCK_N columns takes the gate
    and up rows of BLOCK_N / 2 outputs, interleaved, and C [M, d] gets ``silu(gate) * up``
    of each pair. Each column's sums are those of the plain product."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rp = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # the tile's columns of the product
    if GATED:  # column 2j + u: weight row j (the gate) or d + j (up) of output j
        half = N // 2
        col = rp // 2
        rn = col + (rp % 2) * half
        n_ok = col < half
    else:
        col = rp
        rn = rp
        n_ok = rp < N
    wait_for_inputs(PDL)
    if IN_ORDER:
        acc = _sum_part(a_ptr, w_ptr, rm, rn, n_ok, M, K, k_per_split, 0, stride_am,
                        stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        for s in range(1, SPLITS):
            acc += _sum_part(a_ptr, w_ptr, rm, rn, n_ok, M, K, k_per_split, s, stride_am,
                             stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        _store_tile(c_ptr, acc, rm, M, col, n_ok, stride_cm, GATED, BLOCK_M, BLOCK_N)
    elif SPLITS > 1:
        split = tl.program_id(2)
        acc = _sum_part(a_ptr, w_ptr, rm, rn, n_ok, M, K, k_per_split, split, stride_am,
                        stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        ok = (rm[:, None] < M) & n_ok[None, :]
        parts = part_ptr + rm[:, None] * N + rp[None, :]
        tl.store(parts + split * M * N, acc, mask=ok)
        if FUSED:
            # Every thread's stores are issued before the one thread of the scalar atomic
            # releases them (GPU scope) with its increment; the program that sees the last
            # count acquires them all, then reads them from L2 (.cg: never a stale L1 line).
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(1) + pid_n
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLITS - 1:
                total = tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLITS):  # the order of _sum_splits_kernel
                    total += tl.load(parts + s * M * N, mask=ok, other=0.0,
                                     cache_modifier=".cg")
                _store_tile(c_ptr, total, rm, M, col, n_ok, stride_cm, GATED, BLOCK_M,
                            BLOCK_N)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # next call
    else:  # one part: k_per_split covers K
        acc = _sum_part(a_ptr, w_ptr, rm, rn, n_ok, M, K, k_per_split, 0, stride_am,
                        stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        _store_tile(c_ptr, acc, rm, M, col, n_ok, stride_cm, GATED, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, c_ptr, M, N, stride_cm, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    ok = offs < total
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(c_ptr + (offs // N) * stride_cm + offs % N, acc.to(c_ptr.dtype.element_ty),
             mask=ok)


@functools.cache
def linear_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits of K) of a weight [n, k]: a function of the weight
    alone, so that every batch size runs the same tiles and sums. A decode (one row)
    streams the weight, so a weight of fewer output tiles than multiprocessors is also split
    over its inputs (split-K: a fixed number of parts, added in order) into about two tiles
    per multiprocessor. The parts are added in the linear's own launch by the last program
    to finish each output tile (one launch fewer per split linear: on a decode the sums are
    tiny, and their launches and the gaps between kernels cost more than the additions), in
    the order of ``_sum_splits_kernel``, the second launch that ``LLMSERVE_SPLITK_REDUCE=
    kernel`` keeps: the same float32 additions in the same order, so the same bits.

    Programs per part are a way to fill the GPU, not part of the arithmetic: when the
    rows alone give enough tiles (``in_order``), one program per tile sums the parts one
    after another, with the same operations, and a prefill writes no partials (M x N
    float32 per part, which cost more than the product)."""
    block_k = 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    block_n = 128 if n >= 2 * _SMS * 128 else 64
    k_tiles = triton.cdiv(k, block_k)
    if triton.cdiv(n, block_n) >= _SMS:
        return 64, block_n, block_k, 1
    block_n = SPLIT_BLOCK_N
    tiles = triton.cdiv(n, block_n)
    splits = min(k_tiles, triton.cdiv(TILES_PER_SM * _SMS, tiles))
    splits = triton.cdiv(k_tiles, triton.cdiv(k_tiles, splits))  # no empty part
    return 64, block_n, block_k, splits


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split linears' per-tile counters on ``device``: int32 zeros, shared by every call
    (calls on one stream run one after another, and each leaves its counters at 0; two
    streams must not run split linears at once). Allocated generously on first use and grown
    when a call needs more; never while a CUDA graph is captured (the zeroing would be a
    memset in the graph), so a warm-up before a capture must run every shape first. A grown
    buffer's predecessors stay alive: a captured graph may still count in them."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"linear: {tiles} split-K tile counters needed on {device} during CUDA graph "
                "capture, but they can only be allocated outside it: run the same shapes "
                "once before capturing")
        size = max(tiles, _MIN_COUNTERS, 2 * buffers[-1].numel() if buffers else 0)
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def in_order(tiles: int, splits: int) -> bool:
    """Whether a split linear of ``tiles`` output tiles (rows x columns) sums its parts in
    one program per tile: when the tiles alone fill the GPU several times over."""
    return splits > 1 and tiles >= IN_ORDER_TILES


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K]^T -> [M, N] in the weight's dtype."""
    return _linear(x, weight, gated=False)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight))`` in one launch, with the same bits: ``weight`` is
    a fused gate/up projection [2d, K], the result [M, d]. Each tile multiplies the gate
    and up rows of its outputs side by side (the same tiles and sums as ``linear``) and
    writes ``silu(gate) * up``: the product's [M, 2d] never goes to memory, and a layer
    launches one kernel fewer. Past ``GATED_MAX_ROWS`` rows, and with
    ``LLMSERVE_SPLITK_REDUCE=kernel`` for a split weight (whose second launch adds plain
    parts), the product and ``silu_and_mul`` run as two kernels."""
    if weight.shape[0] % 2:
        raise ValueError(f"a gate/up weight has an even number of rows, not {weight.shape[0]}")
    if x.shape[0] > GATED_MAX_ROWS:
        return silu_and_mul(_linear(x, weight, gated=False))
    return _linear(x, weight, gated=True)


def _linear(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
    x = x.to(weight.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n // 2 if gated else n, dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, splits = linear_config(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, bk), splits) * bk
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    ordered = in_order(tiles, splits)
    parallel = splits > 1 and not ordered  # one program per part, partials in memory
    fused = parallel and SPLITK_REDUCE == "fused"
    if gated and parallel and not fused:
        return silu_and_mul(_linear(x, weight, gated=False))
    part = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if parallel
            else out)
    counters = _tile_counters(x.device, tiles) if fused else out
    pdl = pdl_for(x)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits if parallel else 1)
    _linear_kernel[grid](
        x, weight, out, part, counters, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLITS=splits, IN_ORDER=ordered,
        FUSED=fused, GATED=gated, UPCAST=INTERPRETED, num_warps=_LINEAR_WARPS,
        num_stages=_LINEAR_STAGES, **pdl_launch(pdl))
    if parallel and not fused:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, out, m, n, out.stride(0), SPLITS=splits, BLOCK=block, **pdl_launch(pdl))
    return out



@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [T, 2d] projection."""
    rows, width = gate_up.shape
    d = width // 2
    out = torch.empty(rows, d, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            gate_up, out, d, gate_up.stride(0), out.stride(0), BLOCK=block,
            **pdl_launch(pdl_for(gate_up)))
    return out

