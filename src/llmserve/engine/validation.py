"""The checks a request must pass against the model before it may reach the engine.

Pure functions of the request and two numbers the engine reports once (context window and
vocabulary size), so that the API server runs them at the edge and the engine runs the
same ones again when a request is added in-process.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.sampling_params import SamplingParams
from llmserve.structured_output import validate_structured


class ContextLengthError(ValueError):
    """A prompt, or a prompt plus max_tokens, does not fit the context window."""

    def __init__(self, message: str, prompt_alone: bool = False) -> None:
        super().__init__(message)
        self.prompt_alone = prompt_alone  # the prompt leaves no room, whatever max_tokens


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int,
                  vocab_size: int) -> int:
    """Raise ContextLengthError or ValueError with a message for the user; return the
    resolved max_tokens."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty: it must contain at least one token")
    if n > max_model_len or (n == max_model_len and params.max_tokens != 0):
        # (a prompt that fills the window may still be scored: max_tokens 0)
        raise ContextLengthError(f"the prompt has {n} tokens, the context window is "
                                 f"{max_model_len}: no room left to generate",
                                 prompt_alone=True)
    room = max_model_len - n
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise ContextLengthError(
            f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context "
            f"window of {max_model_len} tokens; lower max_tokens to at most {room}")
    if params.min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({params.min_tokens}) exceeds the tokens this request "
                         f"may generate ({max_tokens})")
    bad = next((t for t in prompt_token_ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size),
               None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", list(params.logit_bias or ()))):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name} has token id {bad}, outside the vocabulary "
                             f"[0, {vocab_size})")
    if params.structured_outputs is not None:
        validate_structured(params.structured_outputs)  # GrammarError names what is wrong
    return max_tokens
