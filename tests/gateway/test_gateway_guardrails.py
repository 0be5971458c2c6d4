"""PII guardrails through the gateway: masked before the backend sees the input, blocked
with an OpenAI error, caught in output split across SSE chunks, restored when reversible."""

import json

import httpx
from gateway_harness import FakeBackend, running_gateway

MSG = "Write to bob@example.com about it."


def config(**guardrails):
    return {"backends": [{"name": "a", "models": ["m"]}],
            "groups": [{"name": "small", "backends": ["a"], "model": "m"}],
            "guardrails": guardrails}


def chat(url, content, stream=False):
    return httpx.post(url + "/v1/chat/completions",
                      json={"model": "small", "stream": stream,
                            "messages": [{"role": "user", "content": content}]})


def stream_text(resp) -> str:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: {") and '"choices"' in line:
            for c in json.loads(line[6:])["choices"]:
                out.append(c["delta"].get("content") or "")
    return "".join(out)


def test_input_pii_is_masked_before_the_backend_sees_it_and_blocked_entities_refused(tmp_path):
    backends = {"a": FakeBackend("a")}
    traces = tmp_path / "t.jsonl"
    cfg = config(input={"email": "mask", "card": "block"})
    with running_gateway(cfg, backends, trace_path=traces) as (url, _):
        assert chat(url, MSG).status_code == 200
        assert backends["a"].requests[0]["messages"][0]["content"] == \
            "Write to [EMAIL] about it."
        r = chat(url, "charge 4111 1111 1111 1111 please")
        assert r.status_code == 400 and r.json()["error"]["code"] == "pii_blocked"
        assert "4111" not in r.text
        assert len(backends["a"].requests) == 1           # never reached the backend
        metrics = httpx.get(url + "/metrics").text
    assert 'guardrail_actions_total{direction="input",entity="email",action="mask"} 1' in metrics
    raw = traces.read_text()
    assert "bob@example.com" not in raw and "4111 1111" not in raw
    rows = [json.loads(line) for line in raw.splitlines()]
    assert rows[0]["guardrails"] == {"input.email.mask": 1}


def test_output_pii_split_across_chunks_is_masked_in_streams_and_bodies():
    words = ["Call ", "+1 415", " 555 ", "2671", " or mail ", "ann@exa", "mple.org", "."]
    backends = {"a": FakeBackend("a", words=words)}
    with running_gateway(config(output={"phone": "mask", "email": "mask"}),
                         backends) as (url, _):
        r = chat(url, "contact?", stream=True)
        assert stream_text(r) == "Call [PHONE] or mail [EMAIL]."
        r = chat(url, "contact?")
        assert r.json()["choices"][0]["message"]["content"] == "Call [PHONE] or mail [EMAIL]."


def test_a_blocked_output_entity_ends_the_stream_with_an_error_event():
    words = ["Your card: ", "4111 1111 ", "1111 1111", " ok"]
    backends = {"a": FakeBackend("a", words=words)}
    with running_gateway(config(output={"card": "block"}), backends) as (url, _):
        r = chat(url, "card?", stream=True)
        assert "4111" not in r.text
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "pii_blocked"
        assert events[-1] == "[DONE]"
        r = chat(url, "card?")
        assert r.status_code == 422 and "4111" not in r.text


def test_reversible_masking_restores_the_values_in_the_response():
    # the backend answers with the placeholder it was sent, split across chunks
    words = ["I will write to ", "[EMA", "IL_1", "] today."]
    backends = {"a": FakeBackend("a", words=words)}
    cfg = config(input={"email": "mask"}, reversible=True)
    with running_gateway(cfg, backends) as (url, _):
        r = chat(url, MSG, stream=True)
        assert backends["a"].requests[0]["messages"][0]["content"] == \
            "Write to [EMAIL_1] about it."
        assert stream_text(r) == "I will write to bob@example.com today."
        r = chat(url, MSG)
        assert r.json()["choices"][0]["message"]["content"] == \
            "I will write to bob@example.com today."
