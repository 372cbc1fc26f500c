"""Chat messages as OpenAI's API takes them (text content parts, an assistant's tool calls,
a tool's answer) and the tools a request offers; ``message_dicts`` is what the chat
template sees of them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, model_validator

from llmserve.server.fields import Strict, Text, valid_text


def _valid_content(content: str | list[dict[str, Any]] | None
                   ) -> str | list[dict[str, Any]] | None:
    """A string, or content parts of type "text" (or an assistant's "refusal": OpenAI's
    assistant messages may carry one), each with a string."""
    if content is None or isinstance(content, str):
        return content if content is None else valid_text(content)
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise ValueError(f"content part {i} has type {kind!r}: this model accepts text "
                             "only (parts of type 'text', and an assistant's 'refusal')")
        text = part.get(kind)
        if not isinstance(text, str):
            raise ValueError(f"content part {i}: {kind!r} must be a string, got "
                             f"{type(text).__name__ if text is not None else 'null'}")
        valid_text(text)
    return content


_TEXT_PARTS = ("text", "refusal")  # a part's type, and the key of its text


class FunctionCall(Strict):
    name: Text
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(Strict):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(Strict):
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


class FunctionDefinition(Strict):
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


class Tool(Strict):
    type: str = "function"
    function: FunctionDefinition

    @model_validator(mode="after")
    def _check_type(self) -> Tool:
        if self.type != "function":
            raise ValueError(f"tool type {self.type!r} is not supported (allowed: 'function')")
        return self
