"""Each sampling filter and penalty against a slow, obvious reference on random logits."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.csrc import cpu_ops
from llmserve.sample import ops

N, V = 6, 50


@pytest.fixture
def logits():
    return torch.randn(N, V, generator=torch.Generator().manual_seed(0)) * 3


def _probs(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in row]
    s = sum(e)
    return [x / s for x in e]


def test_temperature(logits):
    t = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3, 1.9])
    got = ops.apply_temperature(logits, t)
    for i in range(N):
        for j in range(V):
            assert got[i, j].item() == pytest.approx(logits[i, j].item() / t[i].item())


def test_top_k(logits):
    k = torch.tensor([1, 3, 0, -1, V, 10])
    got = ops.apply_top_k(logits, k)
    for i in range(N):
        row = logits[i].tolist()
        kk = k[i].item()
        keep = set(range(V)) if kk <= 0 or kk >= V else set(
            sorted(range(V), key=lambda j: -row[j])[:kk])
        for j in range(V):
            assert (got[i, j].item() != -math.inf) == (j in keep)
            if j in keep:
                assert got[i, j].item() == row[j]


def test_top_p(logits):
    p = torch.tensor([0.05, 0.5, 0.9, 1.0, 0.99, 0.3])
    got = ops.apply_top_p(logits, p)
    for i in range(N):
        row = logits[i].tolist()
        probs = _probs(row)
        keep, mass = set(), 0.0
        for j in sorted(range(V), key=lambda j: -probs[j]):
            if mass >= p[i].item() and keep:
                break
            keep.add(j)
            mass += probs[j]
        for j in range(V):
            assert (got[i, j].item() != -math.inf) == (j in keep), (i, j)


def test_min_p(logits):
    mp = torch.tensor([0.0, 0.1, 0.5, 1.0, 0.01, 0.3])
    got = ops.apply_min_p(logits, mp)
    for i in range(N):
        probs = _probs(logits[i].tolist())
        top = max(probs)
        for j in range(V):
            dropped = probs[j] < mp[i].item() * top
            assert (got[i, j].item() == -math.inf) == dropped


def test_repetition_penalty(logits):
    seen_lists = [[1, 2, 3], [], [4, 4, 49], [0], list(range(V)), [7]]
    seen = torch.zeros(N, V, dtype=torch.bool)
    for i, toks in enumerate(seen_lists):
        seen[i, toks] = True
    pen = torch.tensor([1.2, 1.5, 0.8, 1.0, 2.0, 1.1])
    got = ops.apply_repetition_penalty(logits, seen, pen)
    for i in range(N):
        for j in range(V):
            x = logits[i, j].item()
            if j in seen_lists[i]:
                x = x / pen[i].item() if x > 0 else x * pen[i].item()
            assert got[i, j].item() == pytest.approx(x, rel=1e-6)


def test_frequency_and_presence_penalties(logits):
    outputs = [[1, 1, 1, 2], [], [5], [7, 8, 7], [49] * 4, [0, 1]]
    counts = ops.token_counts(outputs, V, logits.device)
    freq = torch.tensor([0.5, 1.0, -0.5, 2.0, 0.0, 0.1])
    pres = torch.tensor([0.3, 0.0, 1.0, -1.0, 2.0, 0.0])
    got = ops.apply_frequency_presence_penalties(logits, counts, freq, pres)
    for i in range(N):
        for j in range(V):
            c = outputs[i].count(j)
            want = logits[i, j].item() - freq[i].item() * c - pres[i].item() * (c > 0)
            assert got[i, j].item() == pytest.approx(want, abs=1e-5)


def test_logit_bias_and_mask(logits):
    rows, toks = torch.tensor([0, 0, 3]), torch.tensor([5, 6, 5])
    got = ops.apply_logit_bias(logits, rows, toks, torch.tensor([10.0, -100.0, 2.5]))
    want = logits.clone()
    want[0, 5] += 10
    want[0, 6] -= 100
    want[3, 5] += 2.5
    assert torch.allclose(got, want)
    masked = ops.mask_tokens(logits, torch.tensor([1, 2]), torch.tensor([0, 9]))
    assert masked[1, 0] == -math.inf and masked[2, 9] == -math.inf
    assert torch.isfinite(masked).sum() == N * V - 2


def test_topk_logprobs(logits):
    lp = logits.log_softmax(dim=1)
    chosen = torch.tensor([0, 5, 10, 15, 20, 25])
    ids, lps, ranks = ops.topk_logprobs(lp, chosen, 4)
    for i in range(N):
        row = lp[i].tolist()
        order = sorted(range(V), key=lambda j: -row[j])
        assert ids[i, 0].item() == chosen[i].item()
        assert ranks[i].item() == order.index(chosen[i].item()) + 1
        assert ids[i, 1:].tolist() == order[:4]
        assert lps[i].tolist() == pytest.approx([row[j] for j in ids[i].tolist()])


def test_top_logprobs_break_ties_by_token_id_whatever_k():
    """Equal values (a grammar's -inf, exact ties) come in token-id order, so a row's top j
    are the first j of its top k for every k: the sampler takes the batch's largest k, and
    a request's alternatives must not change with what the others asked for (they did:
    topk(3) and topk(4) pick different tokens among ties)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 49152, generator=gen).round(decimals=1)  # many exact ties
    x[1, 100:] = -math.inf  # a grammar left 100 tokens
    x[2, 2:] = -math.inf  # ... or 2: the top 4 hold masked ones
    x[3] = 0.0  # every token equal
    for k in (1, 3, 4, 5, 20):
        values, ids = ops.ordered_topk(x, k)
        for i in range(x.shape[0]):
            row = x[i].tolist()
            want = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]  # slow, obvious
            assert ids[i].tolist() == want, (i, k)
            assert values[i].tolist() == [row[j] for j in want]
    chosen = torch.zeros(6, dtype=torch.int64)
    few, many = ops.topk_logprobs(x, chosen, 3), ops.topk_logprobs(x, chosen, 5)
    assert torch.equal(few[0], many[0][:, :4]) and torch.equal(few[1], many[1][:, :4])


def _slow_argmax(row: list[float]) -> int:
    """The first NaN if any, else the first index of the largest value."""
    for i, x in enumerate(row):
        if math.isnan(x):
            return i
    return row.index(max(row))


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_argmax(vocab: int):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = 0.0                                     # all tied: index 0
    x[2, vocab // 2:] = 5.0                        # ties at the end of a row: the first one
    x[3, vocab - 1] = float("inf")                 # the last element
    x[4] = float("-inf")
    x[5, vocab // 3] = float("nan")                # NaN counts as the largest
    x[6, :] = float("nan")
    x[7, vocab - 1] = float("nan")
    x[7, 0] = float("inf")
    got = ops.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == [_slow_argmax(r) for r in x.tolist()]
    assert got.tolist() == x.argmax(dim=1).tolist()
    strided = torch.randn(4, 2 * vocab, generator=gen)[:, ::2]  # the PyTorch path
    assert ops.argmax(strided).tolist() == [_slow_argmax(r) for r in strided.tolist()]


def _race_batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities with the rows a sampler meets (filtered, one-hot, tiny, NaN) and keys."""
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(8, vocab, generator=gen) * 4).softmax(dim=1)
    probs[1, vocab // 2:] = 0.0                    # top-k/top-p filtered
    probs[2] = 0.0
    probs[2, vocab - 1] = 1.0                      # one token left
    probs[3] = 1e-40                               # denormal probabilities
    probs[4, vocab // 3] = float("nan")            # NaN wins, as in torch.argmax
    probs[5] = 1.0 / vocab                         # uniform: the largest u wins
    keys = torch.randint(0, 2**32, (8, 2), generator=gen)
    keys[6] = torch.tensor([0, 0])
    keys[7] = torch.tensor([2**32 - 1, 2**32 - 1])
    return probs, keys


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 4095, 4096, 4097, 49152])
def test_exponential_race_kernel_is_the_reference_bit_for_bit(vocab: int):
    """The compiled race computes every score with the reference's float32 operations
    (hash, 24-bit uniform, Cephes' log, one division): the same bits, the same draws."""
    kernels = cpu_ops()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are not built here (no C++ compiler, or "
                    "LLMSERVE_CPU_KERNELS=0); runs wherever they build, as in make test")
    probs, keys = _race_batch(vocab, vocab)
    want = ops.race_scores(probs, keys)
    got = kernels.exponential_race_scores(probs, keys)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    drawn = ops.exponential_race(probs, keys)
    assert drawn.tolist() == want.argmax(dim=1).tolist()
    assert drawn[2] == vocab - 1 and drawn[4] == vocab // 3


def test_race_log_and_uniforms():
    """The reference's log is Cephes' logf (within 2 float32 ulp of the true log over the
    race's uniforms), and the hash spreads a row's uniforms evenly over (0, 1), with rows
    whose keys differ in one bit unrelated."""
    u = torch.linspace(2.0**-25, 1.0 - 2.0**-24, 200001, dtype=torch.float32)
    exact = torch.log(u.double())
    y = exact.float()
    ulp = (torch.nextafter(y, torch.full_like(y, math.inf)) - y).abs().double()
    assert ((ops._log(u).double() - exact).abs() <= 2 * ulp).all()
    v = torch.arange(1 << 16)
    keys = torch.tensor([[12345, 678], [12345 ^ 1, 678], [12345, 678 ^ 1]])
    h = ops._mix32(ops._mix32(v ^ keys[:, :1]) ^ keys[:, 1:])
    uniforms = ((h >> 9).float() + 0.5) * 2.0**-23
    counts = torch.stack([torch.histc(r, bins=16, min=0.0, max=1.0) for r in uniforms])
    expected = (1 << 16) / 16
    assert (((counts - expected) ** 2 / expected).sum(dim=1) < 37.7).all()  # chi2, 15 df, p=.001
    for other in (1, 2):
        r = torch.corrcoef(torch.stack([uniforms[0], uniforms[other]]))[0, 1]
        assert abs(float(r)) < 0.02


def test_a_token_of_probability_zero_never_wins_the_race():
    """Every hash maps to a uniform below 1, so E = -log(u) > 0 and a zero probability
    scores 0. (u had been ((h >> 8) + 0.5) 2^-24, which rounds to 1 for the largest 24-bit
    value: E = 0 and 0 / 0 won, for about one row in 340 at SmolLM2's vocabulary; this key
    drew token 24576 from a distribution holding only 12937.)"""
    from llmserve.runner.model_runner import token_seed

    vocab = 49152
    gen = torch.Generator().manual_seed(3)
    rows = 3000
    keys = torch.cat([ops.race_keys([token_seed(614248, 46)], torch.device("cpu")),
                      torch.randint(0, 2**32, (rows - 1, 2), generator=gen)])
    hot = torch.randint(0, vocab, (rows,), generator=gen)
    hot[0] = 12937
    probs = torch.zeros(rows, vocab)
    probs[torch.arange(rows), hot] = 1.0
    assert ops.exponential_race(probs, keys).tolist() == hot.tolist()
    assert ops.race_scores(probs[:600], keys[:600]).argmax(dim=1).tolist() == hot[:600].tolist()
    largest = ((torch.tensor([2**32 - 1]) >> 9).float() + 0.5) * 2.0**-23
    assert largest.item() < 1.0 and ops._log(largest).item() < 0.0


def test_row_results_do_not_depend_on_the_batch():
    """What the sampler computes over a row of the vocabulary (the logprobs' log_softmax, the
    draw's softmax, top-p's sorted cumulative sum, min-p, top-k, argmax, the draw itself) is
    bitwise the same
    for a row alone and inside batches of any size: a seeded request draws the same token
    and reports the same logprobs however it is batched. (A float ``sum(dim=1)`` over such
    rows is not: PyTorch vectorizes it across rows.)"""
    gen = torch.Generator().manual_seed(1)
    vocab = 49152
    x = torch.randn(70, vocab, generator=gen) * 5
    p = torch.rand(70, generator=gen)
    k = torch.randint(1, 100, (70,), generator=gen)
    keys = torch.randint(0, 2**32, (70, 2), generator=gen)
    per_row = {
        "log_softmax": lambda t, r: t.log_softmax(dim=1),
        "softmax": lambda t, r: t.softmax(dim=1),
        "top_p": lambda t, r: ops.apply_top_p(t, p[r]),
        "min_p": lambda t, r: ops.apply_min_p(t, p[r] * 0.1),
        "top_k": lambda t, r: ops.apply_top_k(t, k[r]),
        "argmax": lambda t, r: ops.argmax(t),
        "race": lambda t, r: ops.exponential_race(t.softmax(dim=1), keys[r]),
    }
    for name, f in per_row.items():
        full = f(x, slice(0, 70))
        for m in (1, 2, 3, 7, 16, 33, 64):
            batch = f(x[:m], slice(0, m))
            for i in {0, m // 2, m - 1}:
                alone = f(x[i:i + 1], slice(i, i + 1))[0]
                assert torch.equal(batch[i], full[i]) and torch.equal(alone, full[i]), (name, m, i)
