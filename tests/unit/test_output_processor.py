"""Incremental detokenization and stop strings, fed token by token (no model).

Byte-level BPE splits emoji, CJK and accented characters across tokens; the stream must
never show a broken character, must only grow, and must equal the full decode in the end.
Stop strings are cut exactly: nothing after the stop is emitted, nothing before it lost.
"""

from __future__ import annotations

import pytest

from llmserve.engine.messages import EngineCoreOutput
from llmserve.engine.output_processor import OutputProcessor
from llmserve.sampling_params import SamplingParams

TEXTS = [
    "Hello 😀 world 🎉🎉 done",
    "日本語のテキストと中文混合",
    "Łódź żółć gęślą jaźń, crème brûlée",
    "Ünïcödé 👩‍👩‍👧 ok",
]


def _feed(tok, text, params, finish="length", append_eos=False):
    """Run ``text``'s tokens through the processor one per step."""
    ids = tok.encode(text)
    if append_eos:
        ids = [*ids, 2]
    proc = OutputProcessor(tok)
    state = proc.add_request("r", None, [1, 2], params)
    deltas, stopped_at = [], None
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        reason = ("stop" if append_eos else finish) if last else None
        out = EngineCoreOutput("r", 0, [t], reason, None, 2, 0)
        ds, to_stop = proc.process([out])
        deltas += [d.text for d in ds]
        if to_stop:
            stopped_at = i
            break
    return ids, deltas, state, stopped_at


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_breaks_a_character(smol_tokenizer, text):
    _, deltas, state, _ = _feed(smol_tokenizer, text, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == state.seqs[0].text


@pytest.mark.parametrize("text", TEXTS)
def test_texts_really_split_characters_across_tokens(smol_tokenizer, text):
    def complete(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    ids = smol_tokenizer.encode(text)
    assert not all(complete(smol_tokenizer.token_bytes(t)) for t in ids)


def test_token_bytes_reassemble_the_text(smol_tokenizer):
    text = TEXTS[0] + TEXTS[1]
    ids = smol_tokenizer.encode(text)
    assert b"".join(smol_tokenizer.token_bytes(t) for t in ids).decode() == text


@pytest.mark.parametrize("text, stop, include, want", [
    ("The answer is 42. Done here.", ["Done"], False, "The answer is 42. "),
    ("The answer is 42. Done here.", ["Done"], True, "The answer is 42. Done"),
    ("alpha beta gamma delta", ["a gam"], False, "alpha bet"),  # spans tokens
    ("I like dogsandcats", ["sand"], False, "I like dog"),  # inside a token boundary
    ("one two three", ["two three", "two"], False, "one "),  # overlapping stops
    ("xx abcabcd yy", ["abcd"], False, "xx abc"),  # a false start then the real one
    ("Hello 😀 world", ["😀"], False, "Hello "),  # multi-byte stop
    ("日本語のテキスト", ["のテ"], False, "日本語"),
    ("no stop in this text", ["zzz"], False, "no stop in this text"),
])
def test_stop_strings(smol_tokenizer, text, stop, include, want):
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    _, deltas, state, stopped_at = _feed(smol_tokenizer, text, params)
    assert "".join(deltas) == want
    seq = state.seqs[0]
    assert seq.text == want
    if want != text:
        assert seq.finish_reason == "stop" and seq.stop_reason in stop
        assert stopped_at is not None
    else:
        assert seq.finish_reason == "length"


def test_text_that_may_start_a_stop_is_held_back_then_flushed(smol_tokenizer):
    params = SamplingParams(stop=["STOP"])
    _, deltas, state, _ = _feed(smol_tokenizer, "ends with ST", params)
    assert "".join(deltas) == "ends with ST"  # released at the end, not lost
    assert state.seqs[0].finish_reason == "length"


def test_held_back_text_never_leaks_past_a_stop(smol_tokenizer):
    params = SamplingParams(stop=["STOP"])
    ids = smol_tokenizer.encode("abc STOP def")
    proc = OutputProcessor(smol_tokenizer)
    proc.add_request("r", None, [1], params)
    shown = ""
    for t in ids:
        ds, to_stop = proc.process([EngineCoreOutput("r", 0, [t], None, None, 1, 0)])
        shown += "".join(d.text for d in ds)
        assert "S" not in shown
        if to_stop:
            break
    assert shown == "abc "


def test_eos_is_not_in_the_text(smol_tokenizer):
    _, deltas, state, _ = _feed(smol_tokenizer, "Hi there", SamplingParams(), append_eos=True)
    assert "".join(deltas) == "Hi there"
    assert state.seqs[0].finish_reason == "stop"


def test_the_token_that_ended_a_sequence_is_not_text(smol_tokenizer):
    """An end of sequence (special, shown with skip_special_tokens false) or a stop token id
    (an ordinary token) that ended the sequence is left out of the text, as vLLM leaves it,
    unless include_stop_str_in_output; its id stays in the token ids."""
    shown = SamplingParams(skip_special_tokens=False)
    ids, deltas, state, _ = _feed(smol_tokenizer, "Hi there", shown, append_eos=True)
    assert "".join(deltas) == state.seqs[0].text == "Hi there"
    assert state.seqs[0].token_ids == ids and state.seqs[0].stop_reason is None
    kept = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    _, deltas, state, _ = _feed(smol_tokenizer, "Hi there", kept, append_eos=True)
    assert state.seqs[0].text == "Hi there" + smol_tokenizer.token_text(2)
    # A stop token id: the engine ends the sequence on it ("stop", the id as stop_reason).
    ids, deltas, state, _ = _feed(smol_tokenizer, "Hi there", SamplingParams(), finish="stop")
    assert state.seqs[0].text == smol_tokenizer.decode(ids[:-1])
    assert state.seqs[0].token_ids == ids


def test_stop_strings_wait_for_min_tokens(smol_tokenizer):
    """Text of the first min_tokens tokens is passed over by the stop strings (as vLLM does),
    and so is a short stop string inside it that a longer one's search would reach."""
    text = "one\ntwo\nthree\nfour"
    n_one = len(smol_tokenizer.encode("one\ntwo"))
    params = SamplingParams(stop=["\n", "xxxxxxxx"], min_tokens=n_one)
    _, deltas, state, stopped_at = _feed(smol_tokenizer, text, params)
    seq = state.seqs[0]
    assert seq.finish_reason == "stop" and seq.stop_reason == "\n"
    assert seq.text == "one\ntwo" and stopped_at is not None and stopped_at >= n_one
    assert "".join(deltas) == seq.text
    _, _, state, _ = _feed(smol_tokenizer, text, SamplingParams(stop=["\n"]))
    assert state.seqs[0].text == "one"
