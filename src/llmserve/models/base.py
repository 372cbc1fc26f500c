"""What every decoder-only model class shares: the logits from the final hidden states, and
loading Hugging Face-named tensors into fused, quantized layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from llmserve.layers.linear import Linear, finalize_weights
from llmserve.layers.quantization.base import WeightSource, as_float


class CausalLM(nn.Module):
    """A model class sets ``model`` (with ``embed_tokens``) and ``lm_head`` (None when tied)
    and names its fused projections in ``_stacked``."""

    # Hugging Face parameter names of the separate projections -> (fused module, shard).
    _stacked: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    model: nn.Module
    lm_head: nn.Module | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Returns the final hidden states ``[T, hidden]``; see ``compute_logits``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden``: [N, hidden] at the positions that sample; returns [N, vocab] float32,
        written into ``out`` when given (a CUDA graph's static output: the widening copy
        is the cast)."""
        head = self.model.embed_tokens.logits if self.lm_head is None else self.lm_head
        logits = head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Load Hugging Face-named tensors (each quantized as it arrives, by the layer it
        goes to); fails if any weight is left unset. Packs the layers at the end."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            module_path, _, param_name = name.rpartition(".")
            prefix, _, leaf = module_path.rpartition(".")
            shard = None
            if leaf in self._stacked:
                fused, shard = self._stacked[leaf]
                module_path = f"{prefix}.{fused}"
            module = modules.get(module_path)
            if module is None:
                raise ValueError(f"unexpected tensor {name!r}")
            if hasattr(module, "load_shard"):
                try:
                    module.load_shard(param_name, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"tensor {name!r}: {e}") from None
            else:
                param = getattr(module, param_name)
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: expected shape {tuple(param.shape)}, "
                                     f"got {tuple(tensor.shape)}")
                param.data.copy_(as_float(tensor))
            loaded.add(f"{module_path}.{param_name}" + (f":{shard}" if shard else ""))
        missing = self._expected_names() - loaded
        if missing:
            raise ValueError(f"missing tensors: {sorted(missing)[:5]}")
        finalize_weights(self)

    def _expected_names(self) -> set[str]:
        names: set[str] = set()
        for mod_name, module in self.named_modules():
            if isinstance(module, Linear):
                pnames = ["weight"] + ([] if module.bias is None else ["bias"])
                shards = module.shard_offsets or {None: None}
                names.update(f"{mod_name}.{p}" + (f":{s}" if s else "")
                             for p in pnames for s in shards)
                continue
            for pname, _ in module.named_parameters(recurse=False):
                names.add(f"{mod_name}.{pname}")
        return names
