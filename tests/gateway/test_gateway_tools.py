"""Tool calls and structured outputs through the gateway in front of a real qserve server
(the tiny model with a chat template, in a thread): calls pass through streamed and not,
a temperature-0 tool-call answer is cached and replayed with its calls (as a body and as
a stream), the output guardrails mask PII inside a call's arguments, and a JSON-schema
answer passes through valid."""

import json
import sys
import types
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from gateway_harness import running_gateway

from qserve.runtime.async_engine import AsyncEngine
from qserve.runtime.engine import EngineConfig, LLMEngine
from qserve.runtime.loaded_model import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
            "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
# the only argument value the schema allows is an email address: the model must write it
MAIL = {"type": "function", "function": {"name": "send_mail", "parameters": {
    "type": "object", "properties": {"to": {"enum": ["bob@example.com"]},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["to", "n"]}}}
CALL = {"model": "small", "messages": [{"role": "user", "content": "mail bob"}],
        "tools": [MAIL], "tool_choice": "required", "parallel_tool_calls": False,
        "temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def qserve_backend(tmp_path_factory):
    from qserve.runtime.server import create_app

    torch.set_num_threads(1)
    root = write_tiny_llama(tmp_path_factory.mktemp("gw-tools") / "tiny")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=TEMPLATE)))
    lm = load(str(root), torch.float32)
    engine = AsyncEngine(LLMEngine.from_model(lm, EngineConfig(
        num_kv_blocks=64, kv_dtype="bf16", max_num_batched_tokens=64, decode_impl="eager")))
    yield types.SimpleNamespace(app=create_app(engine, lm.tokenizer, "m"))
    engine.shutdown()


def _config(**extra):
    return {"backends": [{"name": "q", "models": ["m"]}],
            "groups": [{"name": "small", "backends": ["q"], "model": "m"}], **extra}


def _streamed_calls(text: str) -> tuple[dict, str | None]:
    calls, finish = {}, None
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:]).get("choices") or []:
            for d in (c.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += d.get("function", {}).get("name") or ""
                call["arguments"] += d.get("function", {}).get("arguments") or ""
            finish = c.get("finish_reason") or finish
    return calls, finish


def test_tool_calls_pass_through_and_are_cached_with_their_calls(qserve_backend):
    cfg = _config(cache={"enabled": True})
    with running_gateway(cfg, {"q": qserve_backend}) as (url, _):
        first = httpx.post(url + "/v1/chat/completions", json=CALL, timeout=60)
        again = httpx.post(url + "/v1/chat/completions", json=CALL, timeout=60)
        streamed = httpx.post(url + "/v1/chat/completions", json=dict(CALL, stream=True),
                              timeout=60)
        other = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(
            CALL, tools=[dict(MAIL, function=dict(MAIL["function"], name="send"))]))
    body = first.json()
    assert "tool_calls" in body["choices"][0]["message"], body
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert call["function"]["name"] == "send_mail"
    assert json.loads(call["function"]["arguments"])["to"] == "bob@example.com"
    assert again.headers.get("x-qserve-cache") == "hit"
    assert again.json()["choices"][0]["message"]["tool_calls"] == [call]
    calls, finish = _streamed_calls(streamed.text)  # the cached answer, replayed as a stream
    assert streamed.headers.get("x-qserve-cache") == "hit"
    assert calls == {0: {"name": "send_mail", "arguments": call["function"]["arguments"]}}
    assert finish == "tool_calls"
    assert other.headers.get("x-qserve-cache") != "hit"  # other tools: another answer
    assert other.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "send"


@pytest.mark.parametrize("stream", [False, True])
def test_output_guardrails_mask_pii_inside_tool_arguments(qserve_backend, stream):
    cfg = _config(guardrails={"output": {"email": "mask"}})
    with running_gateway(cfg, {"q": qserve_backend}) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=dict(CALL, stream=stream),
                       timeout=60)
    assert "bob@example.com" not in r.text
    if stream:
        calls, finish = _streamed_calls(r.text)
        args = calls[0]["arguments"]
    else:
        args = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args)["to"] == "[EMAIL]"


def test_a_json_schema_answer_passes_through_valid(qserve_backend):
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["k"]}
    with running_gateway(_config(), {"q": qserve_backend}) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "small", "messages": [{"role": "user", "content": "k?"}], "n": 2,
            "temperature": 0.8, "seed": 3, "max_tokens": 20, "response_format": {
                "type": "json_schema", "json_schema": {"name": "k", "schema": schema}}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
