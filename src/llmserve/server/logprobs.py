"""Log-probabilities in OpenAI's (and vLLM's) shapes, from the engine's entries.

An entry is one token's ``{token id: Logprob}``: the chosen token first, then the most
likely tokens with their ranks. Three shapes come out of it: the legacy completions object
(tokens, token_logprobs, top_logprobs, text_offset), chat's ``content`` list with bytes, and
vLLM's ``prompt_logprobs``. Under ``echo`` the completions object starts with the prompt's
rows; the first prompt token has no logprob (nothing predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmserve.outputs import Logprob
from llmserve.tokenizer import Tokenizer

# One token of a completions logprobs object: its text, logprob and top alternatives (both
# None for the prompt's first token, which nothing predicts).
Row = tuple[str, float | None, dict[str, float] | None]


@dataclass
class Echoed:
    """What a choice starts with under echo: the prompt's text, and its logprobs rows when
    logprobs were asked (None otherwise)."""

    text: str = ""
    rows: list[Row] | None = None


NO_ECHO = Echoed()

# The lowest logprob a response carries: a token a structured output's grammar forbids has
# -inf, which JSON cannot hold (Python writes a bare -Infinity; strict parsers refuse it).
# OpenAI and vLLM send -9999.0 in its place.
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of an entry (the chosen token comes first in it and belongs
    here only if it ranks within the top k)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)


def row(entry: dict[int, Logprob], k: int) -> Row:
    """A token's row: its text and logprob, and the chosen token with the k most likely
    (k + 1 entries, or k when it is among them: the legacy API "will always return the
    logprob of the sampled token", as OpenAI and vLLM do)."""
    chosen = next(iter(entry.values()))
    tops = {chosen.decoded_token: finite(chosen.logprob)}
    for _, lp in top(entry, k):  # (a text two tokens share keeps the first's logprob)
        tops.setdefault(lp.decoded_token, finite(lp.logprob))
    return chosen.decoded_token, finite(chosen.logprob), tops


def echoed_with_logprobs(tokenizer: Tokenizer, text: str, ids: list[int],
                         entries: list[dict[int, Logprob] | None] | None, k: int) -> Echoed:
    """The echoed prompt ``ids`` with a row per token, from the engine's prompt logprobs."""
    if entries is None or len(entries) != len(ids):
        raise RuntimeError("the engine returned no prompt logprobs for an echoed prompt")
    rows: list[Row] = [(tokenizer.token_text(ids[0]), None, None)]
    rows += [row(entry, k) for entry in entries[1:] if entry is not None]
    if len(rows) != len(ids):
        raise RuntimeError("the engine's prompt logprobs miss some prompt tokens")
    return Echoed(text, rows)


def completion_logprobs(entries: list[dict[int, Logprob]] | None, k: int,
                        echoed: list[Row] | None = None,
                        offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs object over the echoed prompt's rows (if any), then the
    generated tokens; text_offset counts on from ``offset`` (what a stream's earlier chunks
    of the choice covered)."""
    if entries is None and echoed is None:
        return None
    rows = (echoed or []) + [row(entry, k) for entry in entries or ()]
    offsets, pos = [], offset
    for token, _, _ in rows:
        offsets.append(pos)
        pos += len(token)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None,
                    k: int) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: None for the first token, then per prompt token its own
    logprob and the top k (keys are token ids as strings, as JSON needs)."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token}
        for j, (tid, lp) in enumerate(entry.items()) if j == 0 or lp.rank <= k}
        for entry in entries]


def chat_logprobs(tokenizer: Tokenizer, entries: list[dict[int, Logprob]] | None,
                  k: int) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = []
    for entry in entries:
        chosen_id, chosen = next(iter(entry.items()))
        content.append({
            "token": chosen.decoded_token, "logprob": finite(chosen.logprob),
            "bytes": list(tokenizer.token_bytes(chosen_id)),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": finite(lp.logprob),
                              "bytes": list(tokenizer.token_bytes(tid))}
                             for tid, lp in top(entry, k)],
        })
    return {"content": content}
