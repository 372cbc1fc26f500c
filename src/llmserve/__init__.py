"""llmserve: an LLM inference server in Python on PyTorch."""

from llmserve import envs as _envs  # noqa: F401  (must run before torch is imported)
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``llmserve.LLM`` loads the engine (and torch) on first use only, so that the
    scheduler, the KV cache manager and the API server's messages import without torch."""
    if name == "LLM":
        from llmserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
