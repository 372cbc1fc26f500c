"""Logits at every position of one token sequence (reference checks, perplexity).

Runs the model through the same attention backend as serving, with a private KV cache
just large enough for the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention import AttentionContext, get_attention_backend
from llmserve.attention.backend import BatchLayout


@torch.inference_mode()
def sequence_logits(model: nn.Module, token_ids: list[int], *, block_size: int = 16,
                    backend: str = "torch_paged") -> torch.Tensor:
    """Returns float32 logits ``[len(token_ids), vocab]`` (row i predicts token i + 1)."""
    cfg = model.config
    device = next(model.parameters()).device
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv_caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
                 for _ in range(cfg.num_hidden_layers)]
    attn = get_attention_backend(backend)
    positions = torch.arange(n, device=device)
    layout = BatchLayout(slot_mapping=positions.clone(),
                         block_tables=torch.arange(num_blocks, device=device).view(1, -1),
                         positions=positions, query_lens=[n], seq_lens=[n],
                         block_size=block_size)
    ctx = AttentionContext(attn, attn.build_metadata(layout), kv_caches)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    return model.compute_logits(model(ids, positions, ctx))
