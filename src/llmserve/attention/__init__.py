from llmserve.attention.backend import (
    AttentionBackend,
    AttentionContext,
    Rope,
    get_attention_backend,
    list_attention_backends,
)
from llmserve.attention.layer import Attention

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionContext",
    "Rope",
    "get_attention_backend",
    "list_attention_backends",
]
