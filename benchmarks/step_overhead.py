"""What a decode step costs beyond its kernels: the default model beside a random model of
the same depth (30 layers) whose layers are tiny (hidden 64), so that its kernels take
next to no time and its step time is the per-step cost of Python, PyTorch
dispatch, scheduling and sampling. Both in one run, best of --repeats x 50 steps, each
with the decoder stack as one compiled call in one OpenMP region (the default,
models/fused.py, csrc/team.h), as one call with an OpenMP region per kernel
(LLMSERVE_STACK_TEAM=0), and module by module (LLMSERVE_FUSED_LAYERS=0), alternating.
The tiny model keeps the full 49152-token output head (the tokenizer's), whose arithmetic
is timed apart (best of 200 calls) and shown beside the share with it taken out.

    python benchmarks/step_overhead.py [--batch 1] [--quantization int8]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

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


# (fused, team): the stack in one region; one call with a region per kernel; the modules.
MODES = {"fused": (True, True), "fused, a region per kernel": (True, False),
         "modules": (False, False)}


def step_ms(model: str, quantization: str, batch: int, repeats: int
            ) -> tuple[dict[str, float], float]:
    """Best ms per decode step in each of MODES, and the best ms of the model's output head
    on ``batch`` rows."""
    llm = LLM(model, quantization=quantization, enable_prefix_caching=False)
    engine = llm.engine
    fused = engine.loaded.model.model.fused
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(64)],
                           SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    for _ in range(5):
        engine.step()
    best = dict.fromkeys(MODES, float("inf"))
    for _ in range(repeats):
        for mode, (on, team) in MODES.items():
            fused.enabled, fused.team = on, team
            start = time.perf_counter()
            for _ in range(50):
                engine.step()
            assert fused.last_step_fused is on
            best[mode] = min(best[mode], (time.perf_counter() - start) / 50 * 1e3)
    return best, head_ms(engine.loaded.model, batch)


@torch.inference_mode()
def head_ms(model, batch: int, calls: int = 200) -> float:
    hidden = torch.randn(batch, model.config.hidden_size)
    for _ in range(5):
        model.compute_logits(hidden)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        model.compute_logits(hidden)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--quantization", default="int8")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_deep_model(Path(tmp) / "tiny30", 30)
        full, _ = step_ms(DEFAULT_MODEL, args.quantization, args.batch, args.repeats)
        bare, head = step_ms(str(tiny), args.quantization, args.batch, args.repeats)
    for mode in MODES:
        print(f"batch {args.batch}, {args.quantization}, {mode}: SmolLM2-135M "
              f"{full[mode]:.2f} ms/step; the same 30 layers at hidden 64 {bare[mode]:.2f} "
              f"ms/step ({bare[mode] / full[mode]:.0%} of the step is not the model's "
              f"arithmetic; {(bare[mode] - head) / full[mode]:.0%} without the tiny model's "
              f"output head, {head:.2f} ms)")
    for other in list(MODES)[1:]:
        print(f"fused step / {other} step: SmolLM2-135M {full['fused'] / full[other]:.2f}x, "
              f"tiny layers {bare['fused'] / bare[other]:.2f}x")


if __name__ == "__main__":
    main()
