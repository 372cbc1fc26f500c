"""What of the CUDA path can be checked without a GPU: the choices and refusals around it."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention.backend import _auto_backend
from llmserve.config import CacheConfig, EngineConfig, ModelConfig, default_dtype
from llmserve.errors import ModelLoadError
from llmserve.models.loader import load_model
from llmserve.runner.cuda_graphs import batch_buckets


def test_graph_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    for top in (1, 3, 17, 256):
        buckets = batch_buckets(top)
        assert all(any(b >= size for b in buckets) for size in range(1, top + 1))
        assert buckets[-1] == top


def test_dense_dtype_defaults_to_bfloat16_on_cuda():
    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"
    assert default_dtype("cpu") == "float32"


def test_kv_blocks_default_to_32_tokens_on_cpu_and_16_on_cuda():
    assert EngineConfig().cache.block_size == 32
    on_cuda = EngineConfig(model=ModelConfig(device="cuda:1"))
    assert on_cuda.cache.block_size == 16
    asked = EngineConfig(model=ModelConfig(device="cuda"), cache=CacheConfig(block_size=64))
    assert asked.cache.block_size == 64
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=24)


def test_cpu_blocks_the_kernel_cannot_read_fall_back_and_say_so(monkeypatch):
    from llmserve.attention import backend
    from llmserve.csrc import cpu_ops

    if cpu_ops() is None:
        pytest.skip("the compiled CPU kernels are not built here (no C++ compiler, or "
                    "LLMSERVE_CPU_KERNELS=0); runs wherever they build, as in make test")
    said: list[str] = []
    monkeypatch.setattr(backend.logger, "warning", lambda msg, *args: said.append(msg % args))
    assert _auto_backend(torch.device("cpu"), 32) == "cpu_paged" and not said
    assert _auto_backend(torch.device("cpu"), 8) == "torch_paged"
    assert len(said) == 1 and "KV blocks of 8 tokens" in said[0] and "multiple of 16" in said[0]


def test_cuda_picks_the_triton_backend():
    pytest.importorskip("triton")
    assert _auto_backend(torch.device("cuda"), 16) == "triton_paged"


def test_float16_weights_are_refused_on_cpu(tiny_model_dir):
    path, _ = tiny_model_dir("llama-gqa")
    with pytest.raises(ModelLoadError, match="float16 runs on GPUs only"):
        load_model(str(path), "cpu", quantization="none", dtype="float16")


def test_float16_kv_cache_is_refused_by_the_cpu_layout():
    from llmserve.attention.kv_format import PagedKVCache

    with pytest.raises(ValueError, match="GPUs only"):
        PagedKVCache.allocate("float16", 2, 16, 1, 16, torch.device("cpu"))


def test_cuda_graphs_need_a_cuda_runner(tiny_model_dir):
    from llmserve import LLM

    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=32)
    assert llm.engine.runner.graphs is None  # CPU: nothing captured
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        llm.engine.runner.capture_cuda_graphs(4, 256)


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x"])
def test_a_device_llmserve_does_not_run_on_is_refused(device):
    from llmserve.config import ModelConfig, check_device

    for check in (lambda: check_device(device, available=True),
                  lambda: ModelConfig(device=device)):
        with pytest.raises(ValueError, match="runs on cpu, cuda or cuda:N"):
            check()


def _unavailable_gpu() -> tuple[str, str]:
    """A CUDA device this machine cannot serve on, and what the refusal says: without a
    GPU any, with GPUs the index past them."""
    if not torch.cuda.is_available():
        return "cuda", "no CUDA GPU is available"
    count = torch.cuda.device_count()
    return f"cuda:{count}", f"sees {count} CUDA GPU"


def test_a_gpu_that_is_not_there_is_refused_where_the_model_loads():
    from llmserve.config import ModelConfig, check_device

    device, message = _unavailable_gpu()
    with pytest.raises(ValueError, match=message):
        check_device(device, available=True)
    ModelConfig(device=device)  # configuring it is allowed (a Ray head may lack the GPUs)


def test_the_cli_says_so_in_one_line():
    import subprocess
    import sys

    device, message = _unavailable_gpu()
    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--device", device,
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert message in proc.stderr
