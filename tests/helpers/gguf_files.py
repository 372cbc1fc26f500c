"""Write tiny Llama models as GGUF files the way llama.cpp's converter does.

The Q4_K and Q6_K formats have no quantizer in the ``gguf`` package; for them the test
writes random, valid blocks (random nibbles, small finite scales) and the reference model
takes the ``gguf`` package's dequantization of those blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType, GGUFWriter, quants

from llmserve.models.gguf_loader import GGUFFile
from llmserve.models.loader import DEFAULT_MODEL, resolve_model_path

_LAYER_MAP = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_BLOCK_BYTES = {QT.Q4_K: 144, QT.Q6_K: 210}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, param = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_MAP[module]}.{param}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (rotate-half -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_kquant(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random valid K-quant blocks, [rows, cols // 256 * block_bytes] uint8."""
    nblocks = rows * cols // 256
    raw = rng.integers(0, 256, size=(nblocks, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    scale = (rng.uniform(0.0005, 0.002, size=nblocks)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q4_K:  # d, dmin (f16) lead the block
        raw[:, 0:2] = scale.reshape(-1, 2)
        raw[:, 2:4] = scale.reshape(-1, 2)
    else:  # Q6_K: d (f16) ends the block
        raw[:, -2:] = scale.reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_llama_gguf(hf_model, path: Path, qtype: QT, *, arch: str = "llama",
                     seed: int = 0, metadata: dict[str, Any] | None = None
                     ) -> dict[str, torch.Tensor]:
    """Write ``hf_model`` to ``path`` with 2-D weights in ``qtype``. ``metadata`` replaces
    keys of the header (a value of None removes the key): a broken file on purpose.

    Returns the state dict the file really holds (dequantized, Hugging Face layout), to
    load into the reference model.
    """
    cfg = hf_model.config
    rng = np.random.default_rng(seed)
    tok_meta = GGUFFile(resolve_model_path(DEFAULT_MODEL)).metadata
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok_meta["tokenizer.ggml.tokens"])
    w.add_token_types(tok_meta["tokenizer.ggml.token_type"])
    w.add_token_merges(tok_meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(tok_meta["tokenizer.chat_template"])

    held: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        if "rotary" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = permute(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = permute(array, cfg.num_key_value_heads)
        is_qk = name.endswith(("q_proj.weight", "k_proj.weight"))
        if array.ndim == 1:
            data, dtype, stored = array, QT.F32, array
        elif qtype in _BLOCK_BYTES and not is_qk:
            data = random_kquant(array.shape[0], array.shape[1], qtype, rng)
            dtype, stored = qtype, quants.dequantize(data, qtype)
        elif qtype in _BLOCK_BYTES:  # q/k stay in a format with a quantizer
            data = quants.quantize(array, QT.Q8_0)
            dtype, stored = QT.Q8_0, quants.dequantize(data, QT.Q8_0)
        elif qtype == QT.F32:
            data, dtype, stored = array, QT.F32, array
        elif qtype == QT.F16:
            data = array.astype(np.float16)
            dtype, stored = QT.F16, data.astype(np.float32)
        else:
            data = quants.quantize(array, qtype)
            dtype, stored = qtype, quants.dequantize(data, qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=dtype)
        stored = stored.reshape(array.shape)
        if name.endswith("q_proj.weight"):  # back to the Hugging Face layout for the reference
            stored = _unpermute_ref(stored, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            stored = _unpermute_ref(stored, cfg.num_key_value_heads)
        held[name] = torch.from_numpy(np.array(stored, dtype=np.float32))
    for key, value in (metadata or {}).items():
        kv = w.kv_data[0]
        old = kv.pop(key, None)
        if value is not None:
            keep = old is not None and not isinstance(value, str)  # the same width of number
            vtype = old.type if keep else GGUFValueType.get_type(value)
            w.add_key_value(key, value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _unpermute_ref(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of permute(), written as "apply permute's index map backwards".
    rows = w.shape[0]
    index = permute(np.arange(rows), n_head)
    out = np.empty_like(w)
    out[index] = w
    return out
