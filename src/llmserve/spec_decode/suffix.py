"""The ``suffix`` method: prompt lookup over the request's own tokens, and where that finds
nothing, over the tokens of recent requests (after SuffixDecoding, Oliaro et al. 2024:
agents, evaluation harnesses and chat users repeat much of what earlier requests said).

The shared history is an index, per n-gram length n in [min_n, max_n], from each n tokens
of the recent requests (prompt and output, held whole) to where they last occurred; a
request enters it when it ends, the oldest leaves it past ``max_cached_requests``. For
every length n from the longest down, the request's own history is searched first (its
freshest context), then the shared one; the first match proposes the tokens that followed
it. Drafts are verified by the target like any other, so what a request generates does not
depend on other requests; how fast it generates does, as with the prefix cache (reset by
the same ``/reset_prefix_cache``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from llmserve.spec_decode.ngram import NgramProposer, ngram_propose


class SharedHistory:
    """The token sequences of the last ``max_sequences`` requests, indexed by n-gram."""

    def __init__(self, min_n: int, max_n: int, max_sequences: int) -> None:
        self.min_n, self.max_n, self.max_sequences = min_n, max_n, max_sequences
        self._sequences: OrderedDict[int, np.ndarray] = OrderedDict()
        self._index: dict[int, dict[bytes, tuple[int, int]]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self._next_id = 0
        self.hits = 0  # lookups that proposed something (cumulative)

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, tokens: np.ndarray) -> None:
        """Index a finished request's tokens (the oldest request leaves when full)."""
        if len(tokens) <= self.min_n:
            return
        sid, self._next_id = self._next_id, self._next_id + 1
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        self._sequences[sid] = tokens
        raw = tokens.tobytes()
        width = tokens.itemsize
        for n, index in self._index.items():
            # Every n-gram with a token after it; later occurrences overwrite earlier ones.
            for end in range(n, len(tokens)):
                index[raw[(end - n) * width:end * width]] = (sid, end)
        while len(self._sequences) > self.max_sequences:
            self._drop(next(iter(self._sequences)))

    def _drop(self, sid: int) -> None:
        tokens = self._sequences.pop(sid)
        raw, width = tokens.tobytes(), tokens.itemsize
        for n, index in self._index.items():
            for end in range(n, len(tokens)):
                key = raw[(end - n) * width:end * width]
                if index.get(key, (None,))[0] == sid:
                    del index[key]

    def lookup(self, suffix: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed ``suffix`` (its exact length) where it last
        occurred in the shared history; [] when it did not."""
        index = self._index.get(len(suffix))
        if index is None:
            return []
        hit = index.get(np.ascontiguousarray(suffix, dtype=np.int64).tobytes())
        if hit is None:
            return []
        sid, end = hit
        self.hits += 1
        return self._sequences[sid][end:end + k].tolist()

    def clear(self) -> None:
        self._sequences.clear()
        for index in self._index.values():
            index.clear()


def suffix_propose(tokens: np.ndarray, shared: SharedHistory, k: int) -> list[int]:
    """The longest match first: for n from max_n down to min_n, the request's own history
    (prompt lookup), then the shared one."""
    length = len(tokens)
    for n in range(min(shared.max_n, length - 1), shared.min_n - 1, -1):
        own = ngram_propose(tokens, n, n, k)
        if own:
            return own
        found = shared.lookup(tokens[length - n:], k)
        if found:
            return found
    return []


class SuffixProposer(NgramProposer):
    """The ``suffix`` method: NgramProposer's per-request histories, plus SharedHistory."""

    def __init__(self, min_n: int, max_n: int, max_cached_requests: int) -> None:
        super().__init__(min_n, max_n)
        self.shared = SharedHistory(min_n, max_n, max_cached_requests)

    def propose(self, requests: list, counts: list[int]) -> list[list[int]]:
        return [suffix_propose(self.history(r), self.shared, k) if k else []
                for r, k in zip(requests, counts)]

    def free(self, request_id: str) -> None:
        tokens = self._tokens.pop(request_id, None)
        if tokens is not None:
            self.shared.add(tokens)

    def reset(self) -> None:
        self.shared.clear()
