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
        out = EngineCoreOutput("r", 0, [t], reason, 2 if append_eos and last else None, 2, 0)
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
    assert state.seqs[0].finish_reason == "stop" and state.seqs[0].stop_reason == 2
