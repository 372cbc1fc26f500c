"""Text <-> token ids, special tokens, end-of-turn ids and the chat template of a model."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from llmserve.tokenizer.chat_template import render_chat_template

# Special tokens that end an assistant turn in common chat formats, when the vocabulary
# has them as special tokens (ChatML, Llama 3, Gemma, plain end-of-text).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>",
                       "<|end|>", "</s>")


class Tokenizer:
    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, add_bos: bool = False,
                 chat_template: str | None = None,
                 extra_stop_ids: tuple[int, ...] = ()) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        specials = {tok.content: i for i, tok in backend.get_added_tokens_decoder().items()
                    if tok.special}
        self.special_token_ids: frozenset[int] = frozenset(specials.values())
        stop = {i for i in (eos_token_id, *extra_stop_ids) if i is not None}
        stop.update(specials[t] for t in _END_OF_TURN_TOKENS if t in specials)
        # Token ids that end generation (unless the request says ignore_eos).
        self.stop_token_ids: frozenset[int] = frozenset(stop)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """No token stands for more characters of text than this (its vocabulary string is
        at least as long as the text it covers)."""
        return max(map(len, self.backend.get_vocab()), default=1)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a token may hold part of a character)."""
        tok = self.backend.id_to_token(token_id)
        if tok is None:
            return b""
        if token_id in self._added_ids:
            return tok.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in tok):
                return bytes(table[c] for c in tok)
            return tok.encode()
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            return bytes([int(tok[3:5], 16)])  # SentencePiece byte fallback
        return tok.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """A token's text on its own; a partial UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        return "ByteLevel" in json.dumps(decoder)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "", **variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """The template writes its own special tokens, so none are added on encode."""
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        from llmserve.tokenizer.gguf_tokenizer import build_gguf_tokenizer

        kind = meta.get("tokenizer.ggml.model")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(build_gguf_tokenizer(meta),
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                   add_bos=add_bos,
                   chat_template=meta.get("tokenizer.chat_template"),
                   extra_stop_ids=() if eot is None else (int(eot),))

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """tokenizer.json plus tokenizer_config.json / generation_config.json if present."""
        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        if (path / "tokenizer.json").exists():
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            backend = AutoTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return None if tok is None else backend.token_to_id(tok)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        gen_eos = gen.get("eos_token_id")
        extra = tuple(gen_eos) if isinstance(gen_eos, list) else (
            () if gen_eos is None else (int(gen_eos),))
        bos_id = token_id("bos_token")
        # tokenizer.json's post-processor adds BOS where the model wants one.
        return cls(backend, bos_token_id=bos_id, eos_token_id=token_id("eos_token"),
                   add_bos=False, chat_template=template, extra_stop_ids=extra)

    def save(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (used to equip test models)."""
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token,
               "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    return json.loads(path.read_text())
