"""The Llama family (Llama 2/3, SmolLM2, Mistral) in plain PyTorch.

The forward pass works on the step's flattened tokens: ``input_ids`` and ``positions`` are
``[T]`` over every sequence of the batch, and attention goes through the context's backend.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention import Attention, AttentionContext, Rope
from llmserve.layers.linear import Linear, MergedLinear, VocabEmbedding
from llmserve.layers.norm import RMSNorm
from llmserve.layers.quantization import WeightFormat
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.models.arch_config import ArchConfig
from llmserve.models.base import CausalLM
from llmserve.models.fused import FusedDecoder


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, rotary, paged attention, output projection. Families on this
    shape add ``qk_norm`` (queries and keys normalised per head before the rotary: Qwen3,
    Gemma 3), their own ``scale`` and a ``sliding_window``."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 fmt: WeightFormat, *, qk_norm: bool = False, scale: float | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                     bias=cfg.attention_bias, fmt=fmt)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False, fmt=fmt)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=scale, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        d = self.head_dim
        if self.q_norm is not None and self.k_norm is not None:  # per head: [T * H, D] rows
            q = self.q_norm(q.reshape(-1, d)).view(-1, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(-1, self.num_kv_heads, d)
        else:
            q = q.view(-1, self.num_heads, d)
            k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        # The backend rotates q and k (on a GPU in the kernel that stores the keys).
        return self.o_proj(self.attn(q, k, v, ctx, Rope(self.rotary, positions)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, fmt: WeightFormat) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": size, "up": size},
                                         bias=cfg.mlp_bias, fmt=fmt)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias, fmt=fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 fmt: WeightFormat, attention: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg, layer_idx, rotary, fmt)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, fmt)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, ctx: AttentionContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block on ``hidden`` [T, hidden]; ``residual`` is the running sum of the
        block outputs (updated in place), None for the first layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm.add_and_norm(residual, hidden)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden = self.post_attention_layernorm.add_and_norm(residual, hidden)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, fmt: WeightFormat,
                 attention: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, fmt)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, fmt, attention)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The layers as one compiled call when every piece has a kernel (models/fused.py).
        self.fused = FusedDecoder(list(self.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        out = self.fused.run(hidden, positions, ctx)
        if out is not None:
            hidden, residual = out
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, ctx)
        return self.norm.add_and_norm(residual, hidden)


class LlamaForCausalLM(CausalLM):
    # A family on the Llama shape with its own attention (Qwen3's QK-norm) names it here.
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ArchConfig, fmt: WeightFormat | None = None) -> None:
        super().__init__()
        fmt = fmt or WeightFormat()
        self.config = cfg
        self.model = LlamaModel(cfg, fmt, self.attention_class)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, method=fmt.head_method())
