"""Qwen3: the Llama shape with queries and keys normalised per head (QK-norm) before the
rotary embedding, and no q/k/v biases."""

from __future__ import annotations

import torch

from llmserve.attention import AttentionContext
from llmserve.layers.norm import RMSNorm
from llmserve.layers.quantization import WeightFormat
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.models.arch_config import ArchConfig
from llmserve.models.llama import LlamaAttention, LlamaForCausalLM

# GGUF tensor names beyond the Llama shape's (llama.cpp's names).
GGUF_LAYER_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 fmt: WeightFormat) -> None:
        super().__init__(cfg, layer_idx, rotary, fmt)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        d = self.head_dim
        q = self.q_norm(q.reshape(-1, d)).view(-1, self.num_heads, d)
        k = self.k_norm(k.reshape(-1, d)).view(-1, self.num_kv_heads, d)
        v = v.reshape(-1, self.num_kv_heads, d)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
