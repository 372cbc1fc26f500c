"""llmserve: an LLM inference server in Python on PyTorch."""

from llmserve import envs as _envs  # noqa: F401  (must run before torch is imported)
from llmserve.engine.llm import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
