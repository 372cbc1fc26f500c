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
        self._layers = layers
        self._plans: list[Any] | None = None  # built on first use: weights are packed by then
        # Stacks bound to the runners' KV cache lists (and the caches they held then), newest
        # last: a model may serve two runners (as its own draft); older ones are dropped so
        # that no cache outlives them.
        self._stacks: list[tuple[list, list, Any]] = []
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

    def _stack_for(self, caches: list) -> Any:
        for bound, held, stack in self._stacks:
            if bound is caches and all(a is b for a, b in zip(held, caches, strict=True)):
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
        self._stacks = [*self._stacks[-1:], (caches, list(caches), stack)]
        return stack



def _linear_plan(ops: Any, layer: Linear) -> Any:
    kernel = layer.quant_method.fused_kernel(layer)
    if kernel is None:
        return None
    return ops.make_linear_plan(*kernel, layer.bias)


def _layer_plans(layers: list[LlamaDecoderLayer]) -> list[Any] | None:
    """Every layer's plan, or None if any piece lacks a compiled kernel."""
    ops = cpu_ops()
    if ops is None or not layers:
        return None
    plans = []
    for layer in layers:
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
