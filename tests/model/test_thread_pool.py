"""The kernels' spinning thread pool (csrc/parallel.h) gives the bits of OpenMP's loops: the
same chunks on the same thread numbers, in every weight and KV cache format, at any thread
count, and when two host threads run kernels at once (the second takes OpenMP's loops)."""

from __future__ import annotations

import threading

import pytest
import torch

from llmserve.csrc import cpu_ops
from llmserve.models.loader import load_model
from tests.helpers.tiny_models import WEIGHT_AND_KV_FORMATS
from tests.model.test_fused_layers import _logits

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="compiled CPU kernels unavailable")


@pytest.fixture
def pool_switch():
    ops = cpu_ops()
    before, threads = ops.thread_pool_enabled(), torch.get_num_threads()
    yield ops.set_thread_pool
    ops.set_thread_pool(before)
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("quantization", "dtype", "kv"), WEIGHT_AND_KV_FORMATS,
                         ids=lambda v: v)
def test_the_pool_gives_openmps_bits(tiny_model_dir, pool_switch, quantization, dtype, kv):
    path, _ = tiny_model_dir("llama-gqa")
    model = load_model(str(path), quantization=quantization, dtype=dtype)
    for threads in (2, 3):
        torch.set_num_threads(threads)
        pool_switch(False)
        want = _logits(model, kv, True)
        pool_switch(True)
        got = _logits(model, kv, True)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"{threads} threads, step {i}: {(g - w).abs().max()}"


def test_two_host_threads_at_once(tiny_model_dir, pool_switch):
    """The decoder stack releases the GIL: two threads' steps overlap, one on the pool and
    the other on OpenMP's loops, and each gets the logits it gets alone."""
    path, _ = tiny_model_dir("llama-gqa")
    model = load_model(str(path), quantization="int4")
    pool_switch(True)
    want = _logits(model, "int8", True)
    got: list = [None, None]
    errors: list = []

    def run(i: int) -> None:
        try:
            got[i] = [_logits(model, "int8", True) for _ in range(3)]
        except Exception as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    for runs in got:
        for logits in runs:
            assert all(torch.equal(g, w) for g, w in zip(logits, want, strict=True))
