"""Structured outputs, tool calls, n and logit_bias through the HTTP API, driven by the
official `openai` client (in process, over ASGI) against the tiny model. The tiny model is
random, so what it writes is nonsense: these tests check that the constraints hold and
that the wire format is what the client parses. tests/server/test_agents_real.py runs the
same against real models."""

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from conftest import client_for, run, sse_events


def _openai(app):
    import httpx
    import openai

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)
    return openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    ok: bool


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _args_valid(call, tools=(WEATHER, TIME)):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_parse_returns_a_validated_pydantic_object(app):
    async def main():
        client = _openai(app)
        return await client.chat.completions.parse(
            model="tiny", messages=ASK, response_format=Person, temperature=0,
            max_completion_tokens=60)

    done = run(main())
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and done.choices[0].finish_reason == "stop"
    assert json.loads(done.choices[0].message.content) == person.model_dump()


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_streamed_and_not(app, stream):
    schema = Person.model_json_schema()
    body = {"model": "tiny", "messages": ASK, "max_tokens": 60, "temperature": 0.8, "seed": 4,
            "stream": stream, "n": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": schema}}}

    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json=body)

    resp = run(main())
    assert resp.status_code == 200, resp.text
    texts = {}
    if stream:
        for e in sse_events(resp.text):
            if e != "[DONE]":
                for ch in json.loads(e)["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + (
                        ch["delta"].get("content") or "")
    else:
        texts = {ch["index"]: ch["message"]["content"] for ch in resp.json()["choices"]}
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)


def test_n_with_seed_is_reproducible_and_counts_the_prompt_once(app):
    async def main():
        client = _openai(app)
        kw = dict(model="tiny", messages=ASK, max_tokens=10, temperature=1.0, seed=9, n=3,
                  logprobs=True)
        return (await client.chat.completions.create(**kw),
                await client.chat.completions.create(**kw),
                await client.chat.completions.create(**dict(kw, n=1, seed=10)))

    a, b, single = run(main())
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1
    assert single.choices[0].message.content == texts[1]  # sample i draws with seed + i
    assert a.usage.prompt_tokens == single.usage.prompt_tokens  # counted once, not 3 times
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_required_and_named_tool_choice_give_valid_calls(app, choice):
    async def main():
        client = _openai(app)
        return await client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
            temperature=0.9, seed=1, n=2, max_tokens=120, parallel_tool_calls=False)

    done = run(main())
    for c in done.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            _args_valid(call)
            assert call.id.startswith("call_")
            if isinstance(choice, dict):
                assert call.function.name == "get_time"


def test_tool_calls_stream_as_deltas_and_equal_the_whole_response(app):
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
              temperature=0, max_tokens=120, parallel_tool_calls=False)

    async def main():
        client = _openai(app)
        whole = await client.chat.completions.create(**kw)
        calls, finish, first = {}, None, []
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    if d.id:
                        first.append(d)
                        calls[d.index] = {"name": d.function.name, "arguments": ""}
                    calls[d.index]["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        return whole, calls, finish, first

    whole, calls, finish, first = run(main())
    assert finish == "tool_calls" and len(calls) == 1  # parallel_tool_calls=False: one
    assert first[0].type == "function" and first[0].function.arguments == ""
    got = whole.choices[0].message.tool_calls[0]
    assert calls[0] == {"name": got.function.name, "arguments": got.function.arguments}
    _args_valid(got)


def test_a_tool_round_trip_with_the_result_in_the_history(app):
    async def main():
        client = _openai(app)
        first = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
            temperature=0, max_tokens=200, parallel_tool_calls=False)
        call = first.choices[0].message.tool_calls[0]
        history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        second = await client.chat.completions.create(
            model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
            temperature=0, max_tokens=8)
        return first, second

    first, second = run(main())
    assert first.choices[0].finish_reason == "tool_calls"
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"


def test_auto_tool_choice_without_a_call_is_plain_content(app, engine):
    """`auto` leaves text free (tests/runtime/test_tools.py checks that a call it begins is
    held to the grammar; tests/server/test_agents_real.py sees real models call)."""
    lt = str(engine.engine.tokenizer.encode("<", add_special_tokens=False)[0])

    async def main():
        client = _openai(app)
        return await client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=6,
            logit_bias={lt: -100})

    plain = run(main()).choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    assert plain.finish_reason == "length"


def test_completions_with_vllm_guided_fields(app):
    async def main():
        async with client_for(app) as c:
            out = {}
            for name, value in [("guided_regex", "[a-c]{3}-[0-9]{2}"),
                                ("guided_choice", ["left", "right"]),
                                ("guided_json", {"type": "object", "properties": {
                                    "k": {"type": "integer", "minimum": 0, "maximum": 9}},
                                    "required": ["k"]}),
                                ("structured_outputs", {"regex": "x[0-9]"})]:
                r = await c.post("/v1/completions", json={
                    "prompt": "answer:", "max_tokens": 30, "temperature": 0.7, "seed": 2,
                    "n": 2, name: value})
                out[name] = r.json()
            return out

    import re

    out = run(main())
    texts = {k: [ch["text"] for ch in v["choices"]] for k, v in out.items()}
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", t) for t in texts["guided_regex"])
    assert all(t in ("left", "right") for t in texts["guided_choice"])
    assert all(0 <= json.loads(t)["k"] <= 9 for t in texts["guided_json"])
    assert all(re.fullmatch(r"x[0-9]", t) for t in texts["structured_outputs"])


def test_max_tokens_inside_the_grammar_says_so(app):
    async def main():
        async with client_for(app) as c:
            return (await c.post("/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 3, "response_format": {
                    "type": "json_schema", "json_schema": {
                        "name": "p", "schema": Person.model_json_schema()}}})).json()

    ch = run(main())["choices"][0]
    assert ch["finish_reason"] == "length" and ch["grammar_incomplete"] is True


def test_logit_bias_through_the_client(app, engine):
    token = 77
    text = engine.engine.tokenizer.decode([token])

    async def main():
        client = _openai(app)
        return await client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                               temperature=0, logit_bias={str(token): 100})

    assert run(main()).choices[0].text == text * 4
