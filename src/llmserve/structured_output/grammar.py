"""A request's structured-output constraint as an llguidance grammar, checked up front.

llguidance (guidance-ai) is the grammar engine: a Rust library with CPU wheels and no
dependencies that compiles JSON schemas, regular expressions and context-free grammars
(Lark, or llama.cpp's GBNF) into a matcher computing the set of allowed tokens in about a
hundred microseconds per step. The alternatives measured against it: xgrammar pulls in
its own torch and build chain; outlines-core has no context-free grammars.

JSON is generated compact with the separators people write (", " and ": ") and no other
whitespace: a small model left free to add whitespace can fill max_tokens with newlines.
"""

from __future__ import annotations

import functools
import json

from llguidance import LLMatcher, grammar_from

from llmserve.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot enforce; the message names what is wrong."""


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of a constraint; not yet validated."""
    if params.json is not None:  # as text: llguidance reads numbers of any size from it
        schema = _schema(params.json)
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except ValueError:  # Python's JSON reads them; llguidance's does not
            raise GrammarError("NaN and Infinity are not JSON numbers") from None
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    if params.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
    assert params.grammar is not None
    try:
        return grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(str(e)) from None


def validate_structured(params: StructuredOutputsParams, source: str | None = None) -> None:
    """Raise GrammarError naming the field (``source``, by default
    structured_outputs.<kind>) and the keyword or the place in the grammar the engine
    cannot take. Each distinct constraint is compiled and checked once per process: the
    server checks it at the edge, the engine's request checks find the answer cached."""
    problem = _problem(params)
    if problem:
        raise GrammarError(f"{source or 'structured_outputs.' + params.kinds()[0]}: {problem}")


@functools.lru_cache(maxsize=256)
def _problem(params: StructuredOutputsParams) -> str | None:
    """What keeps a constraint from being enforced, or None."""
    try:
        grammar = compile_grammar(params)
    except GrammarError as e:
        return str(e)
    error = LLMatcher.validate_grammar(grammar)
    if not error:
        return None
    what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
            "choice": "choice", "grammar": "grammar"}[params.kinds()[0]]
    return f"the {what} cannot be enforced: {error.strip()}"


def _schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"must be a JSON schema (an object), got {type(schema).__name__}")
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return schema
