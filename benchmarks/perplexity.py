"""Quality guard: perplexity of each weight and KV cache format on a fixed text.

The text is benchmarks/data/eval_prose.txt (about 4,800 SmolLM2 tokens of English prose,
an explainer on LLM inference from this project's seed documents), scored in windows of
1,024 tokens. The reference is float32 weights dequantized from the same GGUF file.

    .venv/bin/python benchmarks/perplexity.py [--model smollm2-135m-instruct] [--formats int8,...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmserve.config import default_block_size
from llmserve.models.loader import DEFAULT_MODEL, load_model
from llmserve.runner.scoring import perplexity

TEXT = Path(__file__).parent / "data" / "eval_prose.txt"
# (label, load options, KV cache dtype, allowed increase over float32 or None)
FORMATS = [
    ("float32", {"quantization": "none"}, "float32", None),
    ("bfloat16", {"quantization": "none", "dtype": "bfloat16"}, "bfloat16", None),
    ("int8", {"quantization": "int8"}, "float32", 0.01),
    ("w8a8", {"quantization": "w8a8"}, "float32", 0.03),
    ("int4 g32", {"quantization": "int4", "group_size": 32}, "float32", 0.02),
    ("int4 g64", {"quantization": "int4", "group_size": 64}, "float32", 0.05),
    ("int4 g128", {"quantization": "int4", "group_size": 128}, "float32", 0.05),
    # What `auto` serves on CPU: quantized weights with an int8 KV cache (the default
    # model: its int4 blocks), held to the same bounds as the weights alone.
    ("int8 + KV int8", {"quantization": "int8"}, "int8", 0.01),
    ("w8a8 + KV int8", {"quantization": "w8a8"}, "int8", 0.03),
    ("int4 g32 + KV int8 (default)", {"quantization": "int4"}, "int8", 0.02),
    ("int4 g32 + KV fp8_e4m3", {"quantization": "int4"}, "fp8_e4m3", None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--formats", default=None,
                        help="comma-separated labels to run (float32, the reference, always runs)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: the device's, as served)")
    args = parser.parse_args()
    wanted = None if args.formats is None else {"float32", *args.formats.split(",")}
    ref = None
    print("| format | KV cache | perplexity | vs float32 | goal |\n|---|---|---|---|---|")
    for label, options, kv, allowed in FORMATS:
        if wanted is not None and label not in wanted:
            continue
        loaded = load_model(args.model, **options)
        ids = loaded.tokenizer.encode(TEXT.read_text())
        ppl = perplexity(loaded.model, ids, window=args.window, kv_cache_dtype=kv,
                         block_size=args.block_size)
        ref = ref or ppl
        goal = "" if allowed is None else f"<= +{allowed:.0%}"
        ok = "" if allowed is None else (" ok" if ppl / ref - 1 <= allowed else " MISSED")
        print(f"| {label} | {kv} | {ppl:.3f} | {ppl / ref - 1:+.2%} | {goal}{ok} |",
              flush=True)
    blocks = args.block_size or default_block_size("cpu")
    print(f"\n{len(ids)} tokens of {TEXT.name}, windows of {args.window}, KV blocks of {blocks}")


if __name__ == "__main__":
    main()
