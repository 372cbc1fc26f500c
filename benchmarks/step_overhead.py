"""What a decode step costs beyond its kernels: the default model beside a random model of
the same depth (30 layers) whose layers are tiny (hidden 64), so that its kernels take
next to no time and its step time is the per-step cost of Python, PyTorch
dispatch, scheduling and sampling. Both in one run, best of --repeats x 50 steps.

    python benchmarks/step_overhead.py [--batch 1] [--quantization int8]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from llmserve import LLM, SamplingParams
from llmserve.models.gguf_loader import GGUFFile
from llmserve.models.loader import DEFAULT_MODEL, resolve_model_path
from llmserve.tokenizer import Tokenizer


def tiny_deep_model(path: Path, layers: int) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    Tokenizer.from_gguf_metadata(
        GGUFFile(resolve_model_path(DEFAULT_MODEL)).metadata).save(path)
    return path


def step_ms(model: str, quantization: str, batch: int, repeats: int) -> float:
    llm = LLM(model, quantization=quantization, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(64)],
                           SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    for _ in range(5):
        engine.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(50):
            engine.step()
        best = min(best, (time.perf_counter() - start) / 50)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--quantization", default="int8")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_deep_model(Path(tmp) / "tiny30", 30)
        full = step_ms(DEFAULT_MODEL, args.quantization, args.batch, args.repeats)
        bare = step_ms(str(tiny), args.quantization, args.batch, args.repeats)
    print(f"batch {args.batch}, {args.quantization}: SmolLM2-135M {full:.2f} ms/step; the same "
          f"30 layers at hidden 64 {bare:.2f} ms/step ({bare / full:.0%} of the step is not "
          f"the model's arithmetic)")


if __name__ == "__main__":
    main()
