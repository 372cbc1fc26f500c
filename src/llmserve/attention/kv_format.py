"""How one layer's paged KV cache is stored on CPU: float32, bfloat16, fp8 (e4m3) or int8
(the GPU backend, ``triton_paged``, has a layout of its own and adds float16).

The 8-bit formats keep one float32 scale per token and KV head (``max|x| / max code``), so
each stored vector is quantized on its own: a token's cached values do not depend on the
rest of the batch, and the scales add 4 bytes to each 64-value head vector (counted in the
capacity). Readers get float32 back from ``gather``.

Layout of one layer, with ``P`` elements packed together (``PagedKVCache.pack``): keys
``[blocks, Hkv, D / P, block_size, P]``, values ``[blocks, Hkv, block_size / P, D, P]``.
With ``P = 1`` (float formats, fp8) a block's keys of one head are a ``[D, block_size]``
tile (one vector holds a dimension of consecutive tokens) and its values
``[block_size, D]``. int8 packs pairs (``P = 2``): two dimensions of a token's key, or
the same dimension of two consecutive tokens' values, sit side by side, the operand
layout of the 16-bit integer dot product (``vpdpwssd``) the compiled kernel multiplies
them with.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

# name -> (storage dtype, largest code for scaled formats, or None when stored as is)
KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, float | None]] = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "int8": (torch.int8, 127.0),
}
# Stored by the GPU backend only (``triton_paged``), for float16 models.
GPU_ONLY_KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, float | None]] = {
    "float16": (torch.float16, None),
}
_PACKED_PAIRS = ("int8",)  # formats stored in pairs where block_size and head_dim allow
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES, *GPU_ONLY_KV_CACHE_DTYPES)


# Weight formats whose models get an int8 KV cache from ``auto`` on CPU.
QUANTIZED_WEIGHTS = ("int4", "int8", "w8a8")


def resolve_kv_cache_dtype(name: str, model_dtype: str, quantization: str = "none",
                           device: str = "cpu") -> str:
    """The KV cache dtype ``name`` stands for.

    ``auto``: on CPU, a model with quantized weights (int4, int8, w8a8) gets an int8 cache:
    a quarter of float32's bytes (3.8x the tokens in the same memory with its scales), the
    fastest attention kernel, and perplexity within 0.2% of a float32 cache's on the
    default model (BENCHMARKS.md, session 32).
    Dense models, and every model on a GPU, keep the dense weight dtype (float32, bfloat16
    or float16), as vLLM's ``auto`` does.
    """
    if name not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {name!r}")
    if name != "auto":
        return name
    on_cpu = torch.device(device).type == "cpu"
    return "int8" if on_cpu and quantization in QUANTIZED_WEIGHTS else model_dtype


def kv_bytes_per_vector(name: str, head_dim: int) -> int:
    """Bytes one token's key (or value) of one KV head takes, scales included."""
    dtype, max_code = {**KV_CACHE_DTYPES, **GPU_ONLY_KV_CACHE_DTYPES}[name]
    return head_dim * dtype.itemsize + (4 if max_code is not None else 0)


