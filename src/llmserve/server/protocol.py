"""OpenAI-compatible request schemas (plus vLLM's sampling extras) and their translation
into SamplingParams.

Nothing is silently ignored: every field is implemented, or accepted and documented as
having no effect here (``NO_EFFECT``), or refused with a 400 that names it; an unknown
field is refused the way OpenAI's API refuses it ("Unrecognized request argument
supplied: max_token"). README.md has the table.

Everything a client sends is checked here, at the edge, so that nothing can raise deeper
in: integers within the ranges the engine and its messages carry (64-bit at most), text
that is valid Unicode without NUL characters, and chat content parts of type "text" only.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from llmserve.server.chat_messages import ChatMessage, FunctionDefinition, Tool, message_dicts
from llmserve.server.fields import (
    FieldError,
    Priority,
    Strict,
    Text,
    no_lone_surrogates,
    valid_texts,
)
from llmserve.structured_output import validate_structured

__all__ = [
    "NO_EFFECT",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "FieldError",
    "TokenizeRequest",
    "message_dicts",
]


# Accepted and without effect here, and why (README's table says the same).
NO_EFFECT = {
    "user": "an end-user id for the provider's abuse monitoring; nothing is stored",
    "safety_identifier": "the same as user",
    "store": "this server stores no completions",
    "metadata": "tags for stored completions; nothing is stored",
    "service_tier": "one tier of service here",
    "prompt_cache_key": "prefix caching is automatic and shared by all requests",
    "prediction": "a latency hint (predicted output); the output is the same without it",
    "guided_decoding_backend": "llguidance is the one grammar engine",
}


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no effect: nothing pads the stream here


class ResponseFormat(Strict):
    type: str
    json_schema: dict[str, Any] | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            spec = self.json_schema
            if spec is None:
                raise ValueError("response_format.json_schema is required with type "
                                 "'json_schema' ({\"name\": ..., \"schema\": {...}})")
            unknown = set(spec) - {"name", "schema", "strict", "description"}
            if unknown:
                raise ValueError(f"response_format.json_schema: unrecognized field "
                                 f"{sorted(unknown)[0]!r} (allowed: name, schema, strict, "
                                 "description)")
            schema = spec.get("schema")
            if schema is None:
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=schema)
        raise ValueError(f"response_format.type {self.type!r} is not supported (allowed: "
                         "'text', 'json_object', 'json_schema')")


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex,
                                       choice=tuple(self.choice) if self.choice else None,
                                       grammar=self.grammar,
                                       json_object=bool(self.json_object))


class _SamplingFields(Strict):
    _valid_unicode = model_validator(mode="before")(no_lone_surrogates)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(valid_texts)] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # accepted, no effect (NO_EFFECT says why)
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
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
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _check_guided(self) -> _SamplingFields:
        if self.guided_decoding_backend not in (None, "auto", "llguidance", "guidance"):
            raise ValueError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not "
                             "available: this server decodes with llguidance "
                             "(allowed: 'auto', 'llguidance')")
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported: JSON is generated "
                             "compact, with ', ' and ': ' as separators")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint asked for, from whichever of response_format,
        structured_outputs or the guided_* fields carries it (at most one may)."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        if self.response_format is not None:
            c = self.response_format.constraint()
            if c is not None:
                found.append(("response_format", c))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.constraint()))
        guided: dict[str, StructuredOutputsParams] = {}
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                if kind == "choice":
                    value = tuple(value)
                guided[name] = StructuredOutputsParams(**{kind: value})
        found.extend(guided.items())
        if len(found) > 1:
            raise ValueError(f"{found[0][0]} and {found[1][0]} both constrain the output: "
                             "send one")
        if not found:
            return None
        source, constraint = found[0]
        if source == "response_format" and constraint.json is not None:
            source = "response_format.json_schema.schema"
        elif source == "structured_outputs":
            source = f"structured_outputs.{constraint.kinds()[0]}"
        validate_structured(constraint, source)  # a 400 naming the field and the keyword
        return constraint

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
                      AfterValidator(valid_texts)]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs,
                              structured_outputs=self.constraint(), **self._sampling_kwargs())


# Refused by name: they would change the answer and this server cannot honour them.
_UNSUPPORTED_CHAT = {
    "audio": "this model produces text only",
    "reasoning_effort": "this model does not reason before answering",
    "verbosity": "this model has no verbosity setting",
    "web_search_options": "this server has no web search",
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None  # legacy tools
    function_call: str | dict[str, Any] | None = None  # legacy tool_choice
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None  # no effect (NO_EFFECT says why)
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    prompt_logprobs: int | None = None  # vLLM's extra

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        for name, why in _UNSUPPORTED_CHAT.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported: {why}")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError(f"modalities {self.modalities} is not supported: this model "
                             "produces text only (allowed: [\"text\"])")
        if self.functions is not None and self.tools is not None:
            raise ValueError("send tools or the legacy functions, not both")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        return self

    @property
    def legacy_functions(self) -> bool:
        return self.functions is not None

    def tool_setup(self) -> tuple[list[dict[str, Any]], str | None]:
        """(tools as OpenAI dicts, mode): mode None (no tools or tool_choice "none"),
        "auto", "required", or the name of the function that must be called."""
        if self.functions is not None:
            tools = [{"type": "function", "function": f.model_dump(exclude_none=True)}
                     for f in self.functions]
            choice: Any = self.function_call
            if isinstance(choice, dict):
                choice = {"type": "function", "function": choice}
            param = "function_call"
        else:
            tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
            choice, param = self.tool_choice, "tool_choice"
        names = [t["function"]["name"] for t in tools]
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return tools, None
        if choice in ("auto", "required"):
            if not tools:
                raise ValueError(f"{param} {choice!r} needs tools")
            return tools, choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
                choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
            name = choice["function"]["name"]
            if name not in names:
                raise ValueError(f"{param} names the function {name!r}, which is not among "
                                 f"the tools ({', '.join(names) or 'none given'})")
            return tools, name
        raise ValueError(f"{param} must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                         f"{json.dumps(choice)[:100]}")

    def sampling_params(self, constraint: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=constraint,
                              prompt_logprobs=self.prompt_logprobs, **self._sampling_kwargs())


class TokenizeRequest(Strict):
    """vLLM's /tokenize: what chat would refuse (a template of the client's own...) is
    refused here too, not ignored, so that the count is always the one chat bills."""

    _valid_unicode = model_validator(mode="before")(no_lone_surrogates)

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # With messages: the tools a chat request would send, rendered into the prompt as chat
    # completions render them (the count is then what chat bills).
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: each token's text too


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


