"""Chat templates rendered with sandboxed Jinja, as the model's own files define them."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages do not fit the template, or the template itself is broken."""


def render_chat_template(template: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``messages`` with the model's template; variables (bos_token, tools...) pass
    through to the template unchanged."""
    _check_messages(messages)
    try:
        return _compile(template).render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None


def check_chat_template(template: str) -> None:
    """Compile ``template``: a ChatTemplateError ("invalid chat template: ...") if it does
    not parse (the server checks its template at start, as vLLM does, rather than answer
    every chat request with an error about the template)."""
    _compile(template)


def read_chat_template(value: str) -> str:
    """The template ``--chat-template`` gives: Jinja text as it is (it holds ``{``), else
    the file of that path."""
    if "{" in value:
        return value
    from pathlib import Path

    try:
        return Path(value).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not a text file"
        raise ChatTemplateError(f"--chat-template {value!r}: cannot read it ({why}); give "
                                "a file holding a Jinja chat template, or the template "
                                "itself") from None


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from None


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"messages[{i}] must be an object with a 'role'")
        content = m.get("content")
        if content is None and m["role"] != "assistant" and "content" in m:
            raise ChatTemplateError(f"messages[{i}].content is null: only an assistant's "
                                    "message (one with tool_calls) may have none")
        if content is not None and not isinstance(content, str | list):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of "
                                    f"content parts, got {type(content).__name__}")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
