"""Logits at every position of one token sequence (reference checks, perplexity).

Runs the model through the same attention backend as serving, with a private KV cache
just large enough for the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention import AttentionContext, get_attention_backend
from llmserve.attention.backend import BatchLayout
from llmserve.config import default_block_size


@torch.inference_mode()
def sequence_logits(model: nn.Module, token_ids: list[int], *, block_size: int | None = None,
                    backend: str = "auto", kv_cache_dtype: str = "float32"
                    ) -> torch.Tensor:
    """Returns float32 logits ``[len(token_ids), vocab]`` (row i predicts token i + 1), with
    KV blocks of ``block_size`` tokens (default: the device's, as the server uses)."""
    cfg = model.config
    device = next(model.parameters()).device
    block_size = block_size or default_block_size(device.type)
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    attn = get_attention_backend(backend, device, block_size)
    kv_caches = [attn.allocate_kv_cache(kv_cache_dtype, num_blocks, block_size,
                                        cfg.num_key_value_heads, cfg.head_dim, device)
                 for _ in range(cfg.num_hidden_layers)]
    positions = torch.arange(n, device=device)
    layout = BatchLayout(slot_mapping=positions.clone(),
                         block_tables=torch.arange(num_blocks, device=device).view(1, -1),
                         positions=positions, query_lens=[n], seq_lens=[n],
                         block_size=block_size)
    ctx = AttentionContext(attn, [attn.build_metadata(layout)] * len(kv_caches), kv_caches)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    return model.compute_logits(model(ids, positions, ctx)).float()


def perplexity(model: nn.Module, token_ids: list[int], *, window: int = 1024,
               kv_cache_dtype: str = "float32", block_size: int | None = None) -> float:
    """exp(mean negative log-likelihood) of ``token_ids``, scored in consecutive windows of
    ``window`` tokens (each window starts a fresh context; its first token is not scored)."""
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window]
        if len(chunk) < 2:
            break
        logprobs = sequence_logits(model, chunk, kv_cache_dtype=kv_cache_dtype,
                                   block_size=block_size)[:-1]
        logprobs = logprobs.log_softmax(dim=-1)
        targets = torch.tensor(chunk[1:], device=logprobs.device)
        nll -= logprobs.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(chunk) - 1
    return float(torch.tensor(nll / count).exp())
