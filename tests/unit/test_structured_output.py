"""Structured outputs and tool calling, below the engine: the mask op against a slow
reference, constraint checks, the per-request matchers and their masks (drafts included),
the tool-call grammar, parser and stream splitter, and the request schemas."""

from __future__ import annotations

import json
import random

import pytest
import torch
from llguidance import LLMatcher

from llmserve.sample.ops import apply_token_bitmask
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.scheduler.output import ScheduledRequest
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.server.tools import (
    ToolCallStream,
    parse_tool_calls,
    prompt_messages,
    tool_call_grammar,
)
from llmserve.structured_output import GrammarBackend, GrammarError, validate_structured

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
PHONE = "[0-9]{3}-[0-9]{4}"
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


# ---- the mask op ---------------------------------------------------------------------------


def test_token_bitmask_against_a_slow_reference():
    rng = torch.Generator().manual_seed(0)
    vocab, words = 100, 4  # the mask covers 128 tokens; the logits only 100
    logits = torch.randn(5, vocab, generator=rng)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32, generator=rng)
    rows = torch.tensor([3, 1])
    got = apply_token_bitmask(logits, rows, bitmask)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(vocab):
            word = int(bitmask[i, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])  # other rows untouched


def test_token_bitmask_shorter_than_the_logits_forbids_the_rest():
    logits = torch.zeros(1, 40)
    got = apply_token_bitmask(logits, torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(got[0, 32:]).all() and not torch.isinf(got[0, :32]).any()


# ---- constraints ---------------------------------------------------------------------------


def test_constraint_takes_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=())
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


@pytest.mark.parametrize(("constraint", "message"), [
    (StructuredOutputsParams(json={"type": "object", "if": {}}), r'Unimplemented keys: \["if"\]'),
    (StructuredOutputsParams(json={"type": "objekt"}), "Invalid type: objekt"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(regex="a(b"), "unclosed group"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "unknown name"),
])
def test_unenforceable_constraints_name_what_is_wrong(constraint, message):
    with pytest.raises(GrammarError, match=message) as info:
        validate_structured(constraint)
    assert str(info.value).startswith(f"structured_outputs.{constraint.kinds()[0]}: ")


