"""The host's share of a decode step at many sequences, by part: scheduling, the runner's
input preparation, the model, the output head, the sampler (its argmax or draw apart) and
the scheduler's update; and the host's own work, the step less the model, head and argmax
or draw (with ``--temperature``, the sampler's softmax stays in it).

A tiny random Llama (hidden 64, 2 layers, the 49152-token head) on CPU, ``--batch``
sequences of 64-token prompts decoding together, so that the per-request Python work (the
part a GPU's host must finish within the GPU's step) stands out. The garbage collector is
frozen after start-up, as in the server's engine process (``--no-freeze``: not).
``--async-scheduling`` plans each step while the one before runs, as on a GPU (here the
CPU runs the step before the planning returns, so only the parts are comparable). Run it
in two trees, alternating, to compare them (``PYTHONPATH=<tree>/src``; ``--root`` for the
tree's benchmarks):

    python benchmarks/host_step_parts.py --batch 256 --steps 100
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--no-freeze", action="store_true", help="leave the collector as is")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampled requests (greedy by default)")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the tree whose benchmarks/cuda_bench.py builds the engine")
    args = ap.parse_args()
    sys.path[:0] = [str(args.root / "benchmarks"), str(args.root)]
    import cuda_bench as cb

    from llmserve.gc_freeze import freeze_startup_objects
    from llmserve.sampling_params import SamplingParams

    path, _ = cb.build_model_dir(Path("/tmp/host_step_parts/tiny"), cb.TINY, None)
    core = cb.engine(path, "cpu", False, max_num_seqs=max(256, args.batch),
                     async_scheduling=args.async_scheduling or None)
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 20,
                            ignore_eos=True)
    for i in range(args.batch):
        core.add_request(f"r{i}", [rng.randrange(17, cb.VOCAB) for _ in range(64)], params)
    for _ in range(10):
        core.step()
    if not args.no_freeze:
        freeze_startup_objects("host_step_parts")
    times: dict[str, float] = {}

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                times[key] = times.get(key, 0.0) + time.perf_counter() - start
        setattr(obj, name, wrapper)

    from llmserve.sample import ops

    sched, runner = core.scheduler, core.runner
    for obj, name, key in ((sched, "schedule", "schedule"),
                           (sched, "schedule_next", "schedule_next"), (sched, "update", "update"),
                           (runner, "_prepare", "prepare"), (runner.model, "forward", "model"),
                           (runner.model, "compute_logits", "head"), (ops, "argmax", "argmax"),
                           (ops, "exponential_race", "draw"),
                           (runner.sampler, "launch", "sampler"),
                           (runner.sampler, "launch_greedy", "sampler")):
        if hasattr(obj, name):  # (launch_greedy: not in older trees)
            timed(obj, name, key)
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    total = time.perf_counter() - start
    # The host's own work: all but the arithmetic (the model, its head, the argmax or the
    # draw, which a GPU runs while the host goes on).
    host = total - sum(times.get(k, 0.0) for k in ("model", "head", "argmax", "draw"))
    parts = ", ".join(f"{k} {v / args.steps * 1e3:.2f}" for k, v in times.items())
    print(f"B={args.batch}: {total / args.steps * 1e3:.2f} ms/step, host's own "
          f"{host / args.steps * 1e3:.2f}; {parts}")


if __name__ == "__main__":
    main()
