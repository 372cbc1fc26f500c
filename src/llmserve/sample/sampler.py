"""Batched sampling: tensors built once per step from the requests' parameters.

The order of processing follows vLLM: logit bias and the min_tokens mask, then repetition,
frequency and presence penalties, then temperature, top-k, top-p and min-p, then one draw
per row. Greedy rows take the argmax after bias and penalties. When every row is greedy
with no bias or penalty, the step is a single argmax.

Every sampled row draws with its own key (the request's seed and the token's position, see
``ModelRunner._sampling_row``): a seeded request produces the same tokens whatever else
shares its batch, and the whole batch is drawn in one pass (``ops.exponential_race``).

Log-probabilities are taken from the model's raw distribution: ``log_softmax`` of the
logits before bias, penalties, temperature and filtering (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.sample import ops
from llmserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the step's logits: the request's parameters and what it has seen."""

    params: SamplingParams
    seed: int | None  # the draw's 63-bit key (``ops.race_keys``); None for greedy rows
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # EOS ids (unless ignore_eos) and stop_token_ids, which min_tokens hides (empty without)
    stop_ids: frozenset[int]


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row with logprobs requested: (ids [chosen, top-k...], logprobs, rank of chosen).
    logprobs: list[tuple[list[int], list[float], int] | None]


class PendingSample:
    """A step's samples on the device, on their way to the host: ``token_ids`` [N] stays on
    the device (the next step may read it there); ``result()`` waits for the copies."""

    def __init__(self, token_ids: torch.Tensor, rows: list[SamplingRow],
                 logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        self.token_ids = token_ids
        self._rows = rows
        # Copies started now, behind this step's kernels and ahead of anything launched
        # later: reading them waits for this step alone.
        self._host = [t.to("cpu", non_blocking=True) for t in (token_ids, *(logprobs or ()))]
        self._copied = None
        if token_ids.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SampleResult:
        if self._copied is not None:
            self._copied.synchronize()
        token_ids, *lp = (t.tolist() for t in self._host)
        logprobs: list = [None] * len(self._rows)
        if lp:
            ids, lps, ranks = lp
            for i, r in enumerate(self._rows):
                if r.params.logprobs is not None:
                    n = 1 + r.params.logprobs
                    logprobs[i] = (ids[i][:n], lps[i][:n], ranks[i])
        return SampleResult(token_ids, logprobs)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """``logits``: [N, V] float32, one row per entry of ``rows``."""
        return self.launch(logits, rows).result()

    def launch_greedy(self, logits: torch.Tensor) -> PendingSample:
        """``launch`` for rows that are all ``plain_greedy``: the argmax of each row, with
        no per-row parameters to gather (what ``launch`` computes for such rows)."""
        return PendingSample(ops.argmax(logits), [], None)

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
        """Sample on the device without waiting for it (on a GPU nothing here reads back to
        the host); ``result()`` of the returned object gives the tokens."""
        want_lp = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(dim=1) if want_lp else None
        logits = self._process(logits, rows)
        greedy = [r.params.greedy for r in rows]
        chosen = ops.argmax(logits) if all(greedy) else self._sample(logits, rows, greedy)
        logprobs = None
        if raw_logprobs is not None:
            k = max(r.params.logprobs or 0 for r in rows)
            logprobs = ops.topk_logprobs(raw_logprobs, chosen, k)
        return PendingSample(chosen, rows, logprobs)

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        bias = [(i, t, b) for i, r in enumerate(rows)
                for t, b in (r.params.logit_bias or {}).items()]
        if bias:
            idx, tok, val = zip(*bias)
            logits = ops.apply_logit_bias(logits, ops.to_device(device, idx, torch.int64),
                                          ops.to_device(device, tok, torch.int64),
                                          ops.to_device(device, val, logits.dtype))
        masked = [(i, t) for i, r in enumerate(rows)
                  if len(r.output_token_ids) < r.params.min_tokens for t in r.stop_ids]
        if masked:
            idx, tok = zip(*masked)
            logits = ops.mask_tokens(logits, ops.to_device(device, idx, torch.int64),
                                     ops.to_device(device, tok, torch.int64))
        if any(r.params.has_penalties for r in rows):
            vocab = logits.shape[1]
            counts = ops.token_counts([r.output_token_ids for r in rows], vocab, device)
            if any(r.params.repetition_penalty != 1.0 for r in rows):
                prompt = ops.token_counts([r.prompt_token_ids for r in rows], vocab, device)
                penalty = torch.tensor([r.params.repetition_penalty for r in rows],
                                       dtype=torch.float32, device=device)
                logits = ops.apply_repetition_penalty(logits, (counts + prompt) > 0, penalty)
            freq = torch.tensor([r.params.frequency_penalty for r in rows],
                                dtype=torch.float32, device=device)
            pres = torch.tensor([r.params.presence_penalty for r in rows],
                                dtype=torch.float32, device=device)
            logits = ops.apply_frequency_presence_penalties(logits, counts, freq, pres)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        params = [r.params for r in rows]
        greedy_choice = ops.argmax(logits) if any(greedy) else None
        temperature = ops.to_device(
            device, [1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
        logits = ops.apply_temperature(logits, temperature)
        if any(p.top_k > 0 for p in params):
            k = ops.to_device(device, [p.top_k for p in params], torch.int64)
            logits = ops.apply_top_k(logits, k)
        if any(p.top_p < 1.0 for p in params):
            top_p = ops.to_device(device, [p.top_p for p in params], torch.float32)
            logits = ops.apply_top_p(logits, top_p)
        if any(p.min_p > 0.0 for p in params):
            min_p = ops.to_device(device, [p.min_p for p in params], torch.float32)
            logits = ops.apply_min_p(logits, min_p)
        probs = logits.softmax(dim=1)
        drawn = [i for i, g in enumerate(greedy) if not g]
        keys = ops.race_keys([rows[i].seed for i in drawn], device)
        if greedy_choice is None:
            return ops.exponential_race(probs, keys)
        at = ops.to_device(device, drawn, torch.int64)
        return greedy_choice.index_copy(0, at, ops.exponential_race(probs[at], keys))
