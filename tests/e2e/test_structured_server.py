"""Structured outputs and tool calling through a live server, driven by the clients users
run: the official openai package (parse() with pydantic, json_object, tool round trips) and
LangChain's ChatOpenAI (with_structured_output by each of its three methods, bind_tools)."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import API_KEY

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


# Strings bounded, as a schema for a small model should be (the grammar enforces maxLength:
# a 135M model otherwise sometimes rambles inside a string until max_tokens).
class Address(BaseModel):
    street: str = Field(max_length=60)
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    address: Address
    hobbies: list[Annotated[str, Field(max_length=30)]] = Field(max_length=3)


def _client(server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key or "none", max_retries=0, timeout=120)


# ---- a tiny model: the mechanics, fast ----------------------------------------------------


def test_a_grammar_that_gives_up_while_generating_fails_the_request(tiny_server):
    """llguidance builds a regex of a million repeats lazily and gives up after a token or
    two, past the checks made when the request arrived: the request fails (400, or an error
    event in a stream) with the grammar engine's reason, not a 200 whose text stops short
    of the constraint; and nothing is left running."""
    client = _client(tiny_server, API_KEY)
    kw = dict(model=tiny_server.model, prompt="x", max_tokens=20, temperature=0,
              extra_body={"guided_regex": "a{1000000}"})
    with pytest.raises(openai.BadRequestError, match=r"could not be enforced.*lexer error"
                       ) as refused:
        client.completions.create(**kw)
    assert refused.value.code == "grammar_too_complex"
    with pytest.raises(openai.APIError, match="could not be enforced") as failed:
        for _ in client.completions.create(stream=True, **kw):
            pass
    assert failed.value.code == "grammar_too_complex"
    for _ in range(2):  # the other requests go on, constrained or not
        out = client.completions.create(**{**kw, "extra_body": {"guided_regex": "a{3}"}})
        assert out.choices[0].text == "aaa"
    metrics = tiny_server.wait_idle()
    assert metrics["llmserve:num_requests_running"] == 0


def test_logprobs_of_tokens_the_grammar_forbids_are_finite_json(tiny_server):
    """A token the grammar forbids has logprob -inf, which JSON cannot hold: it goes out as
    -9999.0 (as OpenAI and vLLM send it), whole or streamed, in both endpoints' shapes."""
    client = _client(tiny_server, API_KEY)
    choice = {"guided_choice": ["red", "blue"]}
    out = client.completions.create(model=tiny_server.model, prompt="Pick a color:",
                                    max_tokens=5, temperature=0, logprobs=5, extra_body=choice)
    values = [v for row in out.choices[0].logprobs.top_logprobs for v in row.values()]
    assert -9999.0 in values and min(values) == -9999.0
    chat = client.chat.completions.create(model=tiny_server.model, messages=ASK, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body=choice)
    tops = [t.logprob for c in chat.choices[0].logprobs.content for t in c.top_logprobs]
    assert min(tops) == -9999.0

    def refuse(constant):
        raise AssertionError(f"{constant} in a streamed chunk")

    body = {"model": tiny_server.model, "prompt": "Pick a color:", "max_tokens": 5,
            "temperature": 0, "logprobs": 5, "stream": True, **choice}
    with httpx.stream("POST", f"{tiny_server.v1}/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    assert lines
    for line in lines:
        json.loads(line, parse_constant=refuse)


def test_tiny_json_schema_streamed_equals_whole(tiny_server):
    client = _client(tiny_server, API_KEY)
    kw = dict(model=tiny_server.model, messages=ASK, max_tokens=60, temperature=0,
              response_format={"type": "json_schema", "json_schema": {
                  "name": "pick", "schema": {"type": "object", "properties": {
                      "n": {"type": "integer", "minimum": 1, "maximum": 9},
                      "c": {"enum": ["x", "y"]}}, "required": ["n", "c"],
                      "additionalProperties": False}}})
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert set(json.loads(text)) == {"n", "c"} and whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # Completions take the vLLM extras: a choice, n > 1, a stop string inside the choice.
    out = client.completions.create(model=tiny_server.model, prompt="Pick:", max_tokens=10,
                                    n=3, temperature=1.0, seed=1,
                                    extra_body={"guided_choice": ["left", "right"]})
    assert {c.text for c in out.choices} <= {"left", "right"}
    out = client.completions.create(model=tiny_server.model, prompt="Pick:", max_tokens=10,
                                    stop=["gh"], temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["right"]}})
    assert out.choices[0].text == "ri"