@dataclass
class PagedKVCache:
    """One layer's cache: keys, values (+ scales) in the layout above."""

    key: torch.Tensor  # [num_blocks, Hkv, D / P, block_size, P]
    value: torch.Tensor  # [num_blocks, Hkv, block_size / P, D, P]
    key_scale: torch.Tensor | None  # [num_blocks, Hkv, block_size] float32
    value_scale: torch.Tensor | None
    max_code: float | None

    @classmethod
    def allocate(cls, name: str, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device) -> PagedKVCache:
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"a {name} KV cache is stored on GPUs only (the triton_paged "
                             f"backend); on CPU choose one of {sorted(KV_CACHE_DTYPES)}")
        dtype, max_code = KV_CACHE_DTYPES[name]
        pairs = name in _PACKED_PAIRS and block_size % 2 == 0 and head_dim % 2 == 0
        p = 2 if pairs else 1
        # Zeroed, so that padded reads of never-written slots stay finite.
        key = zeros((num_blocks, num_kv_heads, head_dim // p, block_size, p), dtype, device)
        value = zeros((num_blocks, num_kv_heads, block_size // p, head_dim, p), dtype, device)
        scales = (None, None) if max_code is None else tuple(
            zeros((num_blocks, num_kv_heads, block_size), torch.float32, device)
            for _ in range(2))
        return cls(key, value, *scales, max_code)

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def block_size(self) -> int:
        return self.key.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.value.shape[3]

    @property
    def pack(self) -> int:
        """Elements packed side by side (P in the layout above)."""
        return self.key.shape[4]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` [T, Hkv, D] float32 at cache slots ``slots`` [T]."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self._store(self.key, self.key_scale, blocks, offsets, k, transposed=True)
        self._store(self.value, self.value_scale, blocks, offsets, v, transposed=False)

    def _store(self, cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
               offsets: torch.Tensor, x: torch.Tensor, transposed: bool) -> None:
        if scales is not None:
            s = x.abs().amax(dim=-1).clamp_(min=torch.finfo(torch.float32).tiny)
            s.div_(self.max_code)  # [T, Hkv]
            x = x / s.unsqueeze(-1)
            if cache.dtype == torch.int8:
                x = x.round_()
            scales[blocks, :, offsets] = s
        # Written as same-width integers: index_put_ has no float8 kernel on CPU.
        codes = as_int(x.to(cache.dtype))  # [T, Hkv, D]
        p = self.pack
        if transposed:  # dimension d at [d // P, offset, d % P]
            tokens, heads, dim = codes.shape
            as_int(cache)[blocks, :, :, offsets] = codes.view(tokens, heads, dim // p, p)
        else:  # token offset at [offset // P, d, offset % P]
            as_int(cache)[blocks, :, offsets // p, :, offsets % p] = codes

    def gather(self, block_ids: torch.Tensor, keys_out: torch.Tensor,
               values_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``block_ids`` [n] of keys and values as float32 [n, block_size, Hkv, D]
        (the backend-neutral layout; a copy).

        ``keys_out``/``values_out`` are reusable byte buffers of [n, block bytes]."""
        return (self._gather(self.key, self.key_scale, block_ids, keys_out, transposed=True),
                self._gather(self.value, self.value_scale, block_ids, values_out,
                             transposed=False))

    def _gather(self, cache: torch.Tensor, scales: torch.Tensor | None,
                block_ids: torch.Tensor, out: torch.Tensor, transposed: bool) -> torch.Tensor:
        torch.index_select(_bytes(cache).view(cache.shape[0], -1), 0, block_ids, out=out)
        x = out.view(cache.dtype).view(-1, *cache.shape[1:])
        # -> [n, block_size, Hkv, D / P, P] (keys) or [n, block_size / P, P, Hkv, D]
        x = x.permute(0, 3, 1, 2, 4) if transposed else x.permute(0, 2, 4, 1, 3)
        x = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
        x = x.view(x.shape[0], self.block_size, self.num_kv_heads, self.head_dim)
        if scales is None:
            return x
        s = scales.index_select(0, block_ids).transpose(1, 2)  # [n, block_size, Hkv]
        return x.mul_(s.unsqueeze(-1))

    def gather_buffer(self, num: int) -> torch.Tensor:
        """A byte buffer that ``gather`` can fill with ``num`` blocks of keys or values."""
        return torch.empty(num, self.key[0].numel() * self.key.element_size(),
                           dtype=torch.uint8, device=self.key.device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def as_int(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element's width (a view): what indexing
    copies on CPU, which has no float8 kernels for it."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU in fresh anonymous memory, which the OS hands out zeroed a page
    at a time as it is first touched. ``torch.zeros`` writes every byte at once: 1.5 s of a
    server's start for a 2 GiB cache, which then also counted as resident before any request
    used it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
