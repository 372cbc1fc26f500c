"""Qwen2: the Llama architecture with biases on the q/k/v projections."""

from __future__ import annotations

from dataclasses import replace

from llmserve.layers.quantization import WeightFormat
from llmserve.models.arch_config import ArchConfig
from llmserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, fmt: WeightFormat | None = None) -> None:
        super().__init__(replace(cfg, attention_bias=True), fmt)
