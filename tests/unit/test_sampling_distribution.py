"""Sampled frequencies match the intended distribution (chi-square, fixed seed)."""

from __future__ import annotations

import math

import torch

from llmserve.runner.model_runner import token_seed
from llmserve.sample.sampler import Sampler, SamplingRow
from llmserve.sampling_params import SamplingParams

# Chi-square critical values at alpha = 0.001, by degrees of freedom.
CHI2_CRIT_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32,
                  8: 26.12, 9: 27.88}


def _intended(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Slow, obvious reference: softmax(l / T), keep the top_k, then the top_p nucleus."""
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    probs = [math.exp(x - m) for x in scaled]
    order = sorted(range(len(probs)), key=lambda j: -probs[j])
    keep = set(order[:top_k])
    z = sum(probs[j] for j in keep)
    nucleus, mass = set(), 0.0
    for j in order:
        if j not in keep:
            continue
        if mass >= top_p and nucleus:
            break
        nucleus.add(j)
        mass += probs[j] / z
    z = sum(probs[j] for j in nucleus)
    return [probs[j] / z if j in nucleus else 0.0 for j in range(len(probs))]


def test_sampled_frequencies_match_intended_distribution():
    logits = [2.0, 1.5, 1.0, 0.6, 0.2, -0.5, -1.0, -3.0]
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    expected = _intended(logits, 0.7, 6, 0.9)
    draws = 20000
    sampler = Sampler()
    batch = torch.tensor([logits] * 500)
    counts = [0] * len(logits)
    for r in range(draws // 500):  # every draw its own key, as every sampled token has
        rows = [SamplingRow(params, token_seed(1234, r * 500 + i), [], [], frozenset())
                for i in range(500)]
        for t in sampler(batch.clone(), rows).token_ids:
            counts[t] += 1
    support = [j for j, p in enumerate(expected) if p > 0]
    assert all(counts[j] == 0 for j in range(len(logits)) if expected[j] == 0), counts
    chi2 = sum((counts[j] - draws * expected[j]) ** 2 / (draws * expected[j]) for j in support)
    assert chi2 < CHI2_CRIT_0001[len(support) - 1], (chi2, counts, expected)


def test_greedy_rows_take_the_argmax_after_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    row = SamplingRow(params, None, [], [1], frozenset())  # token 1 already generated
    assert Sampler()(logits, [row]).token_ids == [2]


def test_min_tokens_hides_stop_tokens():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2)
    row = SamplingRow(params, None, [], [7], frozenset({0}))
    assert Sampler()(logits, [row]).token_ids == [1]
    row = SamplingRow(params, None, [], [7, 7], frozenset({0}))
    assert Sampler()(logits, [row]).token_ids == [0]
