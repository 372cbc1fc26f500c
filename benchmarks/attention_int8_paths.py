"""An int8 KV cache through the compiled attention kernel's two paths, in one process:
stored in pairs (the default: 16-bit integer dot products, vpdpwssd) against one element
at a time (each code converted to float32, then float multiply-adds).

    python benchmarks/attention_int8_paths.py [--rounds 7] [--iters 10]

Same cases as attention_ab.py (SmolLM2's attention, blocks scattered over a pool twice
their size). Each round times both paths, alternating; each keeps its fastest.
"""

from __future__ import annotations

import argparse

from attention_ab import best_time, cases, make_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="alternations of the two paths")
    p.add_argument("--iters", type=int, default=10, help="calls per case and round")
    args = p.parse_args()

    from llmserve.csrc import cpu_ops

    ops = cpu_ops()
    print("| case | one at a time (float) ms | pairs (int16 dot products) ms | speedup |\n"
          "|---|---|---|---|")
    for name, (lens, chunk, layers) in cases().items():
        inputs = {pairs: make_args("int8", lens, chunk, pairs, layers) for pairs in (False, True)}
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.rounds):
            for pairs, call in inputs.items():
                best[pairs] = min(best[pairs], best_time(ops, call, args.iters))
        print(f"| {name} | {best[False] * 1e3:.3f} | {best[True] * 1e3:.3f} | "
              f"{best[False] / best[True]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
