"""Exceptions that carry a message meant for the user, one line, no traceback needed."""


class LLMServeError(Exception):
    """Base class for errors llmserve reports to users."""


class ModelLoadError(LLMServeError, ValueError):
    """The model path, file or configuration cannot be used. The message names the file.
    A ValueError too: what the Python API raises for a bad argument."""
