"""The embedded SmolLM2-135M-Instruct GGUF against transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from llmserve.models.loader import DEFAULT_MODEL, load_model, resolve_model_path
from llmserve.runner.scoring import sequence_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours():
    return load_model(DEFAULT_MODEL, quantization="none")


def test_smollm2_logits_match_transformers(hf_smollm2, ours):
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0]
    got = sequence_logits(ours.model, ids)
    diff = (got - ref).abs().max().item()
    assert diff < 2e-3, f"max abs logit difference {diff} (logit scale {ref.abs().max():.1f})"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_64_tokens_match_transformers(hf_smollm2):
    from llmserve import LLM, SamplingParams

    llm = LLM(DEFAULT_MODEL, num_kv_blocks=64, quantization="none")
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Write a poem about the sea."}])
    with torch.no_grad():
        ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64,
                                  do_sample=False)[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref


def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(ours):
    from transformers import AutoTokenizer

    path = resolve_model_path(DEFAULT_MODEL)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello world!", "In 2024, 12345 apples cost $3.50.", "héllo 你好 😀 naïve café",
             "  spaces   and\ttabs\nnew lines\n\n", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours.tokenizer.encode(text) == ref.encode(text, add_special_tokens=True), text
        ids = ours.tokenizer.encode(text)
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
