"""Build a Hugging Face ``tokenizers.Tokenizer`` from the metadata of a GGUF file.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen2)
are built here, with the pre-tokenizer that ``tokenizer.ggml.pre`` names; other vocabulary
types (SentencePiece "llama", "t5") go through transformers' GGUF converter.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's pre-tokenizer names -> the split regex of the original tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def build_gguf_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError("no tokenizer in the file (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        return _via_transformers(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tk.decoder = decoders.ByteLevel()
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED])
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL])
    return tk


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _via_transformers(meta: dict[str, Any]) -> HFTokenizer:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in meta}
    tokenizer, _ = convert_gguf_tokenizer(str(meta.get("general.architecture")), tokenizer_dict)
    return tokenizer
