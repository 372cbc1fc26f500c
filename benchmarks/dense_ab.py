"""The dense float32 (or bfloat16) kernel of two source trees, alternating in one process, on
SmolLM2-135M's decoder (30 layers of qkv, o, gate/up and down, each layer its own weights,
so that they come from memory as in a step) and its output head, at a few row counts: a
decode step of that many streams, or one stream verifying that many tokens less one.

Both trees' kernels are built from their sources under distinct module names (their
pybind11 classes made module-local, so that two copies load side by side); each repeat
runs both, the order alternating, and checks that they give the same bits. Printed: the
median milliseconds of each and their ratio, per repeat too (this host is shared: read the
ratios).

    .venv/bin/python benchmarks/dense_ab.py --baseline /tmp/base [--rows 1,6,7,8,13]
        [--repeats 9] [--dtype bfloat16]

``--baseline`` is another checkout (``git worktree add /tmp/base <commit>``); the
candidate is this checkout unless ``--candidate`` names another.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from llmserve.csrc import _FLAGS, ISA_FLAGS
from llmserve.layers.quantization.dense import pack_panels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate/up, down
HEAD = (49152, 576)
LAYERS = 30
HERE = Path(__file__).resolve().parents[1]


def load_tree(tree: Path, name: str, build_root: Path) -> ModuleType:
    """The kernels of ``tree`` built as module ``name``, their classes module-local."""
    from torch.utils import cpp_extension

    sources = build_root / name / "src"
    sources.mkdir(parents=True, exist_ok=True)
    csrc = tree / "src/llmserve/csrc"
    for f in [*csrc.glob("*.cpp"), *csrc.glob("*.h")]:
        text = f.read_text()
        if f.name == "bindings.cpp":
            text = re.sub(r'py::class_<(.*?)>\(m, "(\w+)"',
                          r'py::class_<\1>(m, "\2", py::module_local()', text)
        target = sources / f.name
        if not target.exists() or target.read_text() != text:  # unchanged: no rebuild
            target.write_text(text)
    return cpp_extension.load(
        name=name, sources=[str(s) for s in sorted(sources.glob("*.cpp"))],
        extra_cflags=[*_FLAGS, ISA_FLAGS["native"]], extra_ldflags=["-fopenmp"],
        build_directory=str(sources.parent), verbose=False)


def add_tree_arguments(p: argparse.ArgumentParser, build_dir: str) -> None:
    """--baseline, --candidate and --build-dir: the two checkouts an A/B script compares."""
    p.add_argument("--baseline", required=True, type=Path, help="the other checkout")
    p.add_argument("--candidate", type=Path, default=HERE)
    p.add_argument("--build-dir", type=Path, default=Path(build_dir))


def load_trees(args: argparse.Namespace, prefix: str) -> dict[str, ModuleType]:
    """The baseline's and the candidate's kernels, built as {prefix}_baseline / _candidate."""
    return {name: load_tree(getattr(args, name).resolve(), f"{prefix}_{name}", args.build_dir)
            for name in ("baseline", "candidate")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tree_arguments(p, "/tmp/llmserve_dense_ab")
    p.add_argument("--rows", default="1,6,7,8,13")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    builds = load_trees(args, "dense_ab")
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)

    def weight(n: int, k: int) -> tuple[int, int, torch.Tensor]:
        return n, k, pack_panels((torch.randn(n, k, generator=gen) * 0.05).to(dtype))

    calls = [weight(n, k) for _ in range(LAYERS) for n, k in SHAPES] + [weight(*HEAD)]
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[int, str], list[float]] = {}
    for rep in range(args.repeats):
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}}
            order = list(builds.items())
            outs = {}
            for name, ops in order if rep % 2 else order[::-1]:
                start = time.perf_counter()
                for n, k, packed in calls:
                    ops.dense_linear(xs[k], packed, n)
                times.setdefault((m, name), []).append((time.perf_counter() - start) * 1e3)
                outs[name] = [ops.dense_linear(xs[k], packed, n) for n, k, packed in calls[:4]]
            if not all(torch.equal(a, b) for a, b in zip(*outs.values())):
                raise SystemExit(f"the two builds differ at {m} rows")
    print(f"dense {args.dtype}, SmolLM2-135M's 30 layers and head, weights from memory; "
          f"baseline {args.baseline}, candidate {args.candidate}; {args.repeats} repeats")
    print("| rows | baseline ms | candidate ms | candidate / baseline (per repeat) |")
    print("|---|---|---|---|")
    for m in rows:
        base, cand = times[(m, "baseline")], times[(m, "candidate")]
        per = " ".join(f"{c / b:.2f}" for b, c in zip(base, cand))
        print(f"| {m} | {statistics.median(base):.2f} | {statistics.median(cand):.2f} | "
              f"{statistics.median(cand) / statistics.median(base):.2f} ({per}) |")


if __name__ == "__main__":
    main()
