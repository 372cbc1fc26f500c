"""How many KV blocks fit in a memory budget, and how that is reported."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

GIB = 1024**3


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    bytes_per_vector: int  # one token's key (or value) of one KV head, scales included
    dtype_name: str = "float32"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.bytes_per_vector

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def default_kv_cache_memory_gib() -> float:
    """A tenth of the memory available now, between 0.25 and 2 GiB."""
    available = psutil.virtual_memory().available / GIB
    return max(0.25, min(2.0, 0.1 * available))


def num_blocks_for_memory(spec: KVCacheSpec, memory_gib: float) -> int:
    blocks = int(memory_gib * GIB) // spec.bytes_per_block
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {memory_gib} GiB holds no block of "
                         f"{spec.bytes_per_block} bytes; give it more memory")
    return blocks


def describe_capacity(spec: KVCacheSpec, num_blocks: int, max_model_len: int) -> str:
    tokens = num_blocks * spec.block_size
    gib = num_blocks * spec.bytes_per_block / GIB
    full = tokens / max_model_len
    return (f"KV cache: {num_blocks} blocks x {spec.block_size} tokens = {tokens} tokens "
            f"({gib:.2f} GiB of {spec.dtype_name}, {spec.bytes_per_token} bytes/token); "
            f"{full:.1f} sequences of full context ({max_model_len} tokens) fit")
