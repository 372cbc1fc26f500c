"""The checks every field of a request body goes through, shared by the request schemas
(``protocol``) and the chat messages (``chat_messages``): text that is valid Unicode without
NUL characters, integers within the ranges the engine and its messages carry, and no field
that a schema does not name.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1


_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A request's value refused with the (dotted) parameter it is in, for the 400's
    ``param``: raised where pydantic's own location would be the whole body."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def no_lone_surrogates(body: Any) -> Any:
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


def valid_text(value: str) -> str:
    """Refuse a NUL character in text a tokenizer takes (lone surrogates are refused in the
    whole body before the fields are read: ``no_lone_surrogates``)."""
    i = value.find("\x00")
    if i >= 0:
        raise ValueError(f"contains a NUL character (U+0000) at character {i}, which this "
                         "server does not accept")
    return value


def valid_texts(value: Any) -> Any:
    """Check every string in a value (a string, or lists of strings and token ids)."""
    if isinstance(value, str):
        valid_text(value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                valid_text(item)
    return value


Text = Annotated[str, AfterValidator(valid_text)]
# Ranges SamplingParams does not check itself (it checks n, top_k, seed, logprobs, ...
# with messages that name the allowed range); token ids are checked against the vocabulary.
Priority = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
