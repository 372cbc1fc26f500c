"""Batched sampling: tensors built once per step from the requests' parameters.

Every request draws from its own ``torch.Generator`` (seeded from the request's seed, or
from the engine's seed sequence when it has none), so a seeded request produces the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from llmserve.sample import ops
from llmserve.sampling_params import SamplingParams


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """``logits``: [N, V] float32. Returns one token id per row."""
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=1).tolist()
        device = logits.device
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                   dtype=torch.float32, device=device)
        logits = ops.apply_temperature(logits, temperature)
        if any(p.top_k > 0 for p in params):
            k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
            logits = ops.apply_top_k(logits, k)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            logits = ops.apply_top_p(logits, top_p)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            logits = ops.apply_min_p(logits, min_p)
        probs = logits.softmax(dim=1)
        tokens = []
        for row, (is_greedy, gen) in enumerate(zip(greedy, generators)):
            if is_greedy:
                tokens.append(int(logits[row].argmax()))
            else:
                tokens.append(sample_row(probs[row], gen))
        return tokens


def sample_row(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs`` [V] via the exponential-race trick (argmax of p / E)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
