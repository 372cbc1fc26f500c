from __future__ import annotations

import pytest

import llmserve  # noqa: F401  (sets the math library's reproducibility mode before torch)
from tests.helpers.tiny_models import build_hf_model, save_hf_model, smollm2_tokenizer


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
