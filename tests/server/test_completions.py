"""/v1/completions: exact greedy output against LLM, streaming, usage, echo scoring."""

import json

import torch

from qserve.runtime.attention import AttentionMetadata, ContiguousCacheAttention
from qserve.runtime.sampler import prompt_logprobs
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.server.logprobs import token_text

from conftest import client_for, run, sse_events

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def _ref(reference, prompt, **kw):
    params = SamplingParams(**{**GREEDY, **kw})
    return reference.generate([prompt], params)[0]


def test_non_streaming_matches_llm(app, lm, reference):
    prompt = "The quick brown fox"
    expected = _ref(reference, prompt)

    async def main():
        async with client_for(app) as c:
            return (await c.post("/v1/completions",
                                 json={"model": "tiny", "prompt": prompt, "logprobs": 0,
                                       **GREEDY})).json()

    body = run(main())
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [token_text(lm.tokenizer, t)
                                            for t in expected.token_ids]
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    ids = lm.tokenizer.encode(prompt)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8,
                             "total_tokens": len(ids) + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_streaming_matches_llm_with_usage_chunk(app, reference):
    prompt = [5, 17, 42, 99, 7]
    expected = _ref(reference, prompt, max_tokens=10)

    async def main():
        async with client_for(app) as c:
            r = await c.post("/v1/completions", json={
                "prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
                **GREEDY, "max_tokens": 10})
            return r

    r = run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["prompt_tokens"] == 5
    text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
    assert text == expected.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-2])


def test_batch_of_prompts_each_matches(app, reference):
    prompts = [[3, 4, 5, 6], [10, 11, 12], [200, 100, 50, 25, 12]]
    expected = [_ref(reference, p).text for p in prompts]

    async def main():
        async with client_for(app) as c:
            return (await c.post("/v1/completions", json={"prompt": prompts, **GREEDY})).json()

    body = run(main())
    got = {ch["index"]: ch["text"] for ch in body["choices"]}
    assert [got[i] for i in range(3)] == expected
    assert body["usage"]["completion_tokens"] == 24


def test_stop_string_and_seeded_sampling(app, reference):
    prompt = [3, 4, 5, 6]
    full = _ref(reference, prompt, max_tokens=12).text
    stop = full[3:5]
    cut = full[:full.index(stop)]
    sampled = dict(prompt=prompt, max_tokens=12, temperature=1.0, top_k=50, seed=1234,
                   ignore_eos=True)

    async def main():
        async with client_for(app) as c:
            a = (await c.post("/v1/completions", json={
                "prompt": prompt, **GREEDY, "max_tokens": 12, "stop": [stop]})).json()
            s1 = (await c.post("/v1/completions", json=sampled)).json()
            s2 = (await c.post("/v1/completions", json=sampled)).json()
            return a, s1, s2

    a, s1, s2 = run(main())
    assert a["choices"][0]["text"] == cut
    assert a["choices"][0]["finish_reason"] == "stop"
    assert a["choices"][0]["stop_reason"] == stop
    assert s1["choices"][0]["text"] == s2["choices"][0]["text"]


def _dense_prompt_logprobs(lm, ids, k):
    with torch.inference_mode():
        hidden = lm.model(torch.tensor(ids), torch.arange(len(ids)),
                          AttentionMetadata.single(len(ids)), ContiguousCacheAttention())
        logits = lm.model.compute_logits(hidden)  # [T, V] fp32
    return prompt_logprobs(logits, ids, k)


def test_echo_logprobs_scores_the_prompt(app, lm, reference):
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    dense = _dense_prompt_logprobs(lm, ids, 1)  # bf16 KV in the engine: not bit-equal
    ref = reference.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]

    async def main():
        async with client_for(app) as c:
            zero = (await c.post("/v1/completions", json={
                "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
                "temperature": 0})).json()
            # lm-eval's local-completions loglikelihood request
            one = (await c.post("/v1/completions", json={
                "prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1,
                "temperature": 0, "seed": 1234})).json()
            return zero, one

    zero, one = run(main())
    ch = zero["choices"][0]
    assert ch["text"] == lm.tokenizer.decode(ids, skip_special_tokens=False)
    assert ch["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    lp = ch["logprobs"]
    assert lp["tokens"] == [token_text(lm.tokenizer, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [e.logprob for e in ref.prompt_logprobs[1:]]
    for got, want, top in zip(lp["token_logprobs"][1:], dense[1:], lp["top_logprobs"][1:]):
        assert abs(got - want.logprob) < 1e-2
        assert len(top) in (1, 2)  # the prompt token and the top alternative
        assert max(top.values()) >= got
    lp1 = one["choices"][0]["logprobs"]
    assert len(lp1["token_logprobs"]) == len(ids) + 1
    assert lp1["token_logprobs"][:-1] == lp["token_logprobs"]
    assert one["choices"][0]["text"].startswith(ch["text"])
    # the generated (greedy) token is the most likely one
    assert lp1["token_logprobs"][-1] == max(lp1["top_logprobs"][-1].values())
