"""Tool calling: tools into the prompt, tool calls out of the text, and the grammar that
makes a required or named call always parse.

A chat template that knows tools (it reads the ``tools`` variable) renders them itself, and
assistant ``tool_calls`` and ``tool`` messages go to it as they are. For a template that
does not (SmolLM2's plain ChatML), llmserve uses the Hermes format, the most common one
among open models (NousResearch Hermes, Qwen 2.5): the tools as JSON inside ``<tools>`` in
the system message, each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
and each result as ``<tool_response>...</tool_response>``. The model's output is parsed in
that same format either way.

``tool_choice``: "none" leaves the tools out of the prompt and parses nothing; "auto" lets
the model answer or call; "required" and a named function constrain the output with a
grammar (one call, or several when ``parallel_tool_calls``), so the JSON always parses and
its arguments match the function's parameters.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from llmserve.structured_output.grammar import JSON_OPTIONS

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{secrets.token_hex(12)}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def prompt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables that render ``messages`` with ``tools``
    (the OpenAI ``tools`` list, or None when the prompt carries none)."""
    if template_knows_tools(template):
        return messages, ({"tools": tools} if tools else {})
    out = [_hermes_message(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def _hermes_message(m: dict[str, Any]) -> dict[str, Any]:
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        text = "\n".join(
            f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"])},
                                          ensure_ascii=False) + f"\n{CALL_CLOSE}"
            for c in calls)
        content = m.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{text}" if content else text}
    if m["role"] == "tool":
        return {"role": "tool",
                "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    return {"role": m["role"], "content": m.get("content") or ""}


def _arguments(function: dict[str, Any]) -> Any:
    """A call's arguments as an object where they parse (templates and the Hermes format
    show them as JSON objects), else as the text the client sent."""
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
            # an escaped lone surrogate parses, then cannot be written out as text
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        except (ValueError, RecursionError):  # not JSON, past Python's limits, surrogates
            return args
        return parsed
    return args if args is not None else {}


def tool_call_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance dialect) for one or more Hermes calls of ``tools`` (or of
    the function named ``only``), arguments per the function's parameters schema."""
    alternatives = [
        {"type": "object",
         "properties": {"name": {"const": t["function"]["name"]},
                        "arguments": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools if only is None or t["function"]["name"] == only]
    schema = {"anyOf": alternatives, "x-guidance": JSON_OPTIONS}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output: each call of a known function whose JSON
    parses, and the text outside them (None if there is none; the whole text if there is
    no call). A call that does not parse stays in the content, as the model wrote it. The
    same split as a stream of the text in any pieces (``ToolCallStream``)."""
    stream = ToolCallStream(names)
    content, calls = stream.feed(text, final=True)
    return (content or None) if calls else text, calls


def _parse_one(body: str, names: set[str]) -> ToolCall | None:
    """The call in a ``<tool_call>`` body: an object with a known function's ``name`` and
    its ``arguments`` (or ``parameters``) as an object or as a string of one; anything else
    is no call (as vLLM's Hermes parser has it: a call without arguments is text)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or past Python's limits (depth, digits)
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):
            return None
        return ToolCall(obj["name"], args) if isinstance(parsed, dict) else None
    if not isinstance(args, dict):
        return None
    text = json.dumps(args, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # the model escaped a lone surrogate: keep it escaped
        text = json.dumps(args)
    return ToolCall(obj["name"], text)


class ToolCallStream:
    """Splits one choice's streamed text into content deltas and finished tool calls.

    Text is passed on as it comes, except what might be the start of ``<tool_call>`` (held
    until it is clearly not) and everything from a ``<tool_call>`` to its end tag, which
    comes out as one tool call (name and arguments together: OpenAI's clients join the
    argument fragments, and one fragment is a valid stream).

    Whitespace around calls is content only between texts: a run of whitespace is held
    until text follows it (then it goes out) or a call does; the whitespace around calls
    goes out when text follows them and text went out before them, and is dropped at the
    start and the end of the output. The result depends on the text alone, not on how it
    was cut: ``parse_tool_calls`` is this stream fed the whole text at once.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.buffer = ""
        self.calls: list[ToolCall] = []
        self._held = ""  # whitespace that went out only if text follows it
        self._gap = ""  # the whitespace around the calls since the last text
        self._after_call = False  # since the last call: no text yet
        self._sent_text = False  # some text went out

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Content to send now and calls completed by ``text``; ``final`` flushes."""
        self.buffer += text
        content, calls = [], []
        while self.buffer:
            start = self.buffer.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag(self.buffer)
                content.append(self._text(self.buffer[:len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content.append(self._text(self.buffer[:start]))
            end = self.buffer.find(CALL_CLOSE, start)
            if end < 0 and not final:
                self.buffer = self.buffer[start:]
                break
            stop = len(self.buffer) if end < 0 else end + len(CALL_CLOSE)
            call = _parse_one(self.buffer[start + len(CALL_OPEN):
                                          end if end >= 0 else stop].strip(), self.names)
            if call is None:
                content.append(self._text(self.buffer[start:stop]))
            else:
                calls.append(call)
                self.calls.append(call)
                self._gap += self._held
                self._held, self._after_call = "", True
            self.buffer = self.buffer[stop:]
        if final and not self.calls:
            content.append(self._held)
            self._held = ""
        return "".join(content), calls

    def _text(self, text: str) -> str:
        """What of ``text`` (outside the calls) goes out now."""
        if self._after_call:
            stripped = text.lstrip()
            self._gap += text[:len(text) - len(stripped)]
            if not stripped:
                return ""
            # text again: between two texts the calls' whitespace separates them
            text = (self._gap if self._sent_text else "") + stripped
            self._gap, self._after_call = "", False
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out, self._held = self._held + body, text[len(body):]
        self._sent_text = True
        return out


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
