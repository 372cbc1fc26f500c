"""OpenAI-compatible request schemas (plus vLLM's sampling extras) and their translation
into SamplingParams. Unknown fields are ignored, as OpenAI's API does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
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
    priority: int = 0

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
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs, **self._sampling_kwargs())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


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

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              **self._sampling_kwargs())

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            out.append({"role": m.role, "content": content or ""})
        return out


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