def test_gbnf_and_lark_grammars_are_accepted():
    validate_structured(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    validate_structured(StructuredOutputsParams(grammar='start: "a"+ "b"'))


# ---- matchers and masks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(smol_tokenizer):
    return GrammarBackend(smol_tokenizer, smol_tokenizer.vocab_size,
                          smol_tokenizer.stop_token_ids)


def _item(rid: str, constraint: StructuredOutputsParams, drafts: list[int] = ()):
    params = SamplingParams(temperature=0, structured_outputs=constraint)
    return ScheduledRequest(rid, [0, *drafts], 5, [[0]], True, params,
                            num_draft_tokens=len(drafts))


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    logits = apply_token_bitmask(torch.zeros(1, vocab), torch.tensor([0]), bitmask_row[None])
    return set(torch.nonzero(~torch.isinf(logits[0])).flatten().tolist())


def test_choice_mask_allows_exactly_the_prefixes(backend, smol_tokenizer):
    choices = ("yes please", "no thanks")
    vocab = smol_tokenizer.vocab_size
    allowed = _allowed(backend.masks([_item("c", StructuredOutputsParams(choice=choices))])[0],
                       vocab)
    assert allowed
    for t in allowed:
        text = smol_tokenizer.decode([t])
        assert any(c.startswith(text) for c in choices), (t, text)
    for c in choices:
        assert smol_tokenizer.encode(c)[0] in allowed
    backend.free("c")


def test_masks_follow_the_drafts_and_roll_back(backend, smol_tokenizer):
    """Row j of a request with drafts is the grammar's state after drafts 0..j-1; the
    matcher itself is where it was before (only emitted tokens move it)."""
    vocab = smol_tokenizer.vocab_size
    constraint = StructuredOutputsParams(regex=PHONE)
    ids = smol_tokenizer.encode("123-4567")
    assert len(ids) >= 3
    plain = backend.masks([_item("r", constraint)])
    x = smol_tokenizer.encode("x")[0]
    drafted = backend.masks([_item("r", constraint, [*ids[:3], x])])
    assert drafted.shape[0] == 5
    assert torch.equal(drafted[0], plain[0])
    # Each row after an allowed draft: what is allowed after the tokens so far.
    reference = LLMatcher(backend.ll_tokenizer, LLMatcher.grammar_from_regex(PHONE))
    for j in range(4):
        assert _allowed(drafted[j], vocab) == _allowed(_row(reference, vocab), vocab)
        if j < 3:
            assert reference.consume_token(ids[j])
    # After "123" only "-" may follow: the draft "x" is forbidden by row 3, and the row
    # after it is left all-allowed (its sample is discarded).
    assert x not in _allowed(drafted[3], vocab)
    assert all(smol_tokenizer.decode([t]).startswith("-") for t in _allowed(drafted[3], vocab))
    assert (drafted[4] == -1).all()
    # Rolled back: the matcher accepts the real first token again, as at the start.
    assert torch.equal(backend.masks([_item("r", constraint)])[0], plain[0])
    backend.accept("r", ids[:3])  # "123": only "-" may follow
    after = _allowed(backend.masks([_item("r", constraint)])[0], vocab)
    assert after and all(smol_tokenizer.decode([t]).startswith("-") for t in after)
    backend.free("r")


def _row(matcher: LLMatcher, vocab: int) -> torch.Tensor:
    row = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    return row[0]


def test_a_finished_grammar_allows_only_the_end(backend, smol_tokenizer):
    constraint = StructuredOutputsParams(choice=("ok",))
    backend.masks([_item("f", constraint)])
    backend.accept("f", smol_tokenizer.encode("ok"))
    allowed = _allowed(backend.masks([_item("f", constraint)])[0], smol_tokenizer.vocab_size)
    assert allowed and allowed <= smol_tokenizer.stop_token_ids
    backend.accept("f", [next(iter(allowed))])  # the end itself is taken quietly
    backend.free("f")


# ---- tools ---------------------------------------------------------------------------------


def test_tool_call_grammar_accepts_calls_and_only_calls(backend, smol_tokenizer):
    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(backend.ll_tokenizer, LLMatcher.grammar_from_lark(grammar))
        ids = smol_tokenizer.encode(text)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    tools = [WEATHER, TIME]
    assert LLMatcher.validate_grammar(tool_call_grammar(tools, None, True)) == ""
    assert accepts(tool_call_grammar(tools, None, True), two)
    assert not accepts(tool_call_grammar(tools, None, False), two)
    assert accepts(tool_call_grammar(tools, "get_weather", False), one)
    assert not accepts(tool_call_grammar(tools, "get_time", False), one)
    bad_args = one.replace('"city": "Paris"', '"town": "Paris"')
    assert not accepts(tool_call_grammar(tools, None, True), bad_args)


def test_parse_tool_calls():
    names = {"get_weather", "get_time"}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", '
            '"arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>')
    content, calls = parse_tool_calls(text, names)
    assert content == "Let me check."
    # The whitespace around calls between two texts separates them, as the model wrote it.
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parse_tool_calls(f"First:\n{call}\n{call} Second.\n", names)[0] == \
        "First:\n\n Second."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    # Unknown function, broken JSON, no arguments (or not an object): left as text, as
    # vLLM's Hermes parser leaves them; no calls.
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "get_time", </tool_call>', "plain answer\n\n",
                 '<tool_call>{"name": "get_time"}</tool_call>',
                 '<tool_call>{"name": "get_time", "address": "Paris"}</tool_call>',
                 '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
                 '<tool_call>{"name": "get_time", "arguments": "[1]"}</tool_call>'):
        assert parse_tool_calls(text, names) == (text, [])
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "parameters": {}}', names)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    # What Python's JSON cannot take (depth, digits) is text; an escaped lone surrogate
    # stays escaped (written raw, the response could not be encoded).
    deep = "[" * 5000 + "]" * 5000
    for body in (deep, '{"name": "get_time", "arguments": ' + deep + "}",
                 '{"name": "get_time", "arguments": {"a": 1' + "0" * 5000 + "}}"):
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text, names) == (text, [])
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {"z": "\\ud800"}}',
                                names)
    assert calls[0].arguments == '{"z": "\\ud800"}'
    calls[0].arguments.encode("utf-8")
    # Cut off after the JSON (no end tag): still a call.
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}', names)
    assert [c.name for c in calls] == ["get_time"]


STREAMED_TEXTS = [
    ('Sure <tool_ okay.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}'
     '\n</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}'
     '</tool_call>'),
    # Text after a call, with whitespace inside it: each whitespace run between texts goes
    # out (a stream once dropped every whitespace-only piece after a call), the runs
    # around the calls do not.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n\n'
     "Then:\n'INSERT INTO t' \n  values (1);\n  \n<tool_call>{\"name\": \"get_weather\", "
     '"arguments": {}}</tool_call>\n  '),
    "  no call at all,\n  just text \n\n",
    'A <tool_call>{"name": "nope"}</tool_call> \n B \n',
    # Text on both sides of calls: the whitespace around them still separates the texts.
    ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "A"}}'
     '</tool_call>\n\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> '
     "Then I will sum up.\n"),
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", STREAMED_TEXTS)
def test_streamed_calls_equal_the_parsed_ones(seed, text):
    names = {"get_weather"}
    rng = random.Random(seed)
    stream, content = ToolCallStream(names), ""
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 6)
        piece, _ = stream.feed(text[pos:pos + step], final=pos + step >= len(text))
        content += piece
        pos += step
    want_content, want_calls = parse_tool_calls(text, names)
    assert [(c.name, c.arguments) for c in stream.calls] == [
        (c.name, c.arguments) for c in want_calls]
    assert content == ((want_content or "") if want_calls else text)


