"""The decode attention's share of a step on the GPU, timed as a step runs it: a CUDA graph
of one layer's KV store and attention for each of 16 layers, back to back, replayed.

On the 1.07B Llama shape of ``cuda_bench.py`` (32 query heads, 8 KV heads of 64, bfloat16
cache in blocks of 16 tokens), for each batch size and context, microseconds a layer of:

- ``store``: the KV store alone (the kernel before the attention in a layer without the
  rotary; its time is in every row below);
- ``one_segment``: store and attention, the metadata of the graphs for contexts of one
  segment (no split, no fold; contexts up to 512 keys only);
- ``split``: store, attention over every segment of a 16k context (as the graphs for long
  contexts run it: programs past a row's context end at once) and the fold of the
  segments;
- ``empty``: a Triton kernel that does nothing but wait for the one before: the cost of
  a launch in a graph, the floor of any kernel.

Each with programmatic dependent launch (PDL) and without; the attention's forms also with
the key loop's loads left to Triton's pipeliner (``triton_paged.PREFETCH`` off).

The eager profile of a step (``cuda_profile.py``) gives the attention ~9 us a layer at
batch 1, which may include its wait for the kernel before under PDL; these figures do not.

    python benchmarks/cuda_attention.py --out out/attention.json

``TRITON_INTERPRET=1 ... --device cpu`` runs each form once, eagerly, under Triton's
interpreter with small work (a smoke test of this script; no timing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from llmserve import envs
from llmserve.attention import triton_paged
from llmserve.attention.backend import BatchLayout
from llmserve.attention.triton_paged import SEGMENT, TritonKVCache, TritonPagedBackend
from llmserve.layers import triton_launch
from llmserve.layers.triton_launch import wait_for_inputs

LAYERS = 16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16
MAX_CONTEXT = 16384


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="256,512,2048")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    graphed = device.type == "cuda"
    backend = TritonPagedBackend()
    results = {"device": torch.cuda.get_device_name() if graphed else "cpu (interpreter)",
               "rows": []}
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if not graphed:  # the interpreter: small work
        batches, contexts = [1], [200, SEGMENT + 40]
    for batch in batches:
        for context in contexts:
            per_seq = -(-context // BLOCK)
            caches = [TritonKVCache.allocate("bfloat16", batch * per_seq + 1, BLOCK, KV_HEADS,
                                             HEAD_DIM, device) for _ in range(LAYERS)]
            for c in caches:
                c.key.normal_()
                c.value.normal_()
            tables = torch.arange(batch * per_seq, device=device).view(batch, per_seq)
            positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
            slots = tables[:, -1] * BLOCK + (context - 1) % BLOCK
            layout = BatchLayout(slots, tables, positions, [1] * batch, [context] * batch,
                                 BLOCK)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            metas = {"split": backend.build_graph_metadata(layout, seq_lens, MAX_CONTEXT)}
            if context <= SEGMENT:
                metas["one_segment"] = backend.build_graph_metadata(layout, seq_lens, SEGMENT)
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(batch, h, HEAD_DIM, generator=gen, device=device,
                                   dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))

            forms = _forms(backend, caches, metas, q, k, v, slots)
            row = {"batch": batch, "context": context}
            for pdl in (True, False):
                triton_launch.PDL = pdl
                for name, fn in forms.items():
                    key = name if pdl else f"{name}_no_pdl"
                    row[key] = _time(fn, graphed, args.replays) / LAYERS
            triton_launch.PDL = envs.LLMSERVE_PDL
            # The key loop's loads left to Triton's pipeliner (PDL on), beside the default.
            triton_paged.PREFETCH = False
            for name in metas:
                row[f"{name}_no_prefetch"] = _time(forms[name], graphed, args.replays) / LAYERS
            triton_paged.PREFETCH = True
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{results['device']}: us a layer (PDL on / off; the attention's loads left to "
          "Triton's pipeliner, PDL on); store+attention, less the store alone, is the "
          "attention's share")
    print("| batch | context | empty launch | store | one segment | split + fold |")
    print("|---|---|---|---|---|---|")
    for r in results["rows"]:
        cells = [f"{r[n]:.1f} / {r[n + '_no_pdl']:.1f}"
                 + (f" ({r[n + '_no_prefetch']:.1f})" if n + "_no_prefetch" in r else "")
                 if n in r else "-" for n in ("empty", "store", "one_segment", "split")]
        print(f"| {r['batch']} | {r['context']} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def _forms(backend, caches, metas, q, k, v, slots) -> dict:
    """What is timed, a call each over the layers' caches."""
    def store():
        for c in caches:
            c.store(slots, k, v)

    def attention(meta):
        def run():
            for c in caches:
                backend.forward(q, k, v, c, meta, HEAD_DIM ** -0.5)
        return run

    def empty():
        for _ in caches:
            _empty_kernel[(1,)](q, **triton_launch.pdl_launch(triton_launch.pdl_for(q)))

    return {"store": store, "empty": empty} | {name: attention(meta)
                                               for name, meta in metas.items()}


@triton.jit
def _empty_kernel(x_ptr, PDL: tl.constexpr):
    """Nothing but the wait for the kernel before (under PDL)."""
    wait_for_inputs(PDL)


def _time(fn, graphed: bool, replays: int) -> float:
    """Microseconds for one call of ``fn``: replays of its CUDA graph (the median of
    five rounds), or one eager call under the interpreter."""
    if not graphed:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    fn()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / replays * 1e6)
    return sorted(rounds)[2]


if __name__ == "__main__":
    main()
