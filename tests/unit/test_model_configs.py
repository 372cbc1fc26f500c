"""Each family's configuration read from config.json, in the forms its checkpoints use."""

from __future__ import annotations

import pytest

from llmserve.models.arch_config import ArchConfig
from llmserve.models.gemma3 import GLOBAL, SLIDING, Gemma3Config
from llmserve.models.registry import config_from_hf

GEMMA3_270M = {  # google/gemma-3-270m's config.json as released (transformers 4.x form)
    "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "sliding_window": 512, "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "_sliding_window_pattern": 6, "bos_token_id": 2,
    "eos_token_id": 1,
}


def test_gemma3_config_from_the_released_form():
    cfg = config_from_hf(GEMMA3_270M)
    assert isinstance(cfg, Gemma3Config)
    assert cfg.layer_types == tuple(GLOBAL if i % 6 == 5 else SLIDING for i in range(18))
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert [cfg.window(i) for i in (0, 5)] == [512, None]
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256
    assert cfg.num_parameters == pytest.approx(268e6, rel=0.01)  # "270M"


def test_gemma3_config_from_the_transformers_5_form():
    raw = {k: v for k, v in GEMMA3_270M.items()
           if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                        "_sliding_window_pattern")}
    raw["layer_types"] = [SLIDING, GLOBAL] * 9
    raw["rope_parameters"] = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                              GLOBAL: {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1000000.0}}
    cfg = config_from_hf(raw)
    assert cfg.layer_types == (SLIDING, GLOBAL) * 9
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize(("change", "message"), [
    ({"final_logit_softcapping": 30.0}, "soft-capping"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
])
def test_gemma3_configs_it_cannot_run_say_why(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**GEMMA3_270M, **change})


def test_llama_shaped_families_keep_the_common_config():
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32}
    cfg = config_from_hf(raw)
    assert type(cfg) is ArchConfig and cfg.head_dim == 32 and not cfg.attention_bias
