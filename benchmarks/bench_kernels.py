"""The compiled CPU kernels of one decode step at batch 64, each beside the PyTorch code it
replaces, timed in the same run (best of --repeats; the host is shared and noisy).

- attention over a paged cache (SmolLM2's 9 query / 3 KV heads of 64), per KV cache
  format, against the ``torch_paged`` backend;
- int8 and int4 linear layers at SmolLM2's shapes against ``torch._int_mm`` with the same
  two-level activations and ``aten._weight_int4pack_mm_for_cpu``;
- the greedy argmax of [64, 49152] logits against ``Tensor.argmax``.

    python benchmarks/bench_kernels.py [--batch 64] [--context 512] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from llmserve.attention import get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.attention.kv_format import KV_CACHE_DTYPES, PagedKVCache
from llmserve.csrc import cpu_ops
from llmserve.layers.quantization import int4, int8, w8a8
from llmserve.sample import ops as sample_ops

HQ, HKV, D, BS = 9, 3, 64, 16
LINEAR_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                 "down": (1536, 576)}


def best_ms(fn: Callable[[], object], repeats: int, inner: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def attention(batch: int, context: int, kv_dtype: str, repeats: int) -> tuple[float, float]:
    """(compiled, torch_paged) ms for one layer's decode attention."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BS)
    pool = batch * blocks_per_seq * 2  # blocks scattered over a pool twice the size
    cache = PagedKVCache.allocate(kv_dtype, pool, BS, HKV, D, torch.device("cpu"))
    tables = torch.randperm(pool, generator=gen)[: batch * blocks_per_seq].view(batch, -1)
    earlier = torch.arange(context - 1)
    for b in range(batch):
        slots = tables[b][earlier // BS] * BS + earlier % BS
        cache.store(slots, torch.randn(context - 1, HKV, D, generator=gen),
                    torch.randn(context - 1, HKV, D, generator=gen))
    pos = torch.full((batch,), context - 1)
    layout = BatchLayout(tables[torch.arange(batch), pos // BS] * BS + pos % BS, tables, pos,
                         [1] * batch, [context] * batch, BS)
    q = torch.randn(batch, HQ, D, generator=gen)
    k = torch.randn(batch, HKV, D, generator=gen)
    v = torch.randn(batch, HKV, D, generator=gen)
    times = []
    for name in ("cpu_paged", "torch_paged"):
        backend = get_attention_backend(name)
        meta = backend.build_metadata(layout)
        times.append(best_ms(lambda b=backend, m=meta: b.forward(q, k, v, cache, m, D**-0.5),
                             repeats))
    return times[0], times[1]


def linear_pair(fmt: str, batch: int, k: int, n: int, gen: torch.Generator
                ) -> tuple[Callable[[], object], Callable[[], object]]:
    """(compiled, PyTorch) calls of one [batch, k] x [k, n] layer in ``fmt``."""
    kernels = cpu_ops()
    x = torch.randn(batch, k, generator=gen)
    if fmt in ("int8", "w8a8"):
        levels, group = (2, k) if fmt == "int8" else (1, w8a8.activation_group(k, w8a8.BODY_GROUP))
        w = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
        scale = torch.rand(n, generator=gen)
        packed, excess = int8.pack_vnni(w, group)
        padded_scale = torch.zeros(packed.shape[0] * 64)
        padded_scale[:n] = scale
        if fmt == "int8":
            reference = lambda: int8.int8_matmul(x, w, scale)  # noqa: E731
        else:
            reference = lambda: w8a8.w8a8_matmul(x, w, scale, group)  # noqa: E731
        return (lambda: kernels.int8_linear(x, packed, excess, padded_scale, n, levels, group),
                reference)
    groups = k // 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale, zero = torch.rand(n, groups, generator=gen), torch.rand(n, groups, generator=gen)
    packed, scale_zero = int4.pack_vnni(q, scale, zero)
    w_aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    # The fallback's form (int4.py): w = (q - 8) scale + (zero + 8 scale), in bfloat16.
    sz = torch.stack([scale, zero + 8 * scale], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return (lambda: kernels.int4_linear(x, packed, scale_zero, 32, n),
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.bfloat16(), w_aten, 32, sz).float())


def linear(batch: int, fmt: str, repeats: int) -> tuple[float, float]:
    """(compiled, PyTorch) ms for the four linear layers of one SmolLM2 block."""
    gen = torch.Generator().manual_seed(0)
    ours = base = 0.0
    for k, n in LINEAR_SHAPES.values():
        compiled, reference = linear_pair(fmt, batch, k, n, gen)
        ours += best_ms(compiled, repeats)
        base += best_ms(reference, repeats)
    return ours, base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if cpu_ops() is None or not cpu_ops().int_kernels:
        raise SystemExit("needs the compiled CPU kernels with their integer kernels "
                         "(AVX-512 VNNI or AVX2)")
    print(f"batch {args.batch}, {torch.get_num_threads()} threads, best of {args.repeats}")
    print("| kernel (one layer) | compiled ms | PyTorch ms | speedup |\n|---|---|---|---|")
    for kv in KV_CACHE_DTYPES:
        ours, base = attention(args.batch, args.context, kv, args.repeats)
        print(f"| attention, {args.context} tokens of context, KV {kv} | {ours:.3f} | "
              f"{base:.3f} | {base / ours:.1f}x |", flush=True)
    for fmt in ("int8", "w8a8", "int4"):
        ours, base = linear(args.batch, fmt, args.repeats)
        print(f"| {fmt} linear layers (qkv, o, gate_up, down) | {ours:.3f} | {base:.3f} | "
              f"{base / ours:.1f}x |", flush=True)
    logits = torch.randn(args.batch, 49152)
    ours = best_ms(lambda: sample_ops.argmax(logits), args.repeats)
    base = best_ms(lambda: logits.argmax(dim=1), args.repeats)
    print(f"| greedy argmax of [{args.batch}, 49152] logits | {ours:.3f} | {base:.3f} | "
          f"{base / ours:.1f}x |")


if __name__ == "__main__":
    main()
