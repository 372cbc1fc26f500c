"""Tiny random-weight models built with transformers and saved locally (no hub access).

Each test model gets SmolLM2's tokenizer (read from the embedded GGUF), so its vocabulary
is 49152 tokens; everything else is small.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from llmserve.models.gguf_loader import GGUFFile
from llmserve.models.loader import DEFAULT_MODEL, resolve_model_path
from llmserve.tokenizer import Tokenizer

VOCAB = 49152

TINY_CONFIGS: dict[str, dict] = {
    # grouped-query attention, separate LM head
    "llama-gqa": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False),
    # tied head, multi-head attention
    "llama-tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4,
                       tie_word_embeddings=True),
    # Llama 3 rope scaling
    "llama3-rope": dict(arch="llama", num_attention_heads=4, num_key_value_heads=1,
                        tie_word_embeddings=False,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}),
    "qwen2": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False),
    # Gemma 3: five sliding-window layers (32 keys, so that a 100-token prompt leaves the
    # window) and a global one, QK-norm, head_dim 16 (the compiled kernels' vector width)
    # Qwen3: QK-norm on the Llama shape, head_dim set apart from hidden / heads
    "qwen3": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False),
    "gemma3": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_hidden_layers=6, sliding_window=32, query_pre_attn_scalar=16,
                   tie_word_embeddings=True),
}


# Every weight format with its KV cache formats, as (quantization, dtype, KV cache dtype):
# what the bitwise tests (batch invariance, the fused decoder stack) run through.
WEIGHT_AND_KV_FORMATS = [
    ("none", "float32", "float32"),
    ("none", "bfloat16", "bfloat16"),
    ("int8", "float32", "float32"),
    ("w8a8", "float32", "float32"),
    ("int4", "float32", "float32"),
    ("none", "float32", "fp8_e4m3"),
    ("int4", "float32", "int8"),
]


def smollm2_tokenizer() -> Tokenizer:
    """From the embedded GGUF; where that package is absent (a GPU machine the tests are
    carried to), from the saved tokenizer directory ``LLMSERVE_TEST_TOKENIZER`` names."""
    saved = os.environ.get("LLMSERVE_TEST_TOKENIZER")
    if saved:
        return Tokenizer.from_hf_dir(Path(saved))
    return Tokenizer.from_gguf_metadata(GGUFFile(resolve_model_path(DEFAULT_MODEL)).metadata)


def build_hf_model(name: str, seed: int = 0):
    """A transformers model (float32, eval mode) for one of TINY_CONFIGS."""
    import transformers

    spec = dict(TINY_CONFIGS[name])
    arch = spec.pop("arch")
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    rope_scaling = spec.pop("rope_scaling", None)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    common = {**common, **{k: spec.pop(k) for k in list(spec) if k in common}}
    config = cls_cfg(**common, **spec)
    if arch == "mistral":
        config.sliding_window = None
    if rope_scaling:
        config.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
    torch.manual_seed(seed)
    model = cls_model(config).float().eval()
    with torch.no_grad():  # larger weights than the default init: sharper, tie-free logits
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif pname.endswith("bias"):
                p.normal_(0, 0.5)
            else:  # norm weights
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def save_hf_model(model, path: Path, tokenizer: Tokenizer, max_shard_size: str | None = None):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    tokenizer.save(path)
    return path
