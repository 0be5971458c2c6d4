"""/v1/chat/completions: template, greedy output against LLM, streaming, logprobs."""

import dataclasses
import json

from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.server import create_app

from conftest import assert_error, client_for, run, sse_events

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "The quick"},
                                          {"type": "text", "text": " brown fox"}]}]


def _expected(lm, reference, max_tokens=8):
    text = lm.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "The quick brown fox"}])
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    out = reference.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True, logprobs=2))[0]
    return ids, out


def test_chat_non_streaming_matches_llm(app, lm, reference):
    ids, expected = _expected(lm, reference)

    async def main():
        async with client_for(app) as c:
            return (await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": MESSAGES, "max_completion_tokens": 8,
                "temperature": 0, "ignore_eos": True, "logprobs": True,
                "top_logprobs": 2})).json()

    body = run(main())
    assert body["object"] == "chat.completion"
    ch = body["choices"][0]
    assert ch["message"] == {"role": "assistant", "content": expected.text, "refusal": None}
    assert ch["finish_reason"] == "length"
    content = ch["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [lp.logprob for lp in expected.logprobs]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 8


def test_chat_streaming_matches_llm(app, lm, reference):
    _, expected = _expected(lm, reference, 6)

    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}})

    events = sse_events(run(main()).text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == expected.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_model_without_template_is_told_to_use_completions(engine, lm):
    tok = dataclasses.replace(lm.tokenizer, chat_template=None)
    app = create_app(engine, tok, "tiny")

    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}]})

    err = assert_error(run(main()), 400, "messages", "chat_template_missing")
    assert "/v1/completions" in err["message"]
