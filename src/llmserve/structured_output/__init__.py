"""Structured outputs: grammar-constrained decoding with llguidance.

``grammar.py`` turns a request's StructuredOutputsParams into an llguidance grammar and
checks it when the request is made; ``matcher.py`` keeps one matcher per running request in
the engine and computes the token masks of each step's rows.
"""

from llmserve.structured_output.grammar import GrammarError, compile_grammar, validate_structured
from llmserve.structured_output.matcher import GrammarBackend

__all__ = ["GrammarBackend", "GrammarError", "compile_grammar", "validate_structured"]
