"""The runner's flattening of a step, against a slow obvious reference: token ids,
positions, padded block tables and cache slots, for decode-only steps (their fast path) and
mixed ones."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import ScheduledRequest, SchedulerOutput


def reference(items, num_groups: int, block_size: int):
    ids = [t for s in items for t in s.token_ids]
    positions = [p for s in items for p in range(s.start_pos, s.start_pos + s.num_tokens)]
    width = max(len(s.block_ids[g]) for s in items for g in range(num_groups))
    tables = [[s.block_ids[g] + [0] * (width - len(s.block_ids[g])) for s in items]
              for g in range(num_groups)]
    slots = [[s.block_ids[g][p // block_size] * block_size + p % block_size
              for s in items for p in range(s.start_pos, s.start_pos + s.num_tokens)]
             for g in range(num_groups)]
    return ids, positions, tables, slots


@pytest.mark.parametrize("decode_only", [True, False])
def test_prepare_matches_the_reference(tiny_model_dir, decode_only):
    from llmserve import LLM

    path, _ = tiny_model_dir("gemma3")  # several KV cache groups
    runner = LLM(str(path), max_model_len=256, num_kv_blocks=512).engine.runner
    rng = random.Random(0)
    items = []
    for i in range(7):
        start = rng.randint(0, 200)
        n = 1 if decode_only or i % 2 else rng.randint(2, 40)
        blocks = -(-(start + n) // runner.block_size)
        tables = [[rng.randrange(64) for _ in range(blocks + rng.randint(0, 2))]
                  for _ in range(runner.num_groups)]
        items.append(ScheduledRequest(f"r{i}", [rng.randrange(1000) for _ in range(n)],
                                      start, tables, True, SamplingParams(max_tokens=1)))
    got = runner._prepare(SchedulerOutput(items))
    want = reference(items, runner.num_groups, runner.block_size)
    for g, w in zip(got, want):
        assert g.tolist() == w
        assert g.dtype == torch.int64
