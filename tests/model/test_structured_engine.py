"""Structured outputs in the engine, on a tiny random-weight model: random weights are the
adversary (left alone they write anything), so every output matching its constraint is
the grammar's doing. Batched output equals each request alone, and speculative decoding
changes nothing."""

from __future__ import annotations

import json
import re

import pytest

from llmserve.engine.llm import LLM
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["red", "green", "blue"]},
                         "ok": {"type": "boolean"}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ("alpha", "beta gamma", "delta")


def _requests() -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(12):
        prompt = [(i * 37 + j * 11) % 4000 + 100 for j in range(5 + i)]
        kind = i % 4
        constraint = [StructuredOutputsParams(json=SCHEMA),
                      StructuredOutputsParams(regex=PHONE),
                      StructuredOutputsParams(choice=CHOICES), None][kind]
        sampling = dict(temperature=0) if i % 3 == 0 else dict(temperature=1.0, seed=i,
                                                               top_k=50)
        out.append((prompt, SamplingParams(max_tokens=40, structured_outputs=constraint,
                                           **sampling)))
    return out


def _check(constraint: StructuredOutputsParams | None, text: str, finish: str) -> None:
    if constraint is None:
        return
    assert finish == "stop", (constraint, text)
    if constraint.json is not None:
        obj = json.loads(text)
        assert set(obj) == {"id", "tag", "ok"} and 0 <= obj["id"] <= 999
        assert obj["tag"] in ("red", "green", "blue") and isinstance(obj["ok"], bool)
    elif constraint.regex is not None:
        assert re.fullmatch(PHONE, text), text
    else:
        assert text in CHOICES


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa")[0])


def _run(llm: LLM, requests, alone: bool):
    if alone:
        return [llm.generate([p], s)[0].outputs[0] for p, s in requests]
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests])
    return [o.outputs[0] for o in outs]


def test_every_output_matches_and_batching_changes_nothing(tiny):
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=256)
    requests = _requests()
    batched = _run(llm, requests, alone=False)
    for (_, s), out in zip(requests, batched):
        _check(s.structured_outputs, out.text, out.finish_reason)
    alone = _run(llm, requests, alone=True)
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]


def test_speculative_decoding_keeps_constrained_output_identical(tiny):
    """Drafts are verified against per-position masks: the output is the same token for
    token as without speculation."""
    requests = _requests()
    want = _run(LLM(tiny, max_model_len=512, num_kv_blocks=256), requests, alone=False)
    spec = LLM(tiny, max_model_len=512, num_kv_blocks=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    from tests.model.test_speculative import speculate_always

    speculate_always(spec.engine.speculator)  # verify every proposal found
    got = _run(spec, requests, alone=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.engine.stats().spec_draft_tokens > 0


def test_a_constrained_request_with_logprobs_and_n(tiny):
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=256)
    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=3, logprobs=2,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = llm.generate([[101, 102, 103]], params)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.text in CHOICES and len(c.logprobs) == len(c.token_ids)


def test_a_grammar_that_gives_up_fails_its_request_alone(tiny):
    """A constraint llguidance gives up on while generating (n = 2: both sequences) ends
    as failed, its blocks freed; requests batched with it are unchanged."""
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=256)
    requests = _requests()
    want = _run(llm, requests, alone=False)
    bad = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=1,
                         structured_outputs=StructuredOutputsParams(regex="a{1000000}"))
    with pytest.raises(ValueError, match="could not be enforced"):
        llm.generate([[101, 102]], bad)
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished()
    core = llm.engine
    core.add_request("bad", [101, 102], bad)
    for i, (prompt, params) in enumerate(requests):
        core.add_request(f"ok-{i}", prompt, params)
    tokens, ended, failed = {}, set(), []
    while core.has_unfinished():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ended.add(o.request_id)
        failed += core.take_failed()
    assert [f.request_id for f in failed] == ["bad"] and "bad" not in ended
    assert failed[0].code == "grammar_too_complex"
    assert [tokens[f"ok-{i}"] for i in range(len(requests))] == [o.token_ids for o in want]
    assert core.stats().kv_blocks_used == 0
