"""The layers' other GPU kernels in Triton: RMSNorm (with the residual add), rotary (with
the KV cache store) and the KV cache store; and, from ``triton_linear``, the linear
kernels. This module is the namespace ``gpu_kernels.gpu_ops_for`` gives the layers.

Why kernels of their own rather than PyTorch's ops: the PyTorch path of a decoder layer
launches about 30 kernels (each float cast, the rotary's halves, the residual add and the
norm apart), and a decode step of a small model is bound by them, at about 3 us a kernel
on an H100. Here a decode of up to 8 rows takes 8 a layer while its context fits one
attention segment. And the linear's own kernel keeps a row's bits whatever the batch
(``triton_linear``); every kernel here works row by row.

Each function takes and returns tensors in the activations' dtype (bfloat16, float16 or
float32) and computes in float32. They run on CUDA tensors, or on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``), where the tests check them against
PyTorch. Launches: ``triton_launch`` (programmatic dependent launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.layers.triton_launch import pdl_for, pdl_launch, wait_for_inputs
from llmserve.layers.triton_linear import linear, linear_silu_and_mul, silu_and_mul

__all__ = ["linear", "linear_silu_and_mul", "rms_norm", "rotary_", "rotary_and_store_kv",
           "silu_and_mul", "store_kv"]


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_d, stride_o,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
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
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
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
        _rms_norm_kernel[(rows,)](rows_of, x, weight, out, n, eps, rows_of.stride(0),
                                  x.stride(0), out.stride(0), ADD=residual is not None,
                                  BLOCK=triton.next_power_of_2(n), **pdl_launch(pdl_for(x)))
    return out


@triton.jit
def _rotate_heads(src, stride_h, dst, dst_stride_h, heads, cos, sin, HALF: tl.constexpr,
                  HEADS: tl.constexpr, HALF_P: tl.constexpr):
    """Each head's halves (x1, x2) of ``src`` become (x1 cos - x2 sin, x2 cos + x1 sin),
    rounded to the source's dtype, at ``dst`` (``src`` itself: in place)."""
    h = tl.arange(0, HEADS)
    d = tl.arange(0, HALF_P)
    ok = (h[:, None] < heads) & (d[None, :] < HALF)
    first = src + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=ok, other=0.0)
    x2 = tl.load(first + HALF, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out = dst + h[:, None] * dst_stride_h + d[None, :]
    tl.store(out, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype)
             .to(dst.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype)
             .to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_table, num_q_heads, num_k_heads, HALF: tl.constexpr,
                   HEADS: tl.constexpr, HALF_P: tl.constexpr, DIM_P: tl.constexpr,
                   STORE: tl.constexpr, PDL: tl.constexpr):
    """One token: each head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) at
    the token's position, in place; with STORE the keys go rotated to the key cache instead
    (``k`` is left as it was) and the values to the value cache, at the token's slot, as
    ``_store_kv_kernel`` writes them (caches [slots, Hkv, D] contiguous)."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF_P)
    cos = tl.load(cos_ptr + pos * stride_table + d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + d, mask=d < HALF, other=0.0)
    q = q_ptr + t * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, num_q_heads, cos, sin, HALF, HEADS, HALF_P)
    k = k_ptr + t * stride_kt
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = slot * num_k_heads * (2 * HALF)
        _rotate_heads(k, stride_kh, kc_ptr + dst, 2 * HALF, num_k_heads, cos, sin, HALF,
                      HEADS, HALF_P)
        h = tl.arange(0, HEADS)
        dims = tl.arange(0, DIM_P)
        ok = (h[:, None] < num_k_heads) & (dims[None, :] < 2 * HALF)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dims[None, :], mask=ok)
        tl.store(vc_ptr + dst + h[:, None] * (2 * HALF) + dims[None, :],
                 v.to(vc_ptr.dtype.element_ty), mask=ok)
    else:
        _rotate_heads(k, stride_kh, k, stride_kh, num_k_heads, cos, sin, HALF, HEADS, HALF_P)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] in place; ``cos``/``sin``
    [max_positions, D / 2] float32."""
    _rotary(q, k, positions, cos, sin, None)


def rotary_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slots: torch.Tensor) -> None:
    """``rotary_`` of ``q``, and ``store_kv`` of the rotated ``k`` and of ``v`` into caches
    [blocks, block_size, Hkv, D] at ``slots`` [T], in one launch with the same bits (``k``
    itself is not rotated: the caches hold it)."""
    _rotary(q, k, positions, cos, sin, (v, key_cache, value_cache, slots))


def _rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, store: tuple[torch.Tensor, ...] | None) -> None:
    tokens, num_q, dim = q.shape
    if not tokens:
        return
    v, key_cache, value_cache, slots = store if store is not None else (k, k, k, positions)
    _rotary_kernel[(tokens,)](
        q, k, positions, cos, sin, v, key_cache, value_cache, slots, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), num_q, k.shape[1],
        HALF=dim // 2, HEADS=triton.next_power_of_2(max(num_q, k.shape[1])),
        HALF_P=triton.next_power_of_2(dim // 2), DIM_P=triton.next_power_of_2(dim),
        STORE=store is not None, **pdl_launch(pdl_for(q)))



@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, num_heads,
                     HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, DIM_P: tl.constexpr,
                     PDL: tl.constexpr):
    """One token's keys and values into their slot: ``cache[slot, h, :]`` (a cache is
    [slots, Hkv, D] contiguous)."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS)
    d = tl.arange(0, DIM_P)
    ok = (h[:, None] < num_heads) & (d[None, :] < HEAD_DIM)
    dst = slot * num_heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``k``, ``v`` [T, Hkv, D] into caches [blocks, block_size, Hkv, D] at ``slots`` [T]."""
    tokens, heads, dim = k.shape
    if tokens:
        _store_kv_kernel[(tokens,)](
            k, v, key_cache, value_cache, slots, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), heads, HEAD_DIM=dim, HEADS=triton.next_power_of_2(heads),
            DIM_P=triton.next_power_of_2(dim), **pdl_launch(pdl_for(k)))
