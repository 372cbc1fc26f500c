"""Prompt lookup: propose the tokens that followed the last earlier occurrence of the
sequence's own ending n-gram (the longest n between min and max that occurs earlier)."""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the last n tokens,
    for the longest n in [min_n, max_n] that has one; [] when none has.

    ``tokens``: the prompt and output so far (1-D integer array). One pass over the history
    finds the earlier occurrences of the last token; each longer n then only checks the
    candidates still matching (the cost grows with the history once, not once per n).
    """
    last = len(tokens) - 1
    if last < min_n:
        return []
    # Ends j of earlier matches (each with a token after it: j < last), ascending.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    best = ends if min_n == 1 else ends[:0]
    for n in range(2, min(max_n, last) + 1):
        if not len(ends):
            break
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[last - (n - 1)]]
        if n >= min_n and len(ends):
            best = ends
    if not len(best):
        return []
    start = int(best[-1]) + 1  # the most recent occurrence: the freshest context
    return tokens[start:start + k].tolist()


class NgramProposer:
    """The ``ngram`` method; keeps a growing numpy copy of each request's tokens."""

    cheap = True
    step_seconds = 0.0
    last_catch_up_seconds = 0.0

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, np.ndarray] = {}

    def propose(self, requests: list, counts: list[int]) -> list[list[int]]:
        return [ngram_propose(self.history(r), self.min_n, self.max_n, k) if k else []
                for r, k in zip(requests, counts)]

    def history(self, request) -> np.ndarray:
        """The request's prompt and output so far, as an array kept between calls."""
        all_ids = request.all_token_ids
        cached = self._tokens.get(request.request_id)
        if cached is None or len(cached) > len(all_ids):
            cached = np.asarray(all_ids, dtype=np.int64)
        elif len(cached) < len(all_ids):
            cached = np.concatenate([cached, np.asarray(all_ids[len(cached):], np.int64)])
        self._tokens[request.request_id] = cached
        return cached

    def catch_up_seconds(self, request) -> float:
        return 0.0  # a lookup reads the request's tokens as they are

    def free(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def reset(self) -> None:
        pass  # nothing shared between requests
