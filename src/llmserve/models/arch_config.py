"""The architecture hyper-parameters a model class needs, from either source format."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Rotary position scaling. ``rope_type`` is "default", "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-frequency divisors stored by GGUF files (``rope_freqs.weight``) in place of the
    # Llama 3 parameters; when set, they replace the computed scaling.
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # a registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.rms_norm_eps >= 0 or not self.rope_theta > 0:  # NaN fails both
            raise ValueError(f"rms_norm_eps ({self.rms_norm_eps}) must be >= 0 and rope_theta "
                             f"({self.rope_theta}) > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def first_layers(self, num_layers: int) -> ArchConfig:
        """The configuration of this model's first ``num_layers`` layers (a draft)."""
        return dataclasses.replace(self, num_hidden_layers=num_layers)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it sees the whole context)."""
        return None

    @property
    def num_parameters(self) -> int:
        """Parameters of the model as trained (before any quantization)."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        attention = h * (q + 2 * kv) * self.head_dim + q * self.head_dim * h
        if self.attention_bias:
            attention += (q + 2 * kv) * self.head_dim
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        layer = attention + mlp + 2 * h  # two norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + h  # final norm

    @classmethod
    def from_gguf(cls, base: ArchConfig, get: Any) -> ArchConfig:
        """A family's configuration from a GGUF file: ``base`` holds what every family
        reads from its metadata, ``get(key)`` reads ``<architecture>.<key>``. The Llama
        shape needs nothing more."""
        return base

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Read a Hugging Face config.json (already parsed)."""
        arch = hf_architecture(cfg)
        heads = hf_int(cfg, "num_attention_heads")
        hidden = hf_int(cfg, "hidden_size")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=hf_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=hf_int(cfg, "intermediate_size"),
            num_hidden_layers=hf_int(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf_int(cfg, "num_key_value_heads", heads),
            head_dim=hf_int(cfg, "head_dim", hidden // heads if heads > 0 else 0),
            max_position_embeddings=hf_int(cfg, "max_position_embeddings", 4096),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


# Fields that must be at least 1 (a zero would divide by zero, or build an empty model).
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def hf_architecture(cfg: dict[str, Any]) -> str:
    """The first name of config.json's ``architectures`` list."""
    archs = cfg.get("architectures")
    if not archs:
        raise KeyError("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures must be a list of class names such as "
                         f"[\"LlamaForCausalLM\"], got {archs!r}")
    return archs[0]


_MISSING = object()


def hf_int(cfg: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    """config.json's integer ``key``; ``default`` when it is absent or null (where the field
    is optional)."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{key} is {'null' if key in cfg else 'missing'}: it must be an "
                             "integer")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return int(value)


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise ValueError(f"rope_scaling must be an object, got {raw!r}")
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: linear, llama3)")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
