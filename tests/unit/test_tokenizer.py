"""Tokenizer and chat template of the embedded model (read from its GGUF, no model weights)."""

from __future__ import annotations

import pytest

from llmserve.tokenizer.chat_template import ChatTemplateError, render_chat_template


def test_special_tokens_and_end_of_turn(smol_tokenizer):
    tok = smol_tokenizer
    assert tok.token_to_id("<|im_end|>") == 2
    assert 2 in tok.stop_token_ids  # <|im_end|> ends a turn
    assert tok.eos_token == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [1]  # special tokens are atomic
    assert tok.decode([1, 19556, 2]) == "Hello"  # and skipped on decode by default
    assert tok.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


@pytest.mark.parametrize("text", ["Hello world!", "naïve café 😀 你好", "x = 1234567\n\ty"])
def test_encode_decode_round_trip(smol_tokenizer, text):
    assert smol_tokenizer.decode(smol_tokenizer.encode(text)) == text


def test_digits_are_split_individually(smol_tokenizer):
    ids = smol_tokenizer.encode("12345")
    assert len(ids) == 5


def test_chat_template_renders_chatml_with_default_system(smol_tokenizer):
    text = smol_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = smol_tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # no extra BOS, two closed turns


def test_chat_template_matches_jinja_reference_in_transformers(smol_tokenizer):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    ours = smol_tokenizer.apply_chat_template(messages)
    ref, _ = render_jinja_template(conversations=[messages],
                                   chat_template=smol_tokenizer.chat_template,
                                   add_generation_prompt=True)
    assert ours == ref[0]


def test_chat_template_is_sandboxed():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_chat_template(evil, [{"role": "user", "content": "x"}])


def test_chat_template_raise_exception_becomes_clear_error():
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}")
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])


def test_bad_messages_rejected():
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        render_chat_template("{{ messages }}", [])


def test_gemma3_chat_template_renders_as_in_transformers():
    """Gemma 3's instruction-tuned template (system folded into the first user turn,
    "model" turns, roles that must alternate), rendered by our sandbox and by transformers."""
    from pathlib import Path

    from transformers.utils.chat_template_utils import render_jinja_template

    template = (Path(__file__).parents[1] / "data" / "gemma3_chat_template.jinja").read_text()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2? "},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]}]
    ours = render_chat_template(template, messages, bos_token="<bos>")
    ref, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                   add_generation_prompt=True, bos_token="<bos>")
    assert ours == ref[0]
    assert ours == ("<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n"
                    "<start_of_turn>model\n4<end_of_turn>\n"
                    "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat_template(template, [{"role": "user", "content": "a"},
                                        {"role": "user", "content": "b"}], bos_token="<bos>")


def test_use_chat_template_checks_the_model_s_and_takes_one_given(tmp_path, smol_tokenizer):
    """A template that does not parse is the server's to refuse at start (it used to serve,
    answering every chat request 400 "invalid chat template" with param "messages")."""
    import copy

    from llmserve.server.launcher import use_chat_template
    from llmserve.tokenizer.chat_template import check_chat_template, read_chat_template

    with pytest.raises(ChatTemplateError, match="invalid chat template: unexpected '}'"):
        check_chat_template("{{ x }")
    broken = copy.copy(smol_tokenizer)
    broken.chat_template = "{% for m in messages %}{{ m.content }{% endfor %}"
    with pytest.raises(ValueError, match=r"the chat template of model tiny does not parse as "
                                         r"a Jinja template \(unexpected '}'\); give one that "
                                         r"does with --chat-template FILE"):
        use_chat_template(broken, None, "tiny")
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(file)) == file.read_text()
    use_chat_template(broken, str(file), "tiny")
    assert broken.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    none = copy.copy(smol_tokenizer)
    none.chat_template = None
    use_chat_template(none, None, "tiny")  # a model without a template keeps working
    assert none.chat_template is None
    with pytest.raises(ValueError, match="--chat-template does not parse"):
        use_chat_template(copy.copy(smol_tokenizer), "{{ x }", "tiny")
