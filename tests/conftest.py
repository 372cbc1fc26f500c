from __future__ import annotations

import os
import tempfile

import pytest

import llmserve  # noqa: F401  (sets the math library's reproducibility mode before torch)
from llmserve import envs
from llmserve.csrc import cpu_ops
from tests.helpers.tiny_models import build_hf_model, save_hf_model, smollm2_tokenizer

# Servers started by the tests keep their usage database here, never in the user's data
# directory (whose keys would make every test server require them).
os.environ["LLMSERVE_DATA_DIR"] = tempfile.mkdtemp(prefix="llmserve-test-data-")


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL server (Debian's binaries); .new_database() gives a URL."""
    from tests.helpers.postgres import PostgresMissing, temporary_postgres

    try:
        with temporary_postgres() as pg:
            yield pg
    except PostgresMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def smol_tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer):
    """Factory: name -> (directory with safetensors + tokenizer, the transformers model)."""
    cache: dict = {}

    def make(name: str, max_shard_size: str | None = None):
        key = (name, max_shard_size)
        if key not in cache:
            model = build_hf_model(name)
            path = tmp_path_factory.mktemp(name.replace("-", "_"))
            save_hf_model(model, path, smol_tokenizer, max_shard_size)
            cache[key] = (path, model)
        return cache[key]

    return make


# Tests of the compiled CPU kernels' results (bitwise references, batch invariance, logits
# against transformers): `make test` runs them a second time with the portable kernels
# forced (LLMSERVE_CPU_ISA=avx2), so that every host tests the paths an AVX2-only CPU runs.
KERNEL_TESTS = {
    "tests/unit/test_dense_linear.py",
    "tests/unit/test_integer_kernels.py",
    "tests/unit/test_attention_invariance.py",
    "tests/unit/test_sampling_ops.py",
    "tests/unit/test_kernel_build.py",
    "tests/model/test_runner_invariance.py",
    "tests/model/test_quantization.py",
    "tests/model/test_hf_logits.py",
    "tests/model/test_batch_equivalence.py",
    "tests/model/test_fused_layers.py",
}


def pytest_collection_modifyitems(items):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False "
                                     "here (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if item.nodeid.split("::")[0] in KERNEL_TESTS:
            item.add_marker(pytest.mark.kernels)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


def pytest_report_header(config):
    from llmserve.csrc import cpu_ops

    ops = cpu_ops()
    if ops is None:
        return "llmserve CPU kernels: off (PyTorch fallbacks)"
    return (f"llmserve CPU kernels: built for {ops.isa} (LLMSERVE_CPU_ISA={envs.LLMSERVE_CPU_ISA}),"
            f" integer kernels: {ops.int_kernels or 'none (PyTorch)'}")


@pytest.fixture(params=["compiled", "pytorch"])
def cpu_kernels(request, monkeypatch):
    """Runs a test with the compiled CPU kernels, and again with the PyTorch fallbacks."""
    if request.param == "compiled" and cpu_ops() is None:
        pytest.skip("compiled CPU kernels unavailable (no C++ compiler, or "
                    "LLMSERVE_CPU_KERNELS=0); runs wherever they build")
    if request.param == "pytorch":
        monkeypatch.setattr(envs, "LLMSERVE_CPU_KERNELS", False)
        cpu_ops.cache_clear()
    yield request.param
    cpu_ops.cache_clear()
