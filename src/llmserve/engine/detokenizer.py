"""Incremental detokenization: text deltas that never split a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a
prefix yields U+FFFD. The text of the last few tokens is decoded in context (from
``prefix_offset``) and a delta is released only once it no longer ends in U+FFFD, so the
emitted text only grows and never contains a broken character.
"""

from __future__ import annotations

from llmserve.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # tokens decoded before the new ones, for merges across boundaries


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly decided text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # wait for the rest of the character
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: release whatever is left, broken character or not."""
        full = self._decode(self.token_ids[self.prefix_offset:])
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
