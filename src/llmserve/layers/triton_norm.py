"""RMSNorm's GPU arithmetic in Triton: the norm's own kernel, and the row statistics that the
linear kernel computes itself when it takes the norm in (``triton_linear``: the norm of a
decoder layer's input read in the product that follows it, one launch fewer).

**The same bits in either.** A row's ``1 / rms`` is its sum of squares in chunks of
``norm_block(n)[1]`` inputs: each chunk summed by an explicit pairwise tree (``_tree_sum``:
inputs 2i and 2i + 1, then pairs of those, ...), the chunks' sums added in order from zero.
``tl.sum`` would leave the order to the tensor's layout, which differs between this
kernel's one row and the linear's tile of rows; the tree fixes every addition. The kernels
that compute it are compiled without floating-point contraction (``NO_CONTRACTION``), so
that no square is fused into the addition after it in one kernel and not in the other.
The normalised value is ``(x * inv) * w``, rounded to the activations' dtype, in both.

Each function takes and returns tensors in the activations' dtype (bfloat16, float16 or
float32) and computes in float32; on CUDA tensors, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``), where the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.layers.triton_launch import pdl_for, pdl_launch, wait_for_inputs

NORM_CHUNK = 128  # inputs summed by one tree (fewer for rows shorter than this)
# The launch option of every kernel that computes ``inv_rms``: no fused multiply-adds.
NO_CONTRACTION = {"enable_fp_fusion": False}


def norm_block(n: int) -> tuple[int, int]:
    """A row of ``n``'s width in registers, and its inputs per tree (part of the
    arithmetic: the same in every kernel)."""
    block = triton.next_power_of_2(n)
    return block, min(NORM_CHUNK, block)


@triton.jit
def _tree_sum(v, LEVELS: tl.constexpr):
    """[R, 2^LEVELS] -> [R]: each row's entries added pairwise, level by level."""
    for _ in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(v, [v.shape[0], v.shape[1] // 2, 2]))
        v = a + b
    return tl.reshape(v, [v.shape[0]])


@triton.jit
def inv_rms(xf, n, eps, BLOCK: tl.constexpr, CHUNK: tl.constexpr, LEVELS: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of each row of ``xf`` [R, BLOCK] (float32, zeros past
    the row's ``n`` entries; BLOCK a multiple of CHUNK = 2^LEVELS): each chunk's squares
    summed by the tree, the chunks' sums added in order from zero (see the module
    docstring)."""
    rows: tl.constexpr = xf.shape[0]
    chunks = _tree_sum(tl.reshape(xf * xf, [rows * (BLOCK // CHUNK), CHUNK]), LEVELS)
    chunks = tl.reshape(chunks, [rows, BLOCK // CHUNK])
    which = tl.arange(0, BLOCK // CHUNK)
    total = tl.zeros([rows], tl.float32)
    for c in tl.static_range(BLOCK // CHUNK):  # in order; each sum picks one chunk exactly
        total += tl.sum(tl.where(which[None, :] == c, chunks, 0.0), 1)
    return 1.0 / tl.sqrt(total / n + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_d, stride_o,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     LEVELS: tl.constexpr, PDL: tl.constexpr):
    """One row: (``x += delta``, rounded to x's dtype, when ADD), then
    ``w * x * rsqrt(mean(x^2) + eps)`` in float32."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.reshape(inv_rms(tl.reshape(xf, [1, BLOCK]), n, eps, BLOCK, CHUNK, LEVELS), [])
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty),
             mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` [T, H]; with ``residual``, ``x`` is a delta: first
    ``residual += x`` in place, and the norm is of the sum."""
    rows_of = x if residual is None else residual
    rows, n = rows_of.shape
    out = torch.empty_like(rows_of)
    if rows:
        block, chunk = norm_block(n)
        _rms_norm_kernel[(rows,)](rows_of, x, weight, out, n, eps, rows_of.stride(0),
                                  x.stride(0), out.stride(0), ADD=residual is not None,
                                  BLOCK=block, CHUNK=chunk, LEVELS=chunk.bit_length() - 1,
                                  **NO_CONTRACTION, **pdl_launch(pdl_for(x)))
    return out
