"""The engine on a CUDA GPU: the same checks as on CPU, with bfloat16/float16 weights, the
Triton paged-attention backend and CUDA graphs of the decode step.

Marked ``cuda``: skipped, with the reason, where there is no GPU (CI); run on a lent GPU
machine with ``pytest -m cuda``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.models.loader import load_model
from llmserve.runner import cuda_graphs
from llmserve.runner.scoring import sequence_logits
from tests.model.test_async_scheduling import check_async_equals_sync
from tests.model.test_batch_equivalence import _check_equivalence, _workload

pytestmark = pytest.mark.cuda

CUDA_FORMATS = [
    pytest.param({"device": "cuda", "dtype": "bfloat16"}, id="bf16-graphs"),
    pytest.param({"device": "cuda", "dtype": "bfloat16", "enforce_eager": True},
                 id="bf16-eager"),
    pytest.param({"device": "cuda", "dtype": "float16", "kv_cache_dtype": "fp8_e4m3"},
                 id="fp16-kv-fp8"),
]


@pytest.mark.parametrize("fmt", CUDA_FORMATS)
def test_batched_equals_alone_on_cuda(tiny_model_dir, fmt):
    """Chunked prefill and decodes batched, preemption, prefix caching: every request's
    greedy output is the one it gets alone."""
    path, _ = tiny_model_dir("llama-gqa")
    _check_equivalence(str(path), max_out=48, **fmt)


def test_sliding_windows_on_cuda(tiny_model_dir):
    path, _ = tiny_model_dir("gemma3")
    _check_equivalence(str(path), max_out=48, block_layers=6, device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "gemma3"])
def test_logits_match_transformers_on_cuda(tiny_model_dir, name):
    """Within what transformers' own model loses in bfloat16 (the tiny random Gemma 3's
    logits move by 11% there: its scaled embeddings and four norms a layer)."""
    path, hf = tiny_model_dir(name)
    ids = torch.tensor([list(range(100, 160))])
    with torch.no_grad():
        ref = hf(ids).logits[0].double()
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits[0].double()
    loaded = load_model(str(path), "cuda", quantization="auto", dtype="bfloat16")
    got = sequence_logits(loaded.model, ids[0].tolist()).double().cpu()
    own_loss = float((hf_bf16 - ref).norm() / ref.norm())
    assert float((got - ref).norm() / ref.norm()) < max(3e-2, 1.5 * own_loss)


def test_graph_replays_give_the_eager_tokens(tiny_model_dir):
    """Short contexts, then two long ones that finish first: steps replay the graphs for
    one attention segment and those for the longest context, and give the eager tokens."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, params = _workload(3, 12, 300, 40)
    prompts += [list(range(100, 700)), list(range(200, 900))]
    params += [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
    outs = {}
    for eager in (False, True):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=1024,
                  enforce_eager=eager, max_num_seqs=16)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.buckets == [1, 2, 4, 8, 16]
            assert list(graphs.replays_by_limit) == [512, 1024]
            assert all(n > 0 for n in graphs.replays_by_limit.values()), \
                graphs.replays_by_limit
    assert outs[False] == outs[True]


def test_graph_logits_are_the_eager_logits(tiny_model_dir):
    """The decode graphs compute the logits themselves (the head inside the graph, into a
    buffer every bucket shares): greedy and seeded tokens and their log-probabilities, bit
    for bit, as the eager head gives them; and with the head left out of the graphs."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, _ = _workload(5, 10, 200, 30)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=30,
                             logprobs=3, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for mode in ("graph-logits", "graph-hidden", "eager"):
        cuda_graphs.LOGITS = mode == "graph-logits"
        try:
            llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=1024,
                      enforce_eager=mode == "eager", max_num_seqs=16)
        finally:
            cuda_graphs.LOGITS = True
        outs[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                      for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        if mode != "eager":
            assert graphs.replays > 0
            assert (graphs.logits is not None) == (mode == "graph-logits")
    assert outs["graph-logits"] == outs["eager"]
    assert outs["graph-hidden"] == outs["eager"]


def test_seeded_sampling_is_reproducible_on_cuda(tiny_model_dir):
    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=512)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params)][::-1]
    assert first == again


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_async_scheduling_gives_the_synchronous_output_on_cuda(tiny_model_dir, eager):
    """Steps launched ahead read their input tokens from the step before's samples on the
    device (inside the graph's inputs when replayed): the same output as without."""
    path, _ = tiny_model_dir("llama-gqa")
    llm = check_async_equals_sync(str(path), device="cuda", dtype="bfloat16",
                                  enforce_eager=eager)
    graphs = llm.engine.runner.graphs
    assert (graphs is None) == eager
    if graphs is not None:
        assert graphs.replays > 0
