"""How many KV blocks fit in a memory budget, and how that is reported."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from llmserve.kv_cache.groups import KVCacheGroup, blocks_per_sequence

GIB = 1024**3


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    bytes_per_vector: int  # one token's key (or value) of one KV head, scales included
    dtype_name: str = "float32"
    groups: tuple[KVCacheGroup, ...] = ()  # empty: one group of every layer, no window

    def __post_init__(self) -> None:
        if not self.groups:
            object.__setattr__(self, "groups",
                               (KVCacheGroup(tuple(range(self.num_layers)), None),))

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0].layers)

    @property
    def bytes_per_token(self) -> int:
        """One token's keys and values in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.bytes_per_vector

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.layers_per_block * self.num_kv_heads * self.bytes_per_vector * (
            self.block_size)

    @property
    def has_windows(self) -> bool:
        return any(g.window is not None for g in self.groups)

    def bytes_per_sequence(self, num_tokens: int, step_tokens: int | None = None) -> int:
        """Most KV bytes one sequence of ``num_tokens`` holds (sliding windows included)."""
        return self.bytes_per_block * blocks_per_sequence(self.groups, num_tokens,
                                                          self.block_size, step_tokens)

    def bytes_per_sequence_without_windows(self, num_tokens: int) -> int:
        """The same sequence if every layer kept its whole context."""
        return self.bytes_per_block * len(self.groups) * -(-num_tokens // self.block_size)

    def max_sequence_tokens(self, num_blocks: int, step_tokens: int | None = None) -> int:
        """The longest sequence whose blocks fit in ``num_blocks``."""
        lo, hi = 0, 1 << 40  # hi: never fits (unless every layer has a window)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            fits = blocks_per_sequence(self.groups, mid, self.block_size,
                                       step_tokens) <= num_blocks
            lo, hi = (mid, hi) if fits else (lo, mid)
        return lo


def default_kv_cache_memory_gib(device: str = "cpu") -> float:
    """On CPU a tenth of the memory available now, between 0.25 and 2 GiB; on CUDA half of
    the device memory free once the weights are loaded (the rest: activations, graphs)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return max(0.25, 0.5 * free / GIB)
    available = psutil.virtual_memory().available / GIB
    return max(0.25, min(2.0, 0.1 * available))


def check_kv_cache_memory(memory_gib: float, device: str = "cpu") -> None:
    """Refuse a budget larger than the device's whole memory: the cache would fail later,
    under load, or (its block pool alone) exhaust the host first."""
    if device.startswith("cuda"):
        import torch

        total, where = torch.cuda.mem_get_info(torch.device(device))[1], f"{device}'s"
    else:
        total, where = psutil.virtual_memory().total, "this machine's"
    if memory_gib * GIB > total:
        raise ValueError(f"--kv-cache-memory {memory_gib} GiB is more than {where} "
                         f"{total / GIB:.1f} GiB of memory")


def num_blocks_for_memory(spec: KVCacheSpec, memory_gib: float, device: str = "cpu") -> int:
    check_kv_cache_memory(memory_gib, device)
    blocks = int(memory_gib * GIB) // spec.bytes_per_block
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {memory_gib} GiB holds no block of "
                         f"{spec.bytes_per_block} bytes; give it more memory")
    return blocks


def describe_capacity(spec: KVCacheSpec, num_blocks: int, max_model_len: int,
                      step_tokens: int | None = None) -> str:
    gib = num_blocks * spec.bytes_per_block / GIB
    head = (f"KV cache: {num_blocks} blocks x {spec.block_size} tokens x "
            f"{spec.layers_per_block} layers ({gib:.2f} GiB of {spec.dtype_name}, "
            f"{spec.bytes_per_token} bytes/token in all layers)")
    per_seq = spec.bytes_per_sequence(max_model_len, 1)
    fit = num_blocks * spec.bytes_per_block / per_seq
    if not spec.has_windows:
        return (f"{head} = {num_blocks * spec.block_size} tokens; "
                f"{fit:.1f} sequences of full context ({max_model_len} tokens) fit")
    without = spec.bytes_per_sequence_without_windows(max_model_len)
    chunked = spec.bytes_per_sequence(max_model_len, step_tokens)
    windows = sorted({g.window for g in spec.groups if g.window is not None})
    sliding = sum(len(g.layers) for g in spec.groups if g.window is not None)
    return (f"{head}; {sliding} of {spec.num_layers} layers keep a sliding window "
            f"({', '.join(map(str, windows))} tokens): a sequence of full context "
            f"({max_model_len} tokens) holds {per_seq / 2**20:.1f} MiB, "
            f"{without / 2**20:.1f} MiB with every layer global "
            f"({1 - per_seq / without:.0%} saved; up to {chunked / 2**20:.1f} MiB while a "
            f"prefill chunk runs); {fit:.1f} such sequences fit")
