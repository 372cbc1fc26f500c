"""GGUF loading: every supported tensor type against transformers with the same weights."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from llmserve.models.loader import load_model
from llmserve.runner.scoring import sequence_logits
from tests.helpers.gguf_files import write_llama_gguf
from tests.helpers.tiny_models import VOCAB

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K]


@pytest.fixture(scope="module")
def hf_gguf_base():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_tensor_type_matches_reference(tmp_path, hf_gguf_base, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    held = write_llama_gguf(hf_gguf_base, path, qtype)
    reference = type(hf_gguf_base)(hf_gguf_base.config).float().eval()
    reference.load_state_dict(held, strict=False)
    reference.tie_weights()
    ids = torch.randint(17, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    loaded = load_model(str(path), quantization="none")
    assert loaded.arch_config.tie_word_embeddings
    got = sequence_logits(loaded.model, ids)
    # fp32 tolerance relative to the logits' scale (random K-quant blocks give large weights)
    diff = (got - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert diff < 1e-5 * scale + 1e-5, f"{qtype.name}: max abs difference {diff} (scale {scale})"
    assert loaded.tokenizer.encode("Hello world") == [19556, 905]


@pytest.mark.parametrize(("types", "want"), [
    ({"Q4_1", "Q8_0"}, "int4"),  # SmolLM2's file: its 4-bit blocks load as they are
    ({"Q4_0"}, "int4"),
    ({"Q4_K", "Q5_0", "Q6_K", "Q8_0"}, "int8"),  # Gemma 3's Q4_K_M: no second 4-bit rounding
    ({"Q5_0"}, "int8"),
    ({"Q8_0", "F16"}, "int8"),
    ({"F16", "F32"}, "none"),
])
def test_auto_quantization_never_rounds_weights_to_4_bits_twice(types, want):
    from llmserve.models.loader import _auto_quantization

    class File:
        def weight_types(self):
            return types

    assert _auto_quantization(File()) == want