def test_hermes_prompt_for_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
    ]
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
              "{% endfor %}")
    out, variables = prompt_messages(messages, [WEATHER], chatml)
    assert variables == {}
    assert out[0]["content"].startswith("Be brief.\n\nYou are a function calling AI model")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert out[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    # A template that renders tools itself gets them, and the messages as they are.
    knows = "{% if tools %}{{ tools | tojson }}{% endif %}" + chatml
    assert prompt_messages(messages, [WEATHER], knows) == (messages, {"tools": [WEATHER]})


# ---- request schemas -----------------------------------------------------------------------


def _chat(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_unknown_fields_are_refused_and_documented_ones_accepted():
    with pytest.raises(ValueError, match="max_token"):
        CompletionRequest(prompt="x", max_token=5)
    with pytest.raises(ValueError, match="extra"):
        _chat(guided_foo=1)
    req = _chat(user="u", store=True, metadata={"k": "v"}, service_tier="auto",
                prompt_cache_key="p", safety_identifier="s",
                prediction={"type": "content", "content": "hello"})
    assert req.sampling_params() == _chat().sampling_params()
    with pytest.raises(ValueError, match="reasoning_effort is not supported"):
        _chat(reasoning_effort="low")
    with pytest.raises(ValueError, match="accepts text only"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])


def test_every_way_to_ask_for_structure_gives_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    want = StructuredOutputsParams(json=schema)
    assert _chat(response_format={"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema,
                                                  "strict": True}}).constraint() == want
    assert _chat(structured_outputs={"json": schema}).constraint() == want
    assert CompletionRequest(prompt="x", guided_json=schema).constraint() == want
    assert _chat(guided_choice=["a", "b"]).constraint() == StructuredOutputsParams(
        choice=("a", "b"))
    assert _chat(response_format={"type": "json_object"}).constraint() == \
        StructuredOutputsParams(json_object=True)
    assert _chat(response_format={"type": "text"}).constraint() is None
    with pytest.raises(ValueError, match="both constrain the output"):
        _chat(guided_regex="a", response_format={"type": "json_object"}).constraint()
    with pytest.raises(ValueError, match=r"response_format\.type 'xml' is not supported"):
        _chat(response_format={"type": "xml"}).constraint()
    with pytest.raises(GrammarError, match=r"^response_format\.json_schema\.schema: "):
        _chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"not": {}}}}).constraint()


def test_tool_choice_modes_and_legacy_functions():
    tools = [WEATHER, TIME]
    assert _chat(tools=tools).tool_setup()[1] == "auto"
    assert _chat(tools=tools, tool_choice="none").tool_setup()[1] is None
    assert _chat(tools=tools, tool_choice="required").tool_setup()[1] == "required"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert _chat(tools=tools, tool_choice=named).tool_setup()[1] == "get_time"
    with pytest.raises(ValueError, match="not among the tools"):
        _chat(tools=tools, tool_choice={"type": "function",
                                        "function": {"name": "nope"}}).tool_setup()
    with pytest.raises(ValueError, match="needs tools"):
        _chat(tool_choice="required").tool_setup()
    legacy = _chat(functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert legacy.tool_setup() == ([WEATHER], "get_weather") and legacy.legacy_functions
    with pytest.raises(ValueError, match="must be 1-64 letters"):
        _chat(tools=[{"type": "function", "function": {"name": "bad name"}}])


def test_no_effect_fields_are_declared_and_documented():
    """NO_EFFECT is the list README's field table must show, each a field a request takes."""
    from pathlib import Path

    from llmserve.server.protocol import NO_EFFECT

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    for name in NO_EFFECT:
        assert name in fields, name
        assert f"`{name}`" in readme, name


def test_a_grammar_that_fails_while_generating_is_reported(backend, smol_tokenizer):
    """llguidance builds its states lazily: a regex of a million repeats passes the checks
    when the request is made and gives up after a token or two; a schema that is only a
    reference to itself, at the first mask. The mask then allows only the end, and the
    failure is kept, once, for the engine to end the request as failed."""
    vocab = smol_tokenizer.vocab_size
    for constraint, reason in ((StructuredOutputsParams(regex="a{1000000}"), "lexer error"),
                               (StructuredOutputsParams(json={"$ref": "#"}), "NoExtension")):
        validate_structured(constraint)  # nothing to refuse up front
        for _ in range(20):
            allowed = _allowed(backend.masks([_item("g", constraint)])[0], vocab)
            if allowed <= smol_tokenizer.stop_token_ids:
                break
            backend.accept("g", [max(allowed)])  # within the grammar
        assert allowed <= smol_tokenizer.stop_token_ids
        failed = backend.take_failed()
        assert list(failed) == ["g"] and failed["g"].startswith(reason), failed
        assert "\n" not in failed["g"]  # the reason, without the matcher's state
        backend.masks([_item("g", constraint)])  # still failed: kept once
        assert backend.take_failed() == {}
        backend.free("g")
