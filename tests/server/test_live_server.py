"""`qserve serve` as a real process on a loopback port, driven by the official openai client."""

import subprocess
import time

import pytest
from live_server import LiveServer

from qserve.runtime.sampling_params import SamplingParams

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(tiny_dir):
    with LiveServer(tiny_dir, api_key="k3y") as live:
        yield live.base
    assert f"serving at {live.base}/v1" in live.output


def test_openai_client_against_live_server(server, lm, reference):
    client = openai.OpenAI(base_url=server + "/v1", api_key="k3y", max_retries=0)
    prompt = "The quick brown fox"
    want = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                       ignore_eos=True))[0].text
    extra = {"ignore_eos": True}

    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body=extra)
    assert c.choices[0].text == want and c.usage.completion_tokens == 8
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True, extra_body=extra,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 8

    msgs = [{"role": "user", "content": "hi there"}]
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    want_chat = reference.generate([ids], SamplingParams(max_tokens=6, temperature=0,
                                                         ignore_eos=True))[0].text
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                       temperature=0, extra_body=extra)
    assert r.choices[0].message.content == want_chat
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
        extra_body=extra)]
    assert "".join(parts) == want_chat

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-x", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="a", max_tokens=1, top_p=3)


def test_lm_eval_remote_tokenizer(server, lm):
    utils = pytest.importorskip("lm_eval.utils")
    tok = utils.RemoteTokenizer(server + "/v1/completions")
    text = "The quick brown fox"
    assert tok.encode(text) == lm.tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 1


def _read_stream(resp) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("drain_s, ends", [("30", "finish"), ("0", "error")])
def test_sigterm_lets_streams_end_then_exits_zero(tiny_dir, drain_s, ends):
    """SIGTERM mid-stream: new connections are refused; a running stream finishes within
    the drain time, or past it ends with an error event; both end with [DONE]; exit 0."""
    import json
    import threading

    args = [*LiveServer.TINY_ARGS, "--shutdown-drain-s", drain_s]
    args[args.index("--kv-cache-gib") + 1] = "0.05"  # room for the whole context
    body = {"prompt": [3, 4, 5], "max_tokens": 40 if ends == "finish" else 500,
            "ignore_eos": True, "stream": True}
    with LiveServer(tiny_dir, args=args) as live:
        events, started = [], threading.Event()

        def stream():
            with httpx.stream("POST", live.base + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        live.proc.send_signal(subprocess.signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):
            httpx.get(live.base + "/health", timeout=5)
        reader.join(60)
        assert live.proc.wait(60) == 0
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if ends == "finish":
        assert last["choices"][0]["finish_reason"] == "length"
    else:
        assert last["error"]["code"] == "server_shutting_down"
