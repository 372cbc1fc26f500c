"""Qwen3: the Llama shape with queries and keys normalised per head (QK-norm) before the
rotary embedding, and no q/k/v biases."""

from __future__ import annotations

from llmserve.layers.quantization import WeightFormat
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.models.arch_config import ArchConfig
from llmserve.models.llama import LlamaAttention, LlamaForCausalLM

# GGUF tensor names beyond the Llama shape's (llama.cpp's names).
GGUF_LAYER_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 fmt: WeightFormat) -> None:
        super().__init__(cfg, layer_idx, rotary, fmt, qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
