"""Client mistakes end as OpenAI error objects (never a 500); auth; engine failure."""

import json

import pytest

from qserve.runtime.server import ServerLimits, create_app

from conftest import assert_error, client_for, run, sse_events

OK = {"prompt": [3, 4, 5], "max_tokens": 2}


@pytest.mark.parametrize("body, status, param, code", [
    ({"prompt": [3, 4], "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ({"prompt": [3, 4], "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"prompt": 5}, 400, "prompt", "invalid_type"),
    ({"max_tokens": 3}, 400, "prompt", "invalid_type"),
    ({"prompt": [3, 4], "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"prompt": [3, 4], "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"prompt": [3, 4], "top_k": 2**40}, 400, "top_k", "invalid_value"),
    ({"prompt": [3, 4], "presence_penalty": 3}, 400, "presence_penalty", "invalid_value"),
    ({"prompt": [3, 4], "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ({"prompt": [3, 4], "n": 17}, 400, "n", "invalid_value"),  # beyond --max-n (16)
    ({"prompt": [3, 4], "n": 0}, 400, "n", "invalid_value"),
    ({"prompt": [3, 4], "logit_bias": {"300": 5}}, 400, "logit_bias", "invalid_value"),
    ({"prompt": [3, 4], "logit_bias": {"dog": 5}}, 400, "logit_bias", "invalid_value"),
    ({"prompt": [3, 4], "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ({"prompt": [3, 4], "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ({"prompt": [3, 4], "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    ({"prompt": [3, 4], "guided_json": {"type": "object", "properties": {"a": {"not": {}}}}},
     400, "guided_json", "invalid_grammar"),
    ({"prompt": [3, 4], "guided_regex": "(a"}, 400, "guided_regex", "invalid_grammar"),
    ({"prompt": [3, 4], "guided_grammar": "root ::= ("}, 400, "guided_grammar",
     "invalid_grammar"),
    ({"prompt": [3, 4], "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs",
     "invalid_grammar"),
    ({"prompt": [3, 4], "guided_choice": []}, 400, "guided_choice", "invalid_grammar"),
    ({"prompt": [3, 4], "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice",
     "invalid_value"),
    ({"prompt": [3, 4], "structured_outputs": {"json": {}, "regex": "a"}}, 400,
     "structured_outputs", "invalid_value"),
    ({"prompt": [3, 4], "structured_outputs": {"whitespace_pattern": " "}}, 400,
     "structured_outputs.whitespace_pattern", "invalid_value"),
    ({"prompt": [3, 4], "guided_decoding_backend": "outlines"}, 400,
     "guided_decoding_backend", "unsupported_parameter"),
    ({"prompt": [3, 4], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"prompt": [3, 4], "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": [3, 4], "seed": 2**70}, 400, "seed", "invalid_value"),
    ({"prompt": [3, 400000]}, 400, "prompt", "invalid_value"),
    ({"prompt": [3, -1]}, 400, "prompt", "invalid_value"),
    ({"prompt": []}, 400, "prompt", "invalid_value"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),
    ({"prompt": [3, 4], "stop": ["a"] * 17}, 400, "stop", "invalid_value"),
    ({"prompt": [3, 4], "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"prompt": [3, 4], "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": [3] * 2000}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": [3] * 1000, "max_tokens": 100}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": [[3, 4]] * 65}, 413, "prompt", "too_many_prompts"),
])
def test_bad_completion_requests(app, body, status, param, code):
    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/completions", json=body)

    assert_error(run(main()), status, param, code)


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b"", b"\xff\xfe", b'{"prompt": NaN}',
                                 b'{"prompt": [3], "temperature": NaN}'])
def test_malformed_bodies(app, raw):
    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/completions", content=raw,
                                headers={"content-type": "application/json"})

    assert_error(run(main()), 400)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
     "messages.0"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]},
        {"role": "user", "content": "x"}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "nope"}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 5}}}}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions"),
    ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy"}}, "audio"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities"),
    ({"messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
    ({"messages": [{"role": "user", "content": "x"}], "service_tier": "priority"},
     "service_tier"),
])
def test_bad_chat_requests(app, body, param):
    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json=body)

    assert_error(run(main()), 400, param)


# "\ud800" is legal JSON but not Unicode text: no tokenizer takes it
@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udc80b"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "ok", "stop": "\\ud83d"}', "stop"),
    ("/v1/completions", b'{"prompt": "ok", "\\ud800": 1}', "\ud800"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_a_400_naming_where(app, path, raw, param):
    async def main():
        async with client_for(app) as c:
            bad = await c.post(path, content=raw, headers={"content-type": "application/json"})
            # a surrogate pair written as two escapes is one valid character
            good = await c.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", '
                                b'"max_tokens": 2}', headers={"content-type": "application/json"})
            return bad, good

    bad, good = run(main())
    err = assert_error(bad, 400, code="invalid_text")
    if param != "\ud800":
        assert err["param"] == param
    assert "surrogate" in err["message"]
    assert good.status_code == 200, good.text


def test_an_assistant_turn_may_come_without_content(app):
    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}, {"role": "assistant"},
                             {"role": "user", "content": "y"}], "max_tokens": 2})

    assert run(main()).status_code == 200


def test_too_many_messages_is_a_413(app):
    from qserve.runtime.server.protocol import MAX_MESSAGES

    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})

    assert_error(run(main()), 413, "messages", "too_many_items")


def test_unknown_route_and_method(app):
    async def main():
        async with client_for(app) as c:
            return await c.get("/v1/nothing"), await c.get("/v1/completions")

    missing, wrong_method = run(main())
    assert_error(missing, 404)
    assert_error(wrong_method, 405)


def test_body_size_limit(engine, lm):
    app = create_app(engine, lm.tokenizer, "tiny", limits=ServerLimits(max_body_bytes=1000))

    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/completions", json={"prompt": "x" * 2000})

    assert_error(run(main()), 413, code="request_too_large")


def test_api_key(engine, lm):
    app = create_app(engine, lm.tokenizer, "tiny", api_key="s3cret")

    async def main():
        async with client_for(app) as c:
            none = await c.post("/v1/completions", json=OK)
            wrong = await c.post("/v1/completions", json=OK,
                                 headers={"Authorization": "Bearer nope"})
            basic = await c.get("/v1/models", headers={"Authorization": "Basic s3cret"})
            good = await c.post("/v1/completions", json=OK,
                                headers={"Authorization": "Bearer s3cret"})
            models = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            health = await c.get("/health")
            return none, wrong, basic, good, models, health

    none, wrong, basic, good, models, health = run(main())
    for r in (none, wrong, basic):
        assert_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    assert good.status_code == 200 and models.status_code == 200
    assert models.json()["data"][0]["id"] == "tiny"
    assert health.status_code == 200


def test_engine_failure_mid_stream_then_keeps_serving(app, engine, monkeypatch):
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky)

    async def main():
        async with client_for(app) as c:
            stream = await c.post("/v1/completions", json={
                "prompt": [3, 4, 5], "max_tokens": 20, "ignore_eos": True, "stream": True})
            plain = await c.post("/v1/completions", json={
                "prompt": [3, 4, 5], "max_tokens": 20, "ignore_eos": True})
            return stream, plain

    stream, plain = run(main())
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "boom" in err["message"] and err["type"] == "server_error"
    assert plain.status_code == 200
    assert plain.json()["usage"]["completion_tokens"] == 20
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens_default", 0, "max_tokens_default must be a positive integer"),
    ("shutdown_drain_s", -1.0, "shutdown_drain_s must be >= 0"),
])
def test_server_limits_name_a_bad_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServerLimits(**{field: value})
