"""The offline API's answers to what a caller can get wrong: a TypeError or ValueError that
names the argument and what is allowed (not one from deep inside, nor a misleading one),
and the LLM object works on after each."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.tokenizer.chat_template import ChatTemplateError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama-gqa")[0]), max_model_len=128, num_kv_blocks=64)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda llm: llm.generate(None), TypeError, "got NoneType"),
    (lambda llm: llm.generate(5), TypeError, r"a prompt \(a string, a list of token ids"),
    (lambda llm: llm.generate([1.0, 2.0]), TypeError,
     "a prompt's token ids must be integers, got 1.0 at index 0"),
    (lambda llm: llm.generate([[5, "a"]]), TypeError, "got 'a' at index 1"),
    (lambda llm: llm.generate({"prompt_token_ids": [True]}), TypeError, "got True at index 0"),
    (lambda llm: llm.generate("hi", {"max_tokens": 3}), TypeError,
     r"SamplingParams\(\*\*d\) makes one"),
    (lambda llm: llm.generate(["a", "b"], priority=["x", 0]), ValueError,
     "priority must be one integer per prompt"),
    (lambda llm: next(llm.stream("hello")), TypeError,
     "prompt_token_ids must be a list of integers, got str"),
    (lambda llm: llm.chat([{"role": "user", "content": None}]), ChatTemplateError,
     r"messages\[0\].content is null"),
    (lambda llm: llm.chat([{"role": "user", "content": 5}]), ChatTemplateError,
     r"messages\[0\].content must be a string or a list of content parts, got int"),
])
def test_a_wrong_call_says_what_was_wrong(llm, call, error, message):
    with pytest.raises(error, match=message):
        call(llm)
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    out = llm.generate((5, 6, 7), SamplingParams(max_tokens=2, temperature=0))  # a tuple
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2


def test_chunked_prefill_off_needs_a_step_for_a_whole_prompt(tiny_model_dir):
    """A prompt longer than a step's budget was never admitted: generate() spun for ever."""
    with pytest.raises(ValueError, match=r"without chunked prefill .* raise "
                                         r"max_num_batched_tokens to 64"):
        LLM(str(tiny_model_dir("llama-gqa")[0]), max_model_len=64, num_kv_blocks=16,
            enable_chunked_prefill=False, max_num_batched_tokens=8)


def test_enforce_eager_off_cuda_says_it_changes_nothing(tiny_model_dir, caplog):
    LLM(str(tiny_model_dir("llama-gqa")[0]), max_model_len=128, num_kv_blocks=64,
        enforce_eager=True)
    assert "enforce_eager has no effect on cpu" in caplog.text


def test_a_speculative_config_that_is_no_dict_is_a_type_error(tiny_model_dir):
    path = str(tiny_model_dir("llama-gqa")[0])
    with pytest.raises(TypeError, match=r"speculative_config must be a dict .* got list"):
        LLM(path, speculative_config=[1, 2])


def test_a_draft_shorter_than_draft_num_layers_names_it(tiny_model_dir):
    from llmserve.errors import ModelLoadError

    path = str(tiny_model_dir("llama-gqa")[0])
    with pytest.raises(ModelLoadError, match=r'\(--speculative-config\) "draft_num_layers" 5 '
                                             r"does not fit the draft model: .*cannot keep 5 "
                                             r"layers of 2; allowed: 1 to 2"):
        LLM(path, max_model_len=128, num_kv_blocks=64,
            speculative_config={"method": "draft", "model": path, "draft_num_layers": 5})
