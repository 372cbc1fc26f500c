"""GGUF files: architecture config, weights and tokenizer metadata, all from the file.

Tensors are read through the ``gguf`` package's memory map and dequantized one at a time
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K, as far as the
``gguf`` package supports them). llama.cpp's converter permutes the rows of Llama's q/k
projections for its interleaved rotary layout; they are permuted back here, so the model
code sees Hugging Face's layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.errors import ModelLoadError
from llmserve.layers.quantization import BlockQuantized
from llmserve.layers.quantization.base import WeightSource
from llmserve.models.arch_config import ArchConfig, RopeScaling
from llmserve.models.gemma3 import GGUF_LAYER_NAMES as GEMMA3_LAYER_NAMES
from llmserve.models.gguf_reader import GGUFFormatError, GGUFReader
from llmserve.models.qwen3 import GGUF_LAYER_NAMES as QWEN3_LAYER_NAMES
from llmserve.models.registry import CONFIG_CLASSES, GGUF_ARCHITECTURES

GGUF_MAGIC = b"GGUF"

SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Families whose layers name some tensors otherwise (their own files say how).
_FAMILY_LAYER_NAMES = {"gemma3": GEMMA3_LAYER_NAMES, "qwen3": QWEN3_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFFile:
    """An opened, validated GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = self.reader.metadata
        self.gguf_arch = str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.gguf_arch}.{key}", default)

    def need(self, key: str, default: int | None = None) -> int:
        """The integer ``<architecture>.<key>``: KeyError naming it when it is absent and
        has no ``default``, ValueError when it is not an integer."""
        name = f"{self.gguf_arch}.{key}"
        value = self.metadata.get(name, default)
        if value is None:
            raise KeyError(name)
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(value)

    def arch_config(self) -> ArchConfig:
        if self.gguf_arch not in GGUF_ARCHITECTURES:
            supported = ", ".join(sorted(GGUF_ARCHITECTURES))
            raise ModelLoadError(f"{self.path}: unsupported architecture "
                                 f"{self.gguf_arch or '(none)'!r} (supported: {supported})")
        try:
            hidden = self.need("embedding_length")
            heads = self.need("attention.head_count")
            kv_heads = self.need("attention.head_count_kv", heads)
            n_vocab = self.get("vocab_size") or len(self.metadata["tokenizer.ggml.tokens"])
            head_dim = self.need("attention.key_length", hidden // heads if heads > 0 else 0)
            scaling = RopeScaling()
            if self.get("rope.scaling.type") == "linear":
                scaling = RopeScaling("linear", float(self.get("rope.scaling.factor")))
            tensor_names = {t.name for t in self.reader.tensors}
            if "rope_freqs.weight" in tensor_names:
                factors = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
                values = self.reader.tensor_data(factors).view(np.float32).ravel()
                scaling = RopeScaling("llama3", freq_factors=tuple(float(x) for x in values))
            base = ArchConfig(
                architecture=GGUF_ARCHITECTURES[self.gguf_arch],
                vocab_size=int(n_vocab),
                hidden_size=hidden,
                intermediate_size=self.need("feed_forward_length"),
                num_hidden_layers=self.need("block_count"),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=self.need("context_length", 4096),
                rms_norm_eps=float(self.get("attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(self.get("rope.freq_base", 10000.0)),
                rope_scaling=scaling,
                tie_word_embeddings="output.weight" not in tensor_names,
                attention_bias="blk.0.attn_q.bias" in tensor_names,
                bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=_eos_ids(self.metadata),
            )
            return CONFIG_CLASSES.get(base.architecture, ArchConfig).from_gguf(base, self.get)
        except KeyError as e:
            raise ModelLoadError(f"{self.path}: incomplete model metadata (no {e})") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: invalid model metadata: {e}") from None

    def weight_types(self) -> set[str]:
        """The GGUF types of the 2-D (matrix) tensors."""
        return {t.tensor_type.name for t in self.reader.tensors if len(t.torch_shape) == 2}

    def weights(self, cfg: ArchConfig, keep_q4_blocks: bool = False
                ) -> Iterator[tuple[str, WeightSource]]:
        """Yield (Hugging Face name, tensor) pairs one at a time: float32, or with
        ``keep_q4_blocks`` Q4_0/Q4_1 tensors as ``BlockQuantized`` (never expanded)."""

        permute_qk = self.gguf_arch in ("llama", "mistral")
        layer_names = {**_LAYER_NAMES, **_FAMILY_LAYER_NAMES.get(self.gguf_arch, {})}
        for t in self.reader.tensors:
            name = _hf_name(t.name, layer_names)
            if name is None:
                continue
            if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(f"{self.path}: tensor {t.name} has unsupported type "
                                     f"{t.tensor_type.name} (supported: "
                                     f"{', '.join(SUPPORTED_TENSOR_TYPES)})")
            raw = self.reader.tensor_data(t)
            if keep_q4_blocks and t.tensor_type.name in _Q4_BLOCK_BYTES:
                heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
                proj = name.split(".")[-2]
                blocks = _q4_blocks(raw, t.tensor_type.name, tuple(t.torch_shape))
                if permute_qk and proj in heads:
                    blocks = BlockQuantized(*(torch.from_numpy(np.ascontiguousarray(
                        _unpermute(a.numpy(), heads[proj])))
                        for a in (blocks.q, blocks.scale, blocks.zero)))
                yield name, blocks
                continue
            array = _dequantize(raw, t.tensor_type, tuple(t.torch_shape))
            if permute_qk and name.endswith("q_proj.weight"):
                array = _unpermute(array, cfg.num_attention_heads)
            elif permute_qk and name.endswith("k_proj.weight"):
                array = _unpermute(array, cfg.num_key_value_heads)
            if not array.flags.writeable:  # a view of the read-only memory map
                array = array.copy()
            yield name, torch.from_numpy(np.ascontiguousarray(array))


_DEQUANT_ROWS = 8192  # rows dequantized at a time


def _dequantize(raw: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor as float32, dequantized a slab of rows at a time into its final array:
    gguf's dequantizers keep several float temporaries of their input's size, which for
    a large embedding (Gemma 3's 262144 x 640) tripled the memory of the tensor itself."""
    from gguf import quants

    if raw.ndim != 2 or raw.shape[0] != shape[0] or raw.shape[0] <= _DEQUANT_ROWS:
        return quants.dequantize(raw, qtype).astype(np.float32, copy=False).reshape(shape)
    out = np.empty(shape, dtype=np.float32)
    for r in range(0, shape[0], _DEQUANT_ROWS):
        out[r:r + _DEQUANT_ROWS] = quants.dequantize(raw[r:r + _DEQUANT_ROWS], qtype).reshape(
            -1, *shape[1:])
    return out


_Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # 32 weights per block


def _q4_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> BlockQuantized:
    """Split Q4_0 / Q4_1 blocks (f16 scale, [f16 min,] 16 bytes of nibbles: low nibbles are
    weights 0..15 of the block, high nibbles 16..31) into values, scales and offsets."""
    rows, cols = shape
    blocks = np.asarray(raw).view(np.uint8).reshape(-1, _Q4_BLOCK_BYTES[type_name])
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    if type_name == "Q4_1":
        zero = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = blocks[:, 4:]
    else:  # Q4_0: w = scale * (q - 8)
        zero = -8 * scale
        nibbles = blocks[:, 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # [nb, 32]
    groups = cols // 32
    return BlockQuantized(torch.from_numpy(q.reshape(rows, cols)),
                          torch.from_numpy(scale.reshape(rows, groups)),
                          torch.from_numpy(zero.reshape(rows, groups)))


def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _open_reader(path: Path) -> GGUFReader:
    try:
        magic = is_gguf(path)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e.strerror})") from None
    if not magic:
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic at the start) and not a "
                             "Hugging Face model directory")
    try:
        return GGUFReader(path)
    except GGUFFormatError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: corrupt GGUF file ({e})") from None


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if gguf_name.startswith("rope_freqs"):
        return None  # Llama 3 frequency factors; recomputed from the scaling metadata
    raise ValueError(f"unexpected tensor {gguf_name!r}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half rotary layout)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if key in meta:
            ids.append(int(meta[key]))
    return tuple(dict.fromkeys(ids))
