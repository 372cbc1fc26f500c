"""How far a cheaper head could go for greedy rows, exactly: the default model's output head
(int8 weights, two activation levels per row) against a one-level pass (one int8 level
per group of 32 inputs) that only picks candidates.

A greedy row needs the argmax of its logits, not the logits. If L1 approximates the exact
logits L within a bound E (|L - L1| <= E, token by token), every token with
L1 + E < max(L1 - E) is below the argmax, and only the others (the candidates) need their
exact logit. Two rigorous bounds, each an outer product (a number per row times a number
per token), from Cauchy-Schwarz on the dequantized activations:
E = w_scale ||w_t||_2 ||x2 - xg||_2, with x2 the two-level activations the head multiplies
and xg the one-level ones; and the same with the worst case per element (s_g / 2 for each
input of group g) in place of the actual difference. Printed: the candidates per row on
the first `--tokens` tokens of the shipped text, and the two head passes' times at 1, 8
and 64 rows (the same packed weights, in one process, alternating).

    .venv/bin/python benchmarks/head_argmax_bounds.py [--tokens 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from perplexity import TEXT

from llmserve.layers.quantization.int8 import (
    QUAD,
    RESIDUAL,
    _unpacked_view,
    pack_vnni,
    quantize_activations,
    split_levels,
)
from llmserve.models.loader import DEFAULT_MODEL, load_model
from llmserve.runner.scoring import sequence_logits

GROUP = 32


def candidates(approx: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens whose logit could still be the largest."""
    floor = (approx - bound).amax(dim=1, keepdim=True)
    return (approx + bound >= floor).sum(dim=1).float()


def describe(counts: torch.Tensor) -> str:
    return (f"{counts.mean():.1f} | {counts.median():.0f} | {counts.quantile(0.9):.0f} | "
            f"{counts.max():.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    loaded = load_model(DEFAULT_MODEL)
    head = loaded.model.model.embed_tokens
    hidden: list[torch.Tensor] = []
    logits_of = head.logits
    head.logits = lambda h: (hidden.append(h.clone()), logits_of(h))[1]
    ids = loaded.tokenizer.encode(TEXT.read_text())[:args.tokens]
    logits = sequence_logits(loaded.model, ids)
    x = hidden[0]

    packed, excess, w_scale, vocab, levels, group = head.quant_method._kernel_args
    unpacked = _unpacked_view(packed)
    wq = unpacked.reshape(-1, unpacked.shape[-2] * QUAD)[:vocab].float()  # [vocab, in]
    ws = w_scale[:vocab]
    s, x1, x2 = split_levels(x)
    two_level = (x1 + x2 * (1 / RESIDUAL)) * s  # what the head multiplies
    rows, k = x.shape
    sg, codes = quantize_activations(x.reshape(-1, GROUP))
    one_level = (codes.clamp(-127, 127) * sg).view(rows, k)
    exact = two_level @ wq.t() * ws  # the head's logits, up to float rounding
    approx = one_level @ wq.t() * ws
    norm = ws * wq.norm(dim=1)
    margin = 1e-5 * (one_level.norm(dim=1, keepdim=True) + two_level.norm(dim=1, keepdim=True))
    actual = ((two_level - one_level).norm(dim=1, keepdim=True) + margin) * norm
    worst_diff = (sg.view(rows, -1).pow(2).sum(dim=1, keepdim=True) * GROUP / 4).sqrt()
    worst_two = s * (k ** 0.5) / (2 * RESIDUAL)
    worst = (worst_diff + worst_two + margin) * norm
    assert bool(((exact - approx).abs() <= actual).all()), "the bound does not hold"
    assert torch.equal(exact.argmax(dim=1), logits.argmax(dim=1))
    print(f"{rows} rows of {TEXT.name}, {vocab} tokens; candidates per row:")
    print("| bound | mean | median | p90 | max |\n|---|---|---|---|---|")
    print(f"| actual difference (Cauchy-Schwarz) | {describe(candidates(approx, actual))} |")
    print(f"| worst case per element | {describe(candidates(approx, worst))} |")

    ops = head.quant_method._ops
    unpacked_t = unpacked.reshape(-1, unpacked.shape[-2] * QUAD).t().contiguous()
    _, excess_g = pack_vnni(unpacked_t, GROUP)
    passes = {"two levels (the head)": (packed, excess, w_scale, vocab, levels, group),
              f"one level per {GROUP}": (packed, excess_g, w_scale, vocab, 1, GROUP)}
    print("\n| rows | " + " | ".join(f"{name} ms" for name in passes) + " | ratio |")
    print("|---|---|---|---|")
    for m in (1, 8, 64):
        xm = torch.randn(m, k)
        times: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(7):
            for name, kernel_args in passes.items():
                start = time.perf_counter()
                for _ in range(20):
                    ops.int8_linear(xm, *kernel_args)
                times[name].append((time.perf_counter() - start) / 20 * 1e3)
        two, one = (statistics.median(t) for t in times.values())
        print(f"| {m} | {two:.3f} | {one:.3f} | {one / two:.2f} |")


if __name__ == "__main__":
    main()