def test_tiny_required_tool_call_always_parses(tiny_server):
    """Random weights left alone write anything: the grammar makes the call valid JSON
    with the function's parameters, every time."""
    client = _client(tiny_server, API_KEY)
    for seed in range(4):
        r = client.chat.completions.create(
            model=tiny_server.model, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
            tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed,
            extra_body={"top_k": 20})
        choice = r.choices[0]
        if choice.finish_reason == "length":
            continue  # a free string argument may run past max_tokens
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "get_time" and "zone" in args


# ---- the real model, as users run it -------------------------------------------------------


@pytest.mark.slow
def test_parse_with_a_nested_pydantic_model_ten_of_ten(real_server):
    client = _client(real_server)
    for seed in range(10):
        r = client.chat.completions.parse(
            model=real_server.model, response_format=Person, max_tokens=300, temperature=0.7,
            seed=seed, messages=[{"role": "user",
                                  "content": "Invent a person: name, age, address, hobbies."}])
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and isinstance(person.address, Address)


@pytest.mark.slow
def test_json_object(real_server):
    client = _client(real_server)
    r = client.chat.completions.create(
        model=real_server.model, response_format={"type": "json_object"}, max_tokens=150,
        temperature=0, messages=[{"role": "user",
                                  "content": "Give the capital of France as JSON."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON prefix of an object
        assert r.choices[0].message.content.startswith("{")


def _round_trip(client: openai.OpenAI, model: str, stream: bool, tool_choice) -> None:
    kw = dict(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
              max_tokens=80, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert len(calls) >= 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
        call_id, name, arguments = calls[0].id, calls[0].function.name, "".join(
            tc.function.arguments for tc in calls if tc.index == 0)
    else:
        r = client.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        call = r.choices[0].message.tool_calls[0]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish == "tool_calls"
    assert name == "get_weather"
    args = json.loads(arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and args["city"]
    # The answer goes back; the model now answers in words, with the call in its history.
    follow = client.chat.completions.create(
        model=model, max_tokens=40, temperature=0, tools=[WEATHER, TIME],
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]},
                  {"role": "tool", "tool_call_id": call_id,
                   "content": json.dumps({"temperature": 21, "sky": "sunny"})}],
        tool_choice="none")
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_round_trip(real_server, stream, choice):
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    _round_trip(_client(real_server), real_server.model, stream, tool_choice)


@pytest.mark.slow
def test_legacy_functions(real_server):
    client = _client(real_server)
    r = client.chat.completions.create(
        model=real_server.model, messages=ASK, functions=[WEATHER["function"]],
        function_call={"name": "get_weather"}, max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "function_call"
    assert r.choices[0].message.function_call.name == "get_weather"
    json.loads(r.choices[0].message.function_call.arguments)


# ---- LangChain ---------------------------------------------------------------------------


def _chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.model, base_url=server.v1, api_key="none", temperature=0,
                      max_tokens=300, max_retries=0, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(real_server, method):
    llm = _chat_model(real_server)
    if method == "json_mode":
        # json_mode sends no schema (the prompt must describe it): a dict comes back.
        schema = {"title": "Person", "type": "object",
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
        out = llm.with_structured_output(schema, method=method).invoke(
            "Return a JSON object with a person's name and age.")
        assert isinstance(out, dict)
        return
    out = llm.with_structured_output(Person, method=method).invoke(
        "Invent a person: name, age, address, hobbies.")
    assert isinstance(out, Person) and isinstance(out.address, Address)


@pytest.mark.slow
def test_langchain_bind_tools_round_trip(real_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Get the current weather of a city; unit is celsius or fahrenheit."""
        return f"21 degrees {unit} and sunny in {city}"

    llm = _chat_model(real_server)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    history = [HumanMessage("What is the weather like in Paris today?")]
    ai = bound.invoke(history)
    assert len(ai.tool_calls) >= 1 and ai.tool_calls[0]["name"] == "get_weather"
    call = ai.tool_calls[0]
    history += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert isinstance(answer.content, str)
    # Streamed: the tool call arrives as chunks LangChain assembles.
    chunks = list(bound.stream(history[:1]))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "get_weather"
