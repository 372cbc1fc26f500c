"""OpenAI-compatible request schemas (plus vLLM's sampling extras) and their translation
into SamplingParams. Unknown fields are ignored, as OpenAI's API does.

Everything a client sends is checked here, at the edge, so that nothing can raise deeper
in: integers within the ranges the engine and its messages carry (64-bit at most), text
that is valid Unicode without NUL characters, and chat content parts of type "text" only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from llmserve.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1


_BAD_CHARS = re.compile("[\ud800-\udfff\x00]")


def _valid_text(value: str) -> str:
    """Refuse what no tokenizer can take: lone surrogates (from JSON escapes like
    "\\ud800") and NUL characters."""
    bad = _BAD_CHARS.search(value)
    if bad is not None:
        ch, i = bad.group(), bad.start()
        if ch == "\x00":
            raise ValueError(f"contains a NUL character (U+0000) at character {i}, which "
                             "this server does not accept")
        raise ValueError(f"contains a lone surrogate (U+{ord(ch):04X}) at character {i}: "
                         "text must be valid Unicode")
    return value


def _valid_texts(value: Any) -> Any:
    """Check every string in a value (a string, or lists of strings and token ids)."""
    if isinstance(value, str):
        _valid_text(value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                _valid_text(item)
    return value


Text = Annotated[str, AfterValidator(_valid_text)]
# Ranges SamplingParams does not check itself (it checks n, top_k, seed, logprobs, ...
# with messages that name the allowed range); token ids are checked against the vocabulary.
Priority = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(_valid_texts)] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Priority = 0

    def _sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            n=self.n, stop=self.stop, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or (),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]],
                      AfterValidator(_valid_texts)]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs, **self._sampling_kwargs())


def _valid_content(content: str | list[dict[str, Any]] | None
                   ) -> str | list[dict[str, Any]] | None:
    """A string, or content parts of type "text" only, each with a string."""
    if content is None or isinstance(content, str):
        return content if content is None else _valid_text(content)
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"content part {i} has type {kind!r}: this model reads text only "
                             "(parts of type 'text')")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {i}: 'text' must be a string, got "
                             f"{type(text).__name__ if text is not None else 'null'}")
        _valid_text(text)
    return content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Text
    content: Annotated[str | list[dict[str, Any]] | None, AfterValidator(_valid_content)] = None
    name: Text | None = None

    def text(self) -> str:
        """The message's text: a string, its text parts joined, or empty."""
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template sees: role and text of each message."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None  # vLLM's extra

    def sampling_params(self) -> SamplingParams:
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=self.prompt_logprobs, **self._sampling_kwargs())


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


