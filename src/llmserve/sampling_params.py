"""SamplingParams: what a request asks of generation, validated when it is made.

Defaults and meanings follow vLLM and the OpenAI API. Every bad value is rejected at
construction with a ``ValueError`` whose message names the field and the allowed range.
Checks that need the model (token ids within the vocabulary, the context window) happen
when the request is added to the engine.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 128
MAX_TOP_K = 2**31 - 1  # larger means the whole vocabulary anyway
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's names; exactly one of them).

    json: a JSON schema (a dict, or its JSON text) the output must satisfy.
    json_object: any JSON object.
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar, in Lark syntax or llama.cpp's GBNF.

    The grammar engine (llguidance, structured_output/) enforces it token by token; a
    schema or grammar it cannot enforce is refused when the request is made.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be true or false, got "
                             f"{self.json_object!r}")
        if self.json is not None and not isinstance(self.json, str):
            try:  # kept as text: the parameters stay immutable and cheap to send
                text = json.dumps(self.json, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema: {e}") from None
            object.__setattr__(self, "json", text)
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, Sequence)
                    or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        given = self.kinds()
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, "
                             f"regex, choice, grammar; got {', '.join(given) or 'none'}")

    def kinds(self) -> list[str]:
        return [name for name in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(self, name) not in (None, False)]


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters of one request.

    n: sequences to return for the prompt (they share the prompt's KV cache).
    max_tokens: tokens to generate at most; None: up to the context window; 0: compute the
        prompt and generate nothing (to score it with prompt_logprobs, or to warm the
        prefix cache): the request ends after its prefill with finish reason "length".
    min_tokens: tokens to generate before EOS or stop_token_ids may end the sequence.
    temperature: 0 means greedy; higher flattens the distribution. [0, 2]
    top_p: nucleus sampling, the smallest set of tokens with this probability mass. (0, 1]
    top_k: sample among the k most likely tokens; 0 or -1 disables.
    min_p: drop tokens less likely than min_p times the most likely one. [0, 1]
    presence_penalty / frequency_penalty: OpenAI's penalties on generated tokens. [-2, 2]
    repetition_penalty: divides positive / multiplies negative logits of tokens seen in the
        prompt or output (1 disables). (0, 2]
    seed: makes sampling reproducible, whatever else is batched with the request.
    stop: strings that end generation when they appear in the text (not returned unless
        include_stop_str_in_output).
    stop_token_ids: token ids that end generation (returned in token_ids).
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: also return the chosen token's and this many top log-probabilities. [0, 20]
    prompt_logprobs: return this many top log-probabilities per prompt token. [0, 20]
    logit_bias: token id -> bias added to its logit. [-100, 100]
    skip_special_tokens: leave special tokens out of the text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    structured_outputs: constrain the output to a JSON schema, regex, choice or grammar.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        for name, value in (("stop", stop), ("stop_token_ids", self.stop_token_ids or ())):
            if not isinstance(value, list | tuple):
                _fail(name, f"must be a list, got {type(value).__name__}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                _fail("logit_bias", "must be a mapping of token id to bias, got "
                                    f"{type(self.logit_bias).__name__}")
            object.__setattr__(self, "logit_bias", MappingProxyType(
                {_int_key(k): v for k, v in dict(self.logit_bias).items()}))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be true or false, got {getattr(self, name)!r}")
        self._validate()

    def _validate(self) -> None:
        _int_in("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 0, None)
        _int_in("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), "
                                f"got {self.min_tokens}")
        _float_in("temperature", self.temperature, 0.0, 2.0)
        _float_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                or not -1 <= self.top_k <= MAX_TOP_K):
            _fail("top_k", f"must be -1 or 0 (disabled) or a positive integer up to "
                           f"{MAX_TOP_K}, got {self.top_k}")
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        if self.seed is not None:
            _int_in("seed", self.seed, -(2**63), 2**63 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", "must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                _fail("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                _fail("logit_bias", f"token ids must be non-negative, got {tok}")
            _float_in(f"logit_bias[{tok}]", bias, -100.0, 100.0)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                _fail("structured_outputs", "must be a StructuredOutputsParams")
            if self.min_tokens:
                _fail("min_tokens", "cannot be combined with structured outputs: the grammar "
                                    "decides where the output may end")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """The next token is the argmax of the raw logits: greedy, and nothing that changes
        the logits first (bias, penalties, min_tokens, a grammar) or is read beside them
        (logprobs). The sampler needs nothing of such a request but its logits."""
        return (self.greedy and not self.logit_bias and not self.has_penalties
                and self.min_tokens == 0 and self.structured_outputs is None
                and self.logprobs is None)

    def child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n sequences: n = 1 and, if seeded, seed + index.
        Only the first sequence computes prompt logprobs (the prompt's, the same for all):
        the others then take the prompt's KV blocks from the prefix cache instead of
        computing the prompt again for logits they would not need."""
        from dataclasses import replace

        # Wrapped into the signed 64-bit range (seed 2**63 - 1 with n = 2 stays valid).
        seed = None if self.seed is None else (self.seed + index + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=seed,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name} {message}")


def _int_key(k: Any) -> int:
    try:
        return int(k)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids (integers), got {k!r}") from None


def _int_in(name: str, value: Any, low: int | None, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(name, f"must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            _fail(name, f"must be at least {low}, got {value}")
        _fail(name, f"must be in [{low}, {high}], got {value}")


def _float_in(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        _fail(name, f"must be a number, got {value!r}")
    if (value <= low if low_open else value < low) or value > high:
        bracket = "(" if low_open else "["
        _fail(name, f"must be in {bracket}{low:g}, {high:g}], got {value}")
