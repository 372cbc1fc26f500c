"""Maps the ``architectures`` names of model configs to model classes, and to the
configuration class that reads a family's own fields (ArchConfig for the Llama shape)."""

from __future__ import annotations

from typing import Any

from torch import nn

from llmserve.models.arch_config import ArchConfig, hf_architecture
from llmserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.qwen2 import Qwen2ForCausalLM
from llmserve.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

CONFIG_CLASSES: dict[str, type[ArchConfig]] = {
    "Gemma3ForCausalLM": Gemma3Config,
}

# GGUF ``general.architecture`` values -> registry keys.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise KeyError(architecture) from None


def config_from_hf(raw: dict[str, Any]) -> ArchConfig:
    """A Hugging Face config.json (parsed), read by its family's configuration class."""
    if not isinstance(raw, dict):
        raise ValueError(f"must hold a JSON object, not a {type(raw).__name__}")
    return CONFIG_CLASSES.get(hf_architecture(raw), ArchConfig).from_hf_dict(raw)


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)
