"""What the default format's output head costs in quality if it ran as w8a8's does.

The int4 format keeps the embedding and output head at int8 with two activation levels a
row (an exact-ish product, as int8 runs it); w8a8's head quantizes its activations to one
level per group of 64 inputs, about 1.6x faster at 32-64 rows
(`int4_vs_w8a8_matmul.py --head`). This scores the shipped text (as `perplexity.py` does,
int8 KV cache as served) with the int4 body and each head: the two-level head, then w8a8's
head with groups of 64 and of 32 inputs. A measurement, not a format: the head swap is
made here by replacing the format's head method.

    .venv/bin/python benchmarks/int4_head_quality.py
"""

from __future__ import annotations

from pathlib import Path

from llmserve.layers.quantization import base
from llmserve.layers.quantization.w8a8 import W8A8HeadMethod
from llmserve.models.loader import DEFAULT_MODEL, load_model
from llmserve.runner.scoring import perplexity

TEXT = Path(__file__).parent / "data" / "eval_prose.txt"


def score(quantization: str, kv: str) -> float:
    loaded = load_model(DEFAULT_MODEL, quantization=quantization)
    ids = loaded.tokenizer.encode(TEXT.read_text())
    return perplexity(loaded.model, ids, window=1024, kv_cache_dtype=kv)


def main() -> None:
    ref = score("none", "float32")
    print("| body | head | perplexity | vs float32 |\n|---|---|---|---|")
    print(f"| float32 | float32 | {ref:.3f} | |")
    rows = [("int8, two levels a row (the default)", None), ("w8a8, groups of 64", 64),
            ("w8a8, groups of 32", 32)]
    original = base.WeightFormat.head_method
    for label, group in rows:
        if group is not None:
            W8A8HeadMethod.max_group = group
            base.WeightFormat.head_method = lambda self: W8A8HeadMethod(self)
        try:
            ppl = score("int4", "int8")
        finally:
            base.WeightFormat.head_method = original
        print(f"| int4 g32 + KV int8 | {label} | {ppl:.3f} | {ppl / ref - 1:+.2%} |", flush=True)


if __name__ == "__main__":
    main()
