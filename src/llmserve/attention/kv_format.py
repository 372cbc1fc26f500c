"""How one layer's paged KV cache is stored: float32, bfloat16, fp8 (e4m3) or int8.

The 8-bit formats keep one float32 scale per token and KV head (``max|x| / max code``), so
each stored vector is quantized on its own: a token's cached values do not depend on the
rest of the batch, and the scales add 4 bytes to each 64-value head vector (counted in the
capacity). Readers get float32 back from ``gather``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# name -> (storage dtype, largest code for scaled formats, or None when stored as is)
KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, float | None]] = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "int8": (torch.int8, 127.0),
}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(name: str, model_dtype: str) -> str:
    """``auto`` follows the dense weight dtype (float32 or bfloat16)."""
    if name not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {name!r}")
    return model_dtype if name == "auto" else name


def kv_bytes_per_vector(name: str, head_dim: int) -> int:
    """Bytes one token's key (or value) of one KV head takes, scales included."""
    dtype, max_code = KV_CACHE_DTYPES[name]
    return head_dim * dtype.itemsize + (4 if max_code is not None else 0)


@dataclass
class PagedKVCache:
    """One layer's cache: [num_blocks, block_size, Hkv, D] keys and values (+ scales)."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None  # [num_blocks, block_size, Hkv] float32
    value_scale: torch.Tensor | None
    max_code: float | None

    @classmethod
    def allocate(cls, name: str, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device) -> PagedKVCache:
        dtype, max_code = KV_CACHE_DTYPES[name]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, so that padded reads of never-written slots stay finite.
        key = torch.zeros(shape, dtype=dtype, device=device)
        value = torch.zeros(shape, dtype=dtype, device=device)
        scales = (None, None) if max_code is None else tuple(
            torch.zeros(shape[:3], device=device) for _ in range(2))
        return cls(key, value, *scales, max_code)

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` [T, Hkv, D] float32 at cache slots ``slots`` [T]."""
        self._store(self.key, self.key_scale, slots, k)
        self._store(self.value, self.value_scale, slots, v)

    def _store(self, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
               x: torch.Tensor) -> None:
        num_kv_heads, head_dim = x.shape[1], x.shape[2]
        if scales is not None:
            s = x.abs().amax(dim=-1).clamp_(min=torch.finfo(torch.float32).tiny)
            s.div_(self.max_code)  # [T, Hkv]
            x = x / s.unsqueeze(-1)
            if cache.dtype == torch.int8:
                x = x.round_()
            scales.view(-1, num_kv_heads).index_copy_(0, slots, s)
        codes = x.to(cache.dtype).contiguous()
        # Copied as raw bytes: index_copy_ has no float8 kernel on CPU.
        _bytes(cache).view(-1, num_kv_heads, head_dim * cache.element_size()).index_copy_(
            0, slots, _bytes(codes).view(-1, num_kv_heads, head_dim * cache.element_size()))

    def gather(self, block_ids: torch.Tensor, keys_out: torch.Tensor,
               values_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``block_ids`` [n] of keys and values as float32 [n, block_size, Hkv, D].

        ``keys_out``/``values_out`` are reusable byte buffers of [n, block bytes]."""
        return (self._gather(self.key, self.key_scale, block_ids, keys_out),
                self._gather(self.value, self.value_scale, block_ids, values_out))

    def _gather(self, cache: torch.Tensor, scales: torch.Tensor | None,
                block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.index_select(_bytes(cache).view(cache.shape[0], -1), 0, block_ids, out=out)
        x = out.view(cache.dtype).view(-1, *cache.shape[1:])
        if scales is None:
            return x.float() if x.dtype != torch.float32 else x
        s = scales.index_select(0, block_ids)  # [n, block_size, Hkv]
        return x.float().mul_(s.unsqueeze(-1))

    def gather_buffer(self, num: int) -> torch.Tensor:
        """A byte buffer that ``gather`` can fill with ``num`` blocks of keys or values."""
        return torch.empty(num, self.key[0].numel() * self.key.element_size(),
                           dtype=torch.uint8, device=self.key.device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)
