"""The integer linear kernels (int4, w8a8, int8) of two source trees, alternating in one
process, on SmolLM2-135M's four projection shapes (qkv, o, gate/up, down; random weights,
warm in cache) at a few row counts. Both trees' kernels are built under distinct module
names (benchmarks/dense_ab.py's load_tree); every call's output is compared bitwise first.
Printed: the median milliseconds per layer of each tree, their ratio, and the ratio per
repeat (this host is shared: read the ratios).

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/int_kernels_ab.py --baseline /tmp/base [--rows 1,8,64,512]
        [--formats int4,w8a8,int8] [--shapes 64x576,64x1536] [--repeats 7]

``--shapes`` (out x in pairs) replaces the four projections, e.g. one panel of 64 outputs,
where the quantization of the activations weighs more against the products.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from dense_ab import add_tree_arguments, load_trees

from llmserve.layers.quantization.int4 import pack_vnni as pack_int4
from llmserve.layers.quantization.int4 import quantize_groups
from llmserve.layers.quantization.int8 import pack_vnni as pack_int8
from llmserve.layers.quantization.int8 import quantize_rows
from llmserve.layers.quantization.w8a8 import BODY_GROUP, activation_group

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate/up, down


def layer_calls(shapes: list[tuple[int, int]], gen: torch.Generator) -> dict[str, list]:
    """Per format, (in, call(module, x)) for each shape."""
    calls: dict[str, list] = {"int4": [], "w8a8": [], "int8": []}
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.05
        b = quantize_groups(w, 32)
        packed, scale_zero = pack_int4(b.q, b.scale.half(), b.zero.half())
        calls["int4"].append((k, lambda mod, x, a=(packed, scale_zero, 32, n):
                              mod.int4_linear(x, *a)))
        q, w_scale = quantize_rows(w)
        for fmt, levels, group in (("w8a8", 1, activation_group(k, BODY_GROUP)),
                                   ("int8", 2, k)):
            packed8, excess = pack_int8(q.t().contiguous(), group)
            padded = torch.zeros(excess.shape[1])
            padded[:n] = w_scale
            calls[fmt].append((k, lambda mod, x, a=(packed8, excess, padded, n, levels, group):
                               mod.int8_linear(x, *a)))
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tree_arguments(p, "/tmp/llmserve_int_ab")
    p.add_argument("--rows", default="1,8,64,512")
    p.add_argument("--formats", default="int4,w8a8,int8")
    p.add_argument("--shapes", default=None, help="out x in pairs, comma-separated")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    builds = load_trees(args, "int_ab")
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    calls = layer_calls(shapes, gen)
    print("| format | rows | baseline ms/layer | candidate ms/layer | candidate / baseline "
          "(per repeat) |\n|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=gen) * 2 for _, k in shapes}
            for k, f in calls[fmt]:
                a, b = (f(builds[name], xs[k]) for name in builds)
                assert torch.equal(a, b), f"{fmt}, {m} rows, in {k}: the trees' bits differ"
            per_repeat = max(3, 3000 // m)
            times: dict[str, list[float]] = {name: [] for name in builds}
            for rep in range(args.repeats):
                for name in (builds if rep % 2 == 0 else list(builds)[::-1]):
                    mod = builds[name]
                    start = time.perf_counter()
                    for _ in range(per_repeat):
                        for k, f in calls[fmt]:
                            f(mod, xs[k])
                    times[name].append((time.perf_counter() - start) / per_repeat * 1e3)
            base, cand = (statistics.median(times[n]) for n in builds)
            ratios = ", ".join(f"{c / b:.2f}" for b, c in zip(*times.values()))
            print(f"| {fmt} | {m} | {base:.3f} | {cand:.3f} | **{cand / base:.2f}** ({ratios}) |",
                  flush=True)


if __name__ == "__main__":
    main()
