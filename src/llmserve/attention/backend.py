"""The attention-backend interface between models and the paged KV cache.

A model never sees the KV cache. Its ``Attention`` layers hand ``q``, ``k`` and ``v`` of the
step's flattened tokens to the backend in the ``AttentionContext`` the runner passes down;
the backend writes the new keys and values into the cache and attends over each sequence's
context. Backends are chosen by name from a small registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from llmserve.attention.kv_format import PagedKVCache
from llmserve.logger import get_logger

logger = get_logger(__name__)


@dataclass
class BatchLayout:
    """What the runner knows about the step's flattened batch; plain tensors and ints.

    Token ``t`` of the batch belongs to sequence ``b`` with ``query_start_loc[b] <= t <
    query_start_loc[b + 1]``.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset)
    block_tables: torch.Tensor  # [B, max_blocks] int64: physical block ids, padded with 0
    positions: torch.Tensor  # [T] int64: absolute position of each token
    query_lens: list[int]  # [B] tokens computed this step, per sequence
    seq_lens: list[int]  # [B] context length after this step, per sequence
    block_size: int


class Rope(NamedTuple):
    """The rotary a backend applies to ``q`` and ``k`` before it stores the keys: the
    layer's ``RotaryEmbedding`` (``rotary(positions, q, k) -> (q, k)``) and the step's
    positions. A backend with a kernel that rotates and stores in one pass uses it there
    (``rotary.kernel_tables()``); every other backend calls ``apply`` first."""

    rotary: Any  # layers.rotary.RotaryEmbedding (imported by the models, not here)
    positions: torch.Tensor  # [T] int64

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(self.positions, q, k)


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, layout: BatchLayout) -> Any:
        """Derive once per step whatever the per-layer ``forward`` needs."""
        ...

    def allocate_kv_cache(self, name: str, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int, device: torch.device) -> Any:
        """One layer's paged cache in the layout this backend reads (``name``: a KV cache
        dtype, see ``kv_format``)."""
        ...

    def rebind(self, metadata: Any, layout: BatchLayout) -> Any:
        """``metadata`` of the same step for another KV cache group: ``layout`` differs
        only in its block tables and slot mapping."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: PagedKVCache, metadata: Any, scale: float,
                window: int | None = None, rope: Rope | None = None) -> torch.Tensor:
        """``q``: [T, Hq, D]; ``k``, ``v``: [T, Hkv, D]; returns [T, Hq * D]. With ``rope``,
        ``q`` and ``k`` are rotated first (``rope.apply``, or in the backend's store kernel:
        the same arithmetic).

        ``kv_cache`` is the layer's paged cache (see ``kv_format`` for its layout and
        storage formats). ``window``: a sliding-window layer's span: a query at position p
        sees keys p - window + 1..p only (None: every key up to p).
        """
        ...


@dataclass
class AttentionContext:
    """What a model's forward pass carries down to its attention layers for one step."""

    backend: AttentionBackend
    metadata: list[Any]  # one per layer: its KV cache group's
    # One per layer, in the backend's layout (layers of different groups share one).
    kv_caches: list[Any]


_BACKENDS: dict[str, type] = {}


def register_attention_backend(name: str):
    def wrap(cls: type) -> type:
        _BACKENDS[name] = cls
        cls.name = name
        return cls

    return wrap


def get_attention_backend(name: str, device: torch.device | str = "cpu",
                          block_size: int = 16) -> AttentionBackend:
    """``auto``: on CPU the compiled kernel when it is available and ``block_size`` a
    multiple of 16 (its vector width); on CUDA the Triton kernels when Triton is installed;
    else ``torch_paged``."""
    _register_builtin()
    if name == "auto":
        name = _auto_backend(torch.device(device), block_size)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def list_attention_backends() -> list[str]:
    _register_builtin()
    return ["auto", *sorted(_BACKENDS)]


def _auto_backend(device: torch.device, block_size: int) -> str:
    if device.type == "cuda":
        import importlib.util

        return "triton_paged" if importlib.util.find_spec("triton") else "torch_paged"
    from llmserve.csrc import cpu_ops

    if cpu_ops() is None:
        return "torch_paged"
    if block_size % 16:
        logger.warning("KV blocks of %d tokens: the compiled CPU attention kernel reads "
                       "blocks of a multiple of 16 tokens, so attention runs on the PyTorch "
                       "fallback (torch_paged), which is slower; the CPU's default is "
                       "32 (--block-size)", block_size)
        return "torch_paged"
    return "cpu_paged"


def _register_builtin() -> None:
    import llmserve.attention.cpu_paged
    import llmserve.attention.torch_paged
    import llmserve.attention.triton_paged  # noqa: F401
