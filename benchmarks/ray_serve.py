"""The Ray Serve path against the plain server, on this machine.

Three servers, each started fresh, each loaded the same way (``llmserve bench serve``,
distinct random prompts, greedy, ignore_eos), one after the other:

- ``plain``: ``llmserve serve`` (one process, the engine on all CPUs);
- ``ray 1x2``: ``llmserve serve --replicas 1 --cpus-per-replica 2``: the same engine behind
  Ray Serve's proxy, the ingress and a deployment handle (what the Ray path adds);
- ``ray 2x1``: ``llmserve serve --replicas 2 --cpus-per-replica 1``: two engines of one
  thread each.

Printed: at 1 stream, TTFT and TPOT (p50) and the added TTFT against plain; at
--concurrency streams, output tokens/s and the ratio to plain.

    .venv/bin/python benchmarks/ray_serve.py --output benchmarks/results/cpu/ray_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from serverproc import LocalServer

SERVERS = {
    "plain": [],
    "ray 1x2": ["--replicas", "1", "--cpus-per-replica", "2"],
    "ray 2x1": ["--replicas", "2", "--cpus-per-replica", "1", "--router", "least-load"],
}


def bench(url: str, out: str, concurrency: int, num_prompts: int, args) -> dict:
    subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", "serve", "--base-url", url,
                    "--workload", "random", "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--num-prompts", str(num_prompts),
                    "--concurrency", str(concurrency), "--seed", str(concurrency),
                    "--warmup", "2", "--no-progress", "--output", out],
                   check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["summary"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output", default=None, help="also write the results as JSON")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ray-serve-bench-")
    model = ["--model", args.model] if args.model else []
    results: dict[str, dict] = {}
    for name, extra in SERVERS.items():
        slug = name.replace(" ", "_")
        server = LocalServer([*model, "--no-database", *extra], f"{tmp}/{slug}.log", slug,
                             timeout=600)
        try:
            one = bench(server.url, f"{tmp}/{slug}-1.json", 1, 16, args)
            many = bench(server.url, f"{tmp}/{slug}-n.json", args.concurrency,
                         3 * args.concurrency, args)
        finally:
            server.stop()
        results[name] = {"one": one, "many": many}
        print(f"{name:8}  1 stream: TTFT p50 {one['ttft']['p50'] * 1e3:7.1f} ms, TPOT p50 "
              f"{one['tpot']['p50'] * 1e3:5.1f} ms   {args.concurrency} streams: "
              f"{many['output_throughput']:6.1f} out tok/s, errors {many['errors']}",
              flush=True)
    base = results["plain"]
    print(f"\n| server | TTFT p50, 1 stream | added TTFT | TPOT p50, 1 stream | "
          f"out tok/s, {args.concurrency} streams | vs plain |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        added = (r["one"]["ttft"]["p50"] - base["one"]["ttft"]["p50"]) * 1e3
        print(f"| {name} | {r['one']['ttft']['p50'] * 1e3:.1f} ms | {added:+.1f} ms | "
              f"{r['one']['tpot']['p50'] * 1e3:.1f} ms | {r['many']['output_throughput']:.1f} | "
              f"{r['many']['output_throughput'] / base['many']['output_throughput']:.2f}x |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
