"""The request fields the KV cache manager reads, for driving it without an engine."""

from __future__ import annotations


class FakeReq:
    def __init__(self, rid: str, tokens: list[int], max_tokens: int = 16) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self._num_prompt_tokens = len(tokens)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.cache_salt = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens
