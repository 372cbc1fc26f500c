"""Invalid sampling values are rejected with a message naming the field and the range."""

from __future__ import annotations

import pytest

from llmserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, r"temperature must be in \[0, 2\], got -1"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"top_k": -2}, r"top_k must be -1 or 0 \(disabled\) or a positive integer up to "
                    r"2147483647, got -2"),
    ({"top_k": 2**63}, r"top_k must be .* up to 2147483647, got 9223372036854775808"),
    ({"logprobs": 50}, r"logprobs must be in \[0, 20\], got 50"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\], got 21"),
    ({"max_tokens": -1}, r"max_tokens must be at least 0, got -1"),
    ({"n": 0}, r"n must be in \[1, 128\], got 0"),
    ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens must be <= max_tokens \(2\), got 5"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
    ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\], got 3"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\], got -2.5"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 2\], got 0"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be in \[-100, 100\], got 101"),
    ({"logit_bias": {"x": 1}}, r"logit_bias keys must be token ids"),
    ({"stop": [""]}, r"stop must be non-empty strings"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids must be non-negative integers"),
    ({"temperature": float("nan")}, r"temperature must be a number"),
    ({"stop": 5}, r"stop must be a list, got int"),
    ({"stop_token_ids": 1}, r"stop_token_ids must be a list, got int"),
    ({"logit_bias": [1, 2]}, r"logit_bias must be a mapping of token id to bias, got list"),
    ({"ignore_eos": "no"}, r"ignore_eos must be true or false, got 'no'"),
    ({"skip_special_tokens": 0}, r"skip_special_tokens must be true or false, got 0"),
])
def test_invalid_values_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0,
                                                                            0.0)
    assert p.skip_special_tokens and not p.ignore_eos and p.logprobs is None


def test_normalizes_stop_and_logit_bias():
    p = SamplingParams(stop="END", logit_bias={"7": 2.0})
    assert p.stop == ("END",) and dict(p.logit_bias) == {7: 2.0}
    with pytest.raises(TypeError):
        p.logit_bias[8] = 1.0  # frozen


def test_child_params_offset_the_seed():
    p = SamplingParams(n=3, seed=10)
    assert [p.child(i).seed for i in range(3)] == [10, 11, 12]
    assert p.child(1).n == 1


def test_child_seeds_stay_in_the_signed_64_bit_range():
    top = SamplingParams(n=3, seed=2**63 - 1)
    assert [top.child(i).seed for i in range(3)] == [2**63 - 1, -(2**63), -(2**63) + 1]
    assert SamplingParams(n=2, seed=5).child(1).seed == 6


def test_only_the_first_of_n_sequences_computes_prompt_logprobs():
    p = SamplingParams(n=3, seed=7, prompt_logprobs=2, max_tokens=0)
    assert [(c.seed, c.prompt_logprobs, c.max_tokens) for c in map(p.child, range(3))] == [
        (7, 2, 0), (8, None, 0), (9, None, 0)]
