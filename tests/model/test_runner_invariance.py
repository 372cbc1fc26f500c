"""A request's logits are bitwise the same alone and inside any mixed batch, for every
weight format and KV cache format."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.models.loader import load_model
from llmserve.runner import ModelRunner
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import ScheduledRequest, SchedulerOutput
from tests.helpers.tiny_models import WEIGHT_AND_KV_FORMATS

GREEDY = SamplingParams(temperature=0)
BS = 16


FORMATS = WEIGHT_AND_KV_FORMATS  # (quantization, dtype, KV cache dtype)


def _runner(model, kv_cache_dtype="float32", num_blocks=256):
    return ModelRunner(model.model, model.arch_config, num_blocks=num_blocks, block_size=BS,
                       kv_cache_dtype=kv_cache_dtype)


def _item(rid, tokens, start, blocks, sample=True):
    return ScheduledRequest(rid, tokens, start, [blocks], sample, GREEDY)


@pytest.mark.parametrize("name", ["llama-gqa", "gemma3", "qwen3"])
@pytest.mark.parametrize(("quantization", "dtype", "kv"), FORMATS, ids=lambda v: v)
def test_logits_identical_alone_and_in_mixed_batches(tiny_model_dir, quantization, dtype, kv,
                                                     name):
    """Gemma 3's sliding-window layers too: the 70-token target leaves their 32-key window."""
    path, _ = tiny_model_dir(name)
    model = load_model(str(path), quantization=quantization, dtype=dtype)
    rng = random.Random(0)
    target = [rng.randrange(17, 49152) for _ in range(70)]
    target_blocks = list(range(0, 5))

    alone = _runner(model, kv)
    ref_prefill = alone.forward_logits(SchedulerOutput([_item("t", target, 0, target_blocks)]))
    ref_decode = alone.forward_logits(SchedulerOutput([_item("t", [5], 70, target_blocks)]))

    for trial in range(4):
        runner = _runner(model, kv)
        others, next_block = [], 10
        for j in range(rng.randint(1, 6)):
            n = rng.randint(1, 90)
            blocks = list(range(next_block, next_block + (n + 1) // BS + 1))
            next_block += len(blocks)
            others.append(_item(f"o{j}", [rng.randrange(17, 49152) for _ in range(n)], 0, blocks,
                                sample=rng.random() < 0.5))
        # Chunked prefill of the target (two chunks) mixed with the others, then a decode.
        first = SchedulerOutput([*others[:2], _item("t", target[:33], 0, target_blocks, False)])
        runner.forward_logits(first)
        second = SchedulerOutput([_item("t", target[33:], 33, target_blocks), *others[2:]])
        logits = runner.forward_logits(second)
        assert torch.equal(logits[0], ref_prefill[0]), f"trial {trial}: prefill logits differ"
        decode = SchedulerOutput([*others[:1], _item("t", [5], 70, target_blocks)])
        logits = runner.forward_logits(decode)
        assert torch.equal(logits[-1], ref_decode[0]), f"trial {trial}: decode logits differ"
