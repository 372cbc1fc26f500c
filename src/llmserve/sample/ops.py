"""Pure tensor functions over a batch of logits ``[N, V]`` (float32), one row a request.

Each takes per-row parameters as tensors; a row whose parameter disables the filter is left
unchanged. Filtered-out entries become -inf.
"""

from __future__ import annotations

import torch


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``temperature``: [N] float, > 0 (greedy rows carry 1.0)."""
    return logits / temperature.unsqueeze(1)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th are kept); ``k <= 0``
    keeps all."""
    vocab = logits.shape[1]
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    sorted_desc = logits.sort(dim=1, descending=True).values
    threshold = sorted_desc.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass
    reaches ``p`` (the most likely token is always kept); ``p == 1`` keeps all."""
    sorted_logits, order = logits.sort(dim=1, descending=True)
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))
