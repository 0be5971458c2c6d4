"""Agents and structured-output clients against the real built-in models, in process: the
official `openai` client's `parse`, a tool round trip streamed and not, and the OpenAI
Agents SDK running an agent whose tool qserve's model calls. fp32 bf16-source weights,
CPU, greedy."""

import asyncio
import json

import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field

from conftest import client_for, sse_events
from qserve.runtime.async_engine import AsyncEngine
from qserve.runtime.engine import EngineConfig, LLMEngine
from qserve.runtime.loaded_model import load

pytestmark = pytest.mark.real_model

CONFIG = EngineConfig(num_kv_blocks=256, kv_dtype="bf16", max_num_batched_tokens=512)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float = Field(ge=0, le=100)


def _app(lm):
    from qserve.runtime.server import create_app

    engine = AsyncEngine(LLMEngine.from_model(lm, CONFIG))
    return engine, create_app(engine, lm.tokenizer, "m")


def _client(app):
    import httpx
    import openai

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=300)
    return openai.AsyncOpenAI(api_key="none", base_url="http://t/v1", http_client=http)


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def served(request):
    torch.set_num_threads(2)
    path = request.getfixturevalue({"smollm2": "smollm2_dir", "qwen": "qwen_coder_dir"}
                                   [request.param])
    engine, app = _app(load(str(path), torch.float32))
    yield request.param, app
    engine.shutdown()


def test_parse_gives_a_validated_object(served):
    _, app = served

    async def main():
        return await _client(app).chat.completions.parse(
            model="m", response_format=City, temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": "Describe Paris as JSON: its name, "
                                                  "country and population in millions."}])

    done = asyncio.run(main())
    city = done.choices[0].message.parsed
    assert isinstance(city, City), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(served, stream):
    """The model calls the tool (required on the first turn), gets its result in a tool
    message, and answers in text. SmolLM2 (135M) repeats a call for as long as it may, so
    it is given one call a turn (parallel_tool_calls false)."""
    name, app = served
    parallel = name != "smollm2"

    async def first_turn():
        if not stream:
            r = await _client(app).chat.completions.create(
                model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                temperature=0, max_tokens=80, parallel_tool_calls=parallel)
            return r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
        async with client_for(app) as c:
            r = await c.post("/v1/chat/completions", json={
                "model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                "temperature": 0, "max_tokens": 80, "stream": True,
                "parallel_tool_calls": parallel})
        calls, finish = {}, None
        for e in sse_events(r.text):
            if e == "[DONE]":
                continue
            ch = json.loads(e)["choices"][0]
            for d in ch["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += d["function"].get("name") or ""
                call["function"]["arguments"] += d["function"].get("arguments") or ""
            finish = ch["finish_reason"] or finish
        return {"role": "assistant", "tool_calls": [calls[i] for i in sorted(calls)]}, finish

    async def main():
        message, finish = await first_turn()
        call = message["tool_calls"][0]
        history = ASK + [message, {"role": "tool", "tool_call_id": call["id"],
                                   "content": "Sunny, 21 degrees celsius."}]
        answer = await _client(app).chat.completions.create(
            model="m", messages=history, tools=[WEATHER], temperature=0, max_tokens=60)
        return message, finish, answer.choices[0]

    message, finish, answer = asyncio.run(main())
    assert finish == "tool_calls"
    call = message["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    assert answer.message.content and not answer.message.tool_calls


def test_openai_agents_sdk_runs_a_tool_calling_agent(served):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner,
                        function_tool, set_tracing_disabled)

    name, app = served
    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees celsius in {city}."

    agent = Agent(name="assistant", instructions="You answer questions about the weather. "
                  "Use the get_weather tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="m", openai_client=_client(app)),
                  # the first turn must call a tool; the SDK then resets it to auto
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=80,
                                               parallel_tool_calls=name != "smollm2"))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert seen and all(isinstance(c, str) and c for c in seen)
    assert isinstance(result.final_output, str) and result.final_output.strip()
