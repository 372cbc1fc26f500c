"""Gemma 3 (text) in plain PyTorch.

Not Llama-shaped: sliding-window layers (five in six by default, window 512 on the real
models, their own rope base of 10k) between global ones (rope base 1M); queries and keys
normalised per head (QK-norm); attention scaled by ``query_pre_attn_scalar ** -0.5``;
embeddings scaled by sqrt(hidden); four norms per layer (the attention's and the MLP's
outputs are normalised before their residual add), each ``x * (1 + w)``, which loading
folds into the weight; a GeLU-tanh gated MLP; the head tied to the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention import AttentionContext
from llmserve.layers.linear import Linear, MergedLinear, VocabEmbedding
from llmserve.layers.norm import RMSNorm
from llmserve.layers.quantization import WeightFormat
from llmserve.layers.quantization.base import WeightSource
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.models.arch_config import ArchConfig, RopeScaling, _rope_scaling, hf_int
from llmserve.models.base import CausalLM
from llmserve.models.llama import LlamaAttention

SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config(ArchConfig):
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()  # SLIDING or GLOBAL, one per layer
    rope_local_theta: float = 10000.0
    hidden_activation: str = "gelu_pytorch_tanh"
    # Norm weights as stored: w (Hugging Face; the norm computes x * (1 + w)) or already
    # 1 + w (llama.cpp's GGUF files).
    norm_weights_shifted: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                SLIDING, GLOBAL}:
            raise ValueError(f"layer_types must name {self.num_hidden_layers} layers, each "
                             f"{SLIDING!r} or {GLOBAL!r}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got "
                             f"{self.sliding_window}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def first_layers(self, num_layers: int) -> Gemma3Config:
        return replace(self, num_hidden_layers=num_layers,
                       layer_types=self.layer_types[:num_layers])

    @property
    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads, self.num_key_value_heads
        layer = h * (q + 2 * kv) * d + q * d * h + 3 * h * self.intermediate_size
        layer += 4 * h + 2 * d  # four norms, QK-norm
        return self.num_hidden_layers * layer + self.vocab_size * h + h

    @classmethod
    def from_gguf(cls, base: ArchConfig, get: Any) -> Gemma3Config:
        """From a GGUF file's metadata (``get(key)`` reads ``gemma3.<key>``), as llama.cpp
        reads it: every sixth layer global, local rope base 10k, queries scaled by
        head_dim ** -0.5, norm weights stored as 1 + w."""
        n = base.num_hidden_layers
        common = {f.name: getattr(base, f.name) for f in fields(ArchConfig)}
        # GGUF files do not store query_pre_attn_scalar: llama.cpp uses head_dim, and
        # hidden / heads for the 27B model (62 layers), as its config.json says.
        scalar = (base.hidden_size / base.num_attention_heads if n == 62
                  else float(base.head_dim))
        return cls(**common, query_pre_attn_scalar=scalar,
                   sliding_window=int(get("attention.sliding_window", 512)),
                   layer_types=tuple(GLOBAL if (i + 1) % 6 == 0 else SLIDING
                                     for i in range(n)),
                   norm_weights_shifted=True)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Gemma3Config:
        base = ArchConfig.from_hf_dict(cfg)
        if cfg.get("final_logit_softcapping") is not None or cfg.get(
                "attn_logit_softcapping") is not None:
            raise ValueError("logit soft-capping (Gemma 2) is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention is not supported")
        n = base.num_hidden_layers
        types = cfg.get("layer_types")
        if not types:  # older configs: every sliding_window_pattern-th layer is global
            key = ("sliding_window_pattern" if "sliding_window_pattern" in cfg
                   else "_sliding_window_pattern")
            pattern = hf_int(cfg, key, 6)
            if pattern < 1:
                raise ValueError(f"{key} must be a positive integer, got {pattern}")
            types = [GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        params = cfg.get("rope_parameters") or {}
        if GLOBAL in params or SLIDING in params:  # transformers 5: per layer type
            global_rope, local_rope = params.get(GLOBAL) or {}, params.get(SLIDING) or {}
            rope_theta = float(global_rope.get("rope_theta", 1_000_000.0))
            local_theta = float(local_rope.get("rope_theta", 10_000.0))
            scaling = _rope_scaling(global_rope)
            if _rope_scaling(local_rope) != RopeScaling():
                raise ValueError("rope scaling on sliding-window layers is not supported")
        else:
            rope_theta = float(cfg.get("rope_theta", 1_000_000.0))
            local_theta = float(cfg.get("rope_local_base_freq", 10_000.0))
            scaling = _rope_scaling(cfg.get("rope_scaling"))
        common = {f.name: getattr(base, f.name) for f in fields(ArchConfig)}
        common.update(rope_theta=rope_theta, rope_scaling=scaling,
                      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
        return cls(**common,
                   query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                   sliding_window=hf_int(cfg, "sliding_window", 512),
                   layer_types=tuple(types), rope_local_theta=local_theta,
                   hidden_activation=cfg.get("hidden_activation")
                   or cfg.get("hidden_act") or "gelu_pytorch_tanh")


# GGUF tensor names of a layer that differ from the Llama shape's (llama.cpp's names).
GGUF_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: Gemma3Config, layer_idx: int, rotary: RotaryEmbedding,
                 fmt: WeightFormat) -> None:
        super().__init__(cfg, layer_idx, rotary, fmt, qk_norm=True,
                         scale=cfg.query_pre_attn_scalar ** -0.5,
                         sliding_window=cfg.window(layer_idx))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config, fmt: WeightFormat) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": size, "up": size},
                                         bias=False, fmt=fmt)
        self.down_proj = Linear(size, cfg.hidden_size, bias=False, fmt=fmt)
        self.approximate = "tanh" if cfg.hidden_activation == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_idx: int, rotary: RotaryEmbedding,
                 fmt: WeightFormat) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Gemma3Attention(cfg, layer_idx, rotary, fmt)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = Gemma3MLP(cfg, fmt)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """``hidden`` [T, hidden]: the residual stream, updated in place and returned."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), ctx)
        # hidden += norm(attention output); the MLP's input is the norm of the sum.
        mlp_in = self.pre_feedforward_layernorm.add_and_norm(
            hidden, self.post_attention_layernorm(attn))
        return hidden.add_(self.post_feedforward_layernorm(self.mlp(mlp_in)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Gemma3Config, fmt: WeightFormat) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, fmt)
        # As the reference: sqrt(hidden) rounded to the model's dtype (float32 here).
        self.normalizer = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).item()
        local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                cfg.rope_local_theta, RopeScaling())
        global_ = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                  cfg.rope_scaling)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, local if cfg.window(i) else global_, fmt)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer
        for layer in self.layers:
            hidden = layer(positions, hidden, ctx)
        return self.norm(hidden)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, fmt: WeightFormat | None = None) -> None:
        super().__init__()
        if not isinstance(cfg, Gemma3Config):
            raise TypeError("Gemma3ForCausalLM needs a Gemma3Config")
        fmt = fmt or WeightFormat()
        self.config: Gemma3Config = cfg
        self.model = Gemma3Model(cfg, fmt)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, method=fmt.head_method())

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        super().load_weights(weights)
        if self.config.norm_weights_shifted:
            return
        # Gemma's norms compute x * (1 + w): fold the 1 into the weight once.
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
