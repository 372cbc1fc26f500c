"""The kernels' parallel loops on llmserve's spinning pool against OpenMP's, in one process.

For the default model (SmolLM2-135M, the embedded Q4_1 file, ``--quantization``) and, with
``--tiny``, a random model of the same depth whose layers are tiny (hidden 64: its step is
the per-step cost beyond arithmetic, as in ``step_overhead.py``): decode steps at each
``--batch`` and the prefill of one ``--prefill``-token prompt, the pool switched on and off
(``set_thread_pool``) between repeats, so that both modes see the same machine. Prints each
mode's median ms and the ratio pool / OpenMP per repeat and overall.

    python benchmarks/thread_pool_ab.py --batch 1,8,64 --repeats 7 --tiny
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import tiny_deep_model

from llmserve import LLM, SamplingParams
from llmserve.csrc import cpu_ops
from llmserve.models.loader import DEFAULT_MODEL


def decode_ms(engine, batch: int, steps: int, rng: random.Random) -> float:
    """Mean ms of ``steps`` decode steps of ``batch`` sequences (64-token prompts)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{rng.random()}-{i}", [rng.randrange(100, 49000) for _ in range(64)],
                           params)
    for _ in range(3):  # the prompts and the first decode
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - start) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms


def prefill_ms(engine, length: int, rng: random.Random) -> float:
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request(f"p{rng.random()}", [rng.randrange(100, 49000) for _ in range(length)],
                       params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def compare(model: str, label: str, args: argparse.Namespace) -> None:
    ops = cpu_ops()
    llm = LLM(model, quantization=args.quantization, enable_prefix_caching=False,
              max_num_seqs=max(args.batch))
    engine = llm.engine
    rng = random.Random(0)
    cases = [(f"decode, batch {b}", lambda b=b: decode_ms(engine, b, args.steps, rng))
             for b in args.batch]
    if args.prefill:
        cases.append((f"prefill of {args.prefill}", lambda: prefill_ms(engine, args.prefill,
                                                                        rng)))
    for name, run in cases:
        run()  # warm
        if args.only is not None:  # one mode: processes of different settings compared
            ops.set_thread_pool(args.only == "pool")
            times_one = [run() for _ in range(args.repeats)]
            print(f"{label}, {name}: {args.only} {statistics.median(times_one):.3f} ms "
                  f"(per repeat {', '.join(f'{x:.2f}' for x in times_one)})", flush=True)
            continue
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeats):
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                ops.set_thread_pool(mode)
                times[mode].append(run())
        ratios = [p / o for p, o in zip(times[True], times[False])]
        print(f"{label}, {name}: pool {statistics.median(times[True]):.3f} ms, OpenMP "
              f"{statistics.median(times[False]):.3f} ms, pool / OpenMP "
              f"{statistics.median(ratios):.3f} (per repeat "
              f"{', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    ops.set_thread_pool(True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens (0: none)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--tiny", action="store_true", help="also the tiny 30-layer model")
    p.add_argument("--only", choices=["pool", "openmp"], default=None,
                   help="time one mode (to compare processes started with other settings)")
    args = p.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    compare(DEFAULT_MODEL, "SmolLM2-135M", args)
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            compare(str(tiny_deep_model(Path(tmp) / "tiny30", 30)), "tiny 30 layers", args)


if __name__ == "__main__":
    main()
