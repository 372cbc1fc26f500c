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
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from llmserve.structured_output import validate_structured

INT32_MAX = 2**31 - 1


_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A request's value refused with the (dotted) parameter it is in, for the 400's
    ``param``: raised where pydantic's own location would be the whole body."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _no_lone_surrogates(body: Any) -> Any:
    """Refuse a lone surrogate (a JSON escape like "\\ud800" without its pair) anywhere in
    a request body, in a key or a string at any depth: no tokenizer, chat template, grammar
    or message to the engine can encode one. Checked once, on the raw body, so that every
    field (a schema's property names, a tool's description, a call's arguments) is covered,
    not only the fields of type text. Cheap on what bodies are mostly made of: ASCII text is
    passed at C speed, lists of numbers (token ids) without a look at each."""
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:  # a loop, not recursion: bodies may nest deeper than Python's stack
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and (bad := _SURROGATE.search(value)) is not None:
                raise FieldError(_dotted(path), _surrogate_message(bad, "contains"))
        elif isinstance(value, dict):
            for key, item in value.items():
                if (isinstance(key, str) and not key.isascii()
                        and (bad := _SURROGATE.search(key)) is not None):
                    where = f" in {_dotted(path)}" if path else ""
                    raise FieldError(_dotted(path), _surrogate_message(bad, f"a key{where} has"))
                if isinstance(item, _NESTED):
                    stack.append(((*path, key), item))
        elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:
            stack.extend(((*path, i), item) for i, item in enumerate(value)
                         if isinstance(item, _NESTED))
    return body


_NESTED = (str, dict, list)
_SCALARS = {int, float, bool, type(None)}


def _dotted(path: tuple) -> str | None:
    return ".".join(map(str, path)) or None


def _surrogate_message(bad: re.Match, subject: str) -> str:
    return (f"{subject} a lone surrogate (U+{ord(bad.group()):04X}) at character "
            f"{bad.start()}: text must be valid Unicode")


def _valid_text(value: str) -> str:
    """Refuse a NUL character in text a tokenizer takes (lone surrogates are refused in the
    whole body before the fields are read: ``_no_lone_surrogates``)."""
    i = value.find("\x00")
    if i >= 0:
        raise ValueError(f"contains a NUL character (U+0000) at character {i}, which this "
                         "server does not accept")
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no effect: nothing pads the stream here


class ResponseFormat(_Strict):
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


class StructuredOutputs(_Strict):
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


class _SamplingFields(_Strict):
    _valid_unicode = model_validator(mode="before")(_no_lone_surrogates)

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
                      AfterValidator(_valid_texts)]
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


def _valid_content(content: str | list[dict[str, Any]] | None
                   ) -> str | list[dict[str, Any]] | None:
    """A string, or content parts of type "text" (or an assistant's "refusal": OpenAI's
    assistant messages may carry one), each with a string."""
    if content is None or isinstance(content, str):
        return content if content is None else _valid_text(content)
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise ValueError(f"content part {i} has type {kind!r}: this model accepts text "
                             "only (parts of type 'text', and an assistant's 'refusal')")
        text = part.get(kind)
        if not isinstance(text, str):
            raise ValueError(f"content part {i}: {kind!r} must be a string, got "
                             f"{type(text).__name__ if text is not None else 'null'}")
        _valid_text(text)
    return content


_TEXT_PARTS = ("text", "refusal")  # a part's type, and the key of its text


class FunctionCall(_Strict):
    name: Text
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(_Strict):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Text
    content: Annotated[str | list[dict[str, Any]] | None, AfterValidator(_valid_content)] = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    function_call: FunctionCall | None = None  # legacy: an assistant's one call
    refusal: str | None = None  # no effect: an assistant's earlier refusal text

    @model_validator(mode="after")
    def _check_role(self) -> ChatMessage:
        if self.role == "assistant":
            return self
        if self.content is None or self.content == []:
            got = "null" if self.content is None else "an empty list"
            raise ValueError(f"content: a {self.role!r} message needs content (a string or a "
                             f"list of text parts), got {got}")
        if self.tool_calls is not None or self.function_call is not None:
            raise ValueError(f"tool_calls: only an assistant message has them, not a "
                             f"{self.role!r} one")
        if any(isinstance(p, dict) and p.get("type") == "refusal" for p in self.content):
            raise ValueError(f"content: a 'refusal' part is an assistant's, not a "
                             f"{self.role!r} message's")
        return self

    def text(self) -> str:
        """The message's text: a string, its parts' texts joined by newlines (as vLLM joins
        them), or empty."""
        if isinstance(self.content, list):
            return "\n".join(p[p["type"]] for p in self.content)
        return self.content or ""


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template sees: role and text of each message, an assistant's tool
    calls (legacy function_call included) and a tool answer's call id."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "tool" if m.role == "function" else m.role,
                             "content": m.text()}
        calls = list(m.tool_calls or [])
        if m.function_call is not None:
            calls.append(ToolCallItem(function=m.function_call))
        if calls:
            d["tool_calls"] = [c.model_dump(exclude_none=True) for c in calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced either way when the grammar applies

    @model_validator(mode="after")
    def _check_name(self) -> FunctionDefinition:
        if not _FUNCTION_NAME.match(self.name):
            raise ValueError(f"function name {self.name!r} must be 1-64 letters, digits, "
                             "underscores or dashes")
        return self


class Tool(_Strict):
    type: str = "function"
    function: FunctionDefinition

    @model_validator(mode="after")
    def _check_type(self) -> Tool:
        if self.type != "function":
            raise ValueError(f"tool type {self.type!r} is not supported (allowed: 'function')")
        return self


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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: what chat would refuse (a template of the client's own...) is
    refused here too, not ignored, so that the count is always the one chat bills."""

    _valid_unicode = model_validator(mode="before")(_no_lone_surrogates)

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # With messages: the tools a chat request would send, rendered into the prompt as chat
    # completions render them (the count is then what chat bills).
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: each token's text too


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


