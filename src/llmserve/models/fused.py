"""The decoder stack of a Llama-shaped model as one call into the compiled kernels.

``LlamaModel`` runs its layers through ``FusedDecoder`` when every piece has a compiled
kernel: the CPU kernels are built, every projection's weight format runs one
(``LinearMethod.fused_kernel``), attention goes through the ``cpu_paged`` backend and all
layers share one KV cache group. ``csrc/decoder_layer.cpp`` then calls the same kernels as
the modules, in the same order on the same tensors, so the output is bitwise the modules'
output; what it saves is the Python between them (about ten module and extension calls a
layer). Anything else (another backend or device, the PyTorch fallbacks, Gemma's layers,
``LLMSERVE_FUSED_LAYERS=0``) keeps the module path, which stays the reference.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from llmserve import envs
from llmserve.attention import AttentionContext
from llmserve.attention.cpu_paged import CpuPagedBackend
from llmserve.csrc import cpu_ops

if TYPE_CHECKING:
    from llmserve.layers.linear import Linear
    from llmserve.models.llama import LlamaDecoderLayer


class FusedDecoder:
    """Builds (once) and runs the compiled stack for a model's layers."""

    def __init__(self, layers: list[LlamaDecoderLayer]) -> None:
        self.enabled = envs.LLMSERVE_FUSED_LAYERS
        self._team = envs.LLMSERVE_STACK_TEAM  # one OpenMP region a step (csrc/team.h)
        self._layers = layers
        self._plans: list[Any] | None = None  # built on first use: weights are packed by then
        # A stack per runner (a model may serve two: as its own draft), keyed by the id of
        # the first cache of its list, with weak references to all of them; the entry (and
        # with it the stack, which holds the cache tensors) goes when that cache does.
        self._stacks: dict[int, tuple[list[weakref.ref], Any]] = {}
        self.last_step_fused = False  # for tests and benchmarks

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's output, residual stream), or None when this step cannot run fused
        (the caller then runs the modules)."""
        self.last_step_fused = False
        if not self.enabled or not isinstance(ctx.backend, CpuPagedBackend):
            return None
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        metadata = ctx.metadata[0]
        if any(m is not metadata for m in ctx.metadata):
            return None  # several KV cache groups: one table per group, not one per stack
        if metadata.positions is not positions:
            return None  # the kernels take one positions tensor for rotary and attention
        stack = self._stack_for(ctx.kv_caches)
        if stack is None:
            return None
        self.last_step_fused = True
        return stack.run(hidden, positions, metadata.slot_mapping, metadata.block_tables,
                         metadata.query_start)

    @property
    def team(self) -> bool:
        return self._team

    @team.setter
    def team(self, on: bool) -> None:
        """One OpenMP region for the whole stack (True), or one a kernel (for A/B runs)."""
        self._team = on
        for _, stack in self._stacks.values():
            stack.team = on

    def _stack_for(self, caches: list) -> Any:
        entry = self._stacks.get(id(caches[0])) if caches else None
        if entry is not None:
            held, stack = entry
            if len(held) == len(caches) and all(r() is c for r, c in zip(held, caches)):
                return stack
        if self._plans is None:
            self._plans = _layer_plans(self._layers) or []
        if not self._plans:
            self.enabled = False
            return None
        max_codes = {c.max_code for c in caches}
        if len(max_codes) != 1:
            self.enabled = False
            return None
        stack = cpu_ops().make_decoder_stack(
            self._plans, [c.key for c in caches], [c.value for c in caches],
            [c.key_scale for c in caches], [c.value_scale for c in caches],
            float(max_codes.pop() or 0.0))
        stack.team = self._team
        key = id(caches[0])
        self._stacks[key] = ([weakref.ref(c) for c in caches], stack)
        weakref.finalize(caches[0], self._stacks.pop, key, None)
        return stack



def _linear_plan(ops: Any, layer: Linear) -> Any:
    kernel = layer.quant_method.fused_kernel(layer)
    if kernel is None:
        return None
    return ops.make_linear_plan(*kernel, layer.bias)


def _is_llama_layer(layer: Any) -> bool:
    """The modules the C++ layer reproduces, with no family's own forward in between."""
    from llmserve.attention import Attention
    from llmserve.layers.norm import RMSNorm
    from llmserve.layers.rotary import RotaryEmbedding
    from llmserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    attn = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    return (type(layer).forward is LlamaDecoderLayer.forward
            and type(attn).forward is LlamaAttention.forward
            and type(layer.mlp).forward is LlamaMLP.forward
            and type(attn.rotary) is RotaryEmbedding and type(attn.attn) is Attention
            and all(n is None or type(n) is RMSNorm for n in norms))


def _layer_plans(layers: list[LlamaDecoderLayer]) -> list[Any] | None:
    """Every layer's plan, or None if any piece lacks a compiled kernel or is not the
    Llama module the C++ layer reproduces."""
    ops = cpu_ops()
    if ops is None or not layers:
        return None
    plans = []
    for layer in layers:
        if not _is_llama_layer(layer):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_linear_plan(ops, m) for m in
                   (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in linears):
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if len({n.eps for n in norms}) != 1 or attn.rotary.cos.device.type != "cpu":
            return None
        plans.append(ops.make_layer_plan(
            *linears, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight,
            layer.input_layernorm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            attn.rotary.cos, attn.rotary.sin, attn.attn.scale, attn.attn.sliding_window or 0))
    return plans
