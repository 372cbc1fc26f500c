"""Maps the ``architectures`` names of model configs to model classes."""

from __future__ import annotations

from torch import nn

from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}

# GGUF ``general.architecture`` values -> registry keys.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise KeyError(architecture) from None


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)
