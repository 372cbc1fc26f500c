"""Pure tensor functions over a batch of logits ``[N, V]`` (float32), one row a request.

Each takes per-row parameters as tensors; a row whose parameter disables the filter is left
unchanged. Filtered-out entries become -inf.
"""

from __future__ import annotations

import torch

from llmserve.csrc import cpu_ops


def to_device(device: torch.device, values: list | tuple, dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on ``device``; to a GPU from pinned memory without a
    wait (a copy from pageable memory waits for every kernel queued before it, which would
    stall a step launched ahead of the one running)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=1)`` (first index on ties, NaN the largest); float32 rows on CPU
    go through the compiled kernel, ~10x faster than PyTorch's on a vocabulary of 49k."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.stride(1) == 1 and logits.shape[1] > 0:
        kernels = cpu_ops()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=1)


# The exponential race (``exponential_race``): Cephes' logf coefficients as float32 values.
_LOG_POLY = tuple(float.fromhex(c) for c in (
    "0x1.204376p-4", "-0x1.d7a37p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4", "0x1.23d37ep-3",
    "-0x1.555ca0p-3", "0x1.999d58p-3", "-0x1.fffff8p-3", "0x1.555554p-2"))
_SQRT_HALF = float.fromhex("0x1.6a09e6p-1")
_LOG_LO, _LOG_HI = float.fromhex("-0x1.bd0106p-13"), float.fromhex("0x1.63p-1")


def race_keys(seeds: list[int], device: torch.device) -> torch.Tensor:
    """Each row's 64-bit seed (``model_runner.token_seed``) as two 32-bit words, [N, 2]."""
    words = [(s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF) for s in seeds]
    return to_device(device, words, torch.int64)


def exponential_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` [N, V] (float32, rows summing to 1): the token
    ``argmax_v p[v] / E[v]`` with ``E[v] = -log(u[v])`` exponentially distributed, so token
    v wins with probability p[v]. ``u[v]`` in (0, 1) is a counter-based hash of the row's key
    (``race_keys``) and v: a row's draw depends on its key and its probabilities alone, and
    the whole batch is drawn at once (no per-row generator). Ties go to the first index;
    a NaN probability wins (``torch.argmax``'s rules). On CPU the compiled kernel computes
    the same operations (``csrc/sample_race.cpp``); the same bits."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 \
            and probs.stride(1) == 1 and probs.shape[1] > 0:
        kernels = cpu_ops()
        if kernels is not None:
            return kernels.exponential_race(probs, keys)
    # A few million scores at a time: the hash's int64 temporaries are 8 bytes an entry.
    step = max(1, (1 << 22) // max(1, probs.shape[1]))
    return torch.cat([race_scores(probs[r:r + step], keys[r:r + step]).argmax(dim=1)
                      for r in range(0, probs.shape[0], step)])


def race_scores(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``p[v] / E[v]`` of ``exponential_race``, in PyTorch ops (any device): the
    reference the compiled kernel is held to."""
    v = torch.arange(probs.shape[1], dtype=torch.int64, device=probs.device)
    h = _mix32(_mix32(v ^ keys[:, :1]) ^ keys[:, 1:])  # [N, V] in [0, 2^32)
    # 23 bits and a half: exact in float32's 24, then a power of 2; u < 1, so E > 0 (with 24
    # bits, 2^24 - 1 + 0.5 rounded up to 2^24: u = 1, E = 0 and a zero probability won).
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return probs / (0.0 - _log(u))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on 32-bit words held in int64 (multiplies split so none overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF  # x * 0x846CA68B
    return x ^ (x >> 16)


def _log(x: torch.Tensor) -> torch.Tensor:
    """Cephes' logf for normal positive float32 ``x``, one float32 operation at a time
    (the compiled kernel's ``vlog``)."""
    m, exponent = torch.frexp(x)  # m in [0.5, 1)
    e = exponent.to(torch.float32)
    small = m < _SQRT_HALF
    e = torch.where(small, e - 1.0, e)
    m = torch.where(small, (m + m) - 1.0, m - 1.0)
    z = m * m
    y = torch.full_like(m, _LOG_POLY[0])
    for c in _LOG_POLY[1:]:
        y = y * m + c
    y = (y * m) * z
    y = y + e * _LOG_LO
    y = y + z * -0.5
    return (m + y) + e * _LOG_HI


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


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """Add ``bias[i]`` to ``logits[rows[i], token_ids[i]]`` (all [K] tensors)."""
    return logits.index_put((rows, token_ids), bias, accumulate=True)


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor,
                token_ids: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], token_ids[i]]`` to -inf (min_tokens hides the stop tokens)."""
    return logits.index_put((rows, token_ids),
                            torch.tensor(float("-inf"), device=logits.device))


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Keep, in row ``rows[i]``, only the tokens whose bit is set in ``bitmask[i]`` (int32
    [R, W]: token t is bit t % 32 of word t // 32); every other logit becomes -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(2) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # the mask does not reach the last (padding) rows
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab].to(logits.device)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """For tokens seen in the prompt or output (``seen``: [N, V] bool), divide positive
    logits by ``penalty`` and multiply negative ones by it (CTRL / vLLM / HF semantics)."""
    p = penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence_penalties(logits: torch.Tensor, counts: torch.Tensor,
                                       frequency: torch.Tensor,
                                       presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties: ``counts`` [N, V] is how often each token was generated."""
    return (logits - frequency.unsqueeze(1) * counts
            - presence.unsqueeze(1) * (counts > 0).to(logits.dtype))


def token_counts(token_lists: list[list[int]], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """[N, V] float32 counts of each token id per row."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    rows = [r for r, toks in enumerate(token_lists) for _ in toks]
    if rows:
        ids = torch.tensor([t for toks in token_lists for t in toks], device=device)
        counts.index_put_((torch.tensor(rows, device=device), ids),
                          torch.ones(len(rows), device=device), accumulate=True)
    return counts


def topk_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen token's logprob and rank (1 = most likely) plus the top-k alternatives.

    Returns ids [N, 1 + k] (chosen first), their logprobs [N, 1 + k], ranks [N] of chosen.
    """
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    rank = (logprobs > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = ordered_topk(logprobs, k)
    return (torch.cat([chosen.unsqueeze(1), top_ids], 1),
            torch.cat([chosen_lp, top_lp], 1), rank)


def ordered_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their indices, largest first and equal values
    in index order: so a row's first j of them are its top j whatever k is (the sampler
    takes the batch's largest k and each row keeps its own). ``torch.topk`` breaks ties
    differently for different k, and ties are common where a grammar masked tokens to -inf:
    a request's alternatives had changed with what the others in its batch asked for."""
    k = min(k, x.shape[1])
    if k == 0:
        return x[:, :0], torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
    top = x.topk(k, dim=1)
    last = top.values[:, -1:]  # the k-th largest of each row
    above = x > last
    tied = x == last  # the first (k - above) of these, by index, complete the k
    room = k - above.sum(dim=1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=1) <= room))
    n = x.shape[1]
    by_index = torch.where(keep, n - torch.arange(n, device=x.device), 0)  # distinct
    ids = by_index.topk(k, dim=1).indices  # each row's k, in index order (no host sync)
    values = x.gather(1, ids)
    order = values.sort(dim=1, descending=True, stable=True).indices
    values, ids = values.gather(1, order), ids.gather(1, order)
    whole = keep.sum(dim=1, keepdim=True) == k  # not where a NaN compares with nothing
    return torch.where(whole, values, top.values), torch.where(whole, ids, top.indices)
