"""Circuit breaker, backoff, rate limits, routing and the cache key, on a driven clock."""

import random

import pytest

from qserve.runtime.gateway.backend import Backend, ModelVersion
from qserve.runtime.gateway.backoff import backoff_delay, parse_retry_after
from qserve.runtime.gateway.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from qserve.runtime.gateway.config import (ApiKey, CircuitConfig, KeyLimits, RetryConfig,
                                           parse_config)
from qserve.runtime.gateway.rate_limiter import RateLimited, RateLimiter, TooLarge
from qserve.runtime.gateway.response_cache import ResponseCache, cache_key
from qserve.runtime.gateway.config import CacheConfig
from qserve.runtime.gateway.routing import Router, UnknownModel


def test_circuit_opens_after_n_failures_in_the_window_and_half_opens_after_cooldown():
    br = CircuitBreaker(CircuitConfig(failures=3, window=10, cooldown=5))
    br.record(False, 0.0)
    br.record(False, 1.0)
    br.record(False, 11.5)          # both earlier ones have left the 10 s window
    assert br.current(11.5) == CLOSED and len(br.failures) == 1
    br.record(False, 12.0)
    assert br.current(12.0) == CLOSED
    br.record(False, 13.0)          # 3 within 10 s
    assert br.current(13.0) == OPEN and not br.allow(17.9)
    assert br.current(18.0) == HALF_OPEN
    assert br.allow(18.0) and not br.allow(18.1)    # one trial at a time
    br.record(False, 18.2)                           # the trial failed: open again
    assert br.current(18.2) == OPEN and br.current(23.2) == HALF_OPEN
    assert br.allow(23.2)
    br.record(True, 23.3)
    assert br.current(23.3) == CLOSED and len(br.failures) == 0


def test_a_cancelled_half_open_trial_frees_the_trial_slot():
    br = CircuitBreaker(CircuitConfig(failures=1, window=10, cooldown=1))
    br.record(False, 0.0)
    assert br.allow(1.0) and not br.allow(1.0)
    br.release(1.1)
    assert br.allow(1.2)


def test_full_jitter_stays_under_the_capped_exponential():
    cfg = RetryConfig(base_delay=0.1, max_delay=0.5)
    rng = random.Random(0)
    for attempt, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.5), (10, 0.5)]:
        ds = [backoff_delay(cfg, attempt, rng) for _ in range(200)]
        assert 0 <= min(ds) and max(ds) <= cap and max(ds) > cap * 0.8


def test_retry_after_reads_seconds_and_http_dates():
    from datetime import datetime, timezone
    now = datetime(2026, 1, 1, 0, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Thu, 01 Jan 2026 00:00:07 GMT", now) == 7.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def key(**limits):
    return ApiKey("team", "sk", None, KeyLimits(**limits))


def test_requests_per_minute_is_an_exact_sliding_window():
    rl = RateLimiter((key(requests_per_minute=3),))
    grants = [rl.admit("team", 1, t) for t in (0.0, 10.0, 20.0)]
    for g in grants:
        rl.settle(g, None)
    with pytest.raises(RateLimited) as e:
        rl.admit("team", 1, 59.0)
    assert e.value.retry_after == pytest.approx(1.0)
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.headers["x-ratelimit-limit-requests"] == "3"
    g = rl.admit("team", 1, 60.0)      # the first left the window at exactly 60 s
    assert g.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimited):
        rl.admit("team", 1, 69.9)
    rl.admit("team", 1, 70.0)


def test_tokens_per_minute_reserve_the_estimate_and_settle_to_the_usage():
    rl = RateLimiter((key(tokens_per_minute=1000),))
    g1 = rl.admit("team", 600, 0.0)
    with pytest.raises(RateLimited) as e:
        rl.admit("team", 500, 1.0)
    assert e.value.retry_after == pytest.approx(59.0)
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "400"
    rl.settle(g1, 100)             # it used 100: 500 given back
    g2 = rl.admit("team", 500, 2.0)
    assert g2.headers["x-ratelimit-remaining-tokens"] == "400"
    with pytest.raises(TooLarge, match="more than key 'team'"):
        rl.admit("team", 1001, 3.0)


def test_concurrent_requests_are_capped_and_released_once():
    rl = RateLimiter((key(concurrent=2),))
    a, b = rl.admit("team", 1, 0.0), rl.admit("team", 1, 0.0)
    with pytest.raises(RateLimited, match="2 requests in flight"):
        rl.admit("team", 1, 0.0)
    rl.settle(a, None)
    rl.settle(a, None)              # twice: no double release
    rl.admit("team", 1, 0.1)
    with pytest.raises(RateLimited):
        rl.admit("team", 1, 0.2)
    rl.settle(b, None)


CFG = {"backends": [{"name": "a", "url": "http://h:1", "models": ["m"]},
                    {"name": "b", "url": "http://h:2", "models": ["m"], "weight": 3},
                    {"name": "c", "url": "http://h:3", "models": ["big"]}],
       "groups": [{"name": "small", "backends": ["a", "b"], "model": "m", "aliases": ["fast"],
                   "fallbacks": ["large"]},
                  {"name": "large", "backends": ["c"], "model": "big", "fallbacks": ["small"]}]}


def router(cfg=CFG, seed=0):
    config = parse_config(cfg, {})
    backends = {b.name: Backend(b, config.circuit) for b in config.backends}
    return Router(config, backends, random.Random(seed)), backends


def test_names_resolve_through_aliases_and_chains_follow_fallbacks_once():
    r, _ = router()
    got = r.resolve("fast")
    assert got.chain == ("small", "large") and got.reason == "alias fast -> small"
    assert r.resolve("large").chain == ("large", "small")
    with pytest.raises(UnknownModel):
        r.resolve("gpt-9")


def test_pick_is_weighted_least_outstanding_and_skips_open_circuits():
    r, bs = router()
    # equal load: (0+1)/1 for a vs (0+1)/3 for b -> b
    assert r.pick("small", set(), set(), 0.0).name == "b"
    bs["b"].outstanding = 3          # (3+1)/3 = 1.33 > 1 -> a
    assert r.pick("small", set(), set(), 0.0).name == "a"
    bs["b"].outstanding = 2          # (2+1)/3 = 1.0 == a's 1.0: a tie, drawn by weight
    counts = {"a": 0, "b": 0}
    for _ in range(400):
        counts[r.pick("small", set(), set(), 0.0).name] += 1
    assert 60 < counts["a"] < 140 and counts["a"] + counts["b"] == 400    # ~1:3
    bs["b"].breaker._open(0.0)
    assert r.pick("small", set(), set(), 1.0).name == "a"
    assert r.pick("small", set(), {"a"}, 1.0) is None
    assert r.pick("small", {"a"}, set(), 1.0).name == "a"   # tried, but the only one left


def test_cache_key_covers_only_deterministic_requests_and_the_model_version():
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": True}
    k = cache_key("/v1/chat/completions", body, "artifact:abc")
    assert k == cache_key("/v1/chat/completions", dict(body, stream=False, user="u"),
                          "artifact:abc")
    assert k != cache_key("/v1/chat/completions", body, "artifact:abd")
    assert k != cache_key("/v1/completions", body, "artifact:abc")
    assert cache_key("/v1/chat/completions", dict(body, temperature=0.7), "v") is None
    assert cache_key("/v1/chat/completions", dict(body, n=2), "v") is None
    cache = ResponseCache(CacheConfig(True, max_entries=2, ttl=10))
    cache.put("a", {"x": 1}, 0.0, {"backend": "b1"})
    cache.put("b", {"x": 2}, 1.0)
    hit = cache.get("a", 2.0)                   # a is now the most recent
    assert hit.response == {"x": 1} and hit.pin == {"backend": "b1"}
    cache.put("c", {"x": 3}, 3.0)               # evicts b
    assert cache.get("b", 3.0) is None and cache.get("c", 13.5) is None  # c expired


def test_model_versions_prefer_the_artifact_digest():
    v = ModelVersion.from_card({"id": "m", "created": 5,
                                "qserve": {"artifact_digest": "d1", "gate_report_digest": "g1"}})
    assert v.key == "artifact:d1" and v.gate_report_digest == "g1"
    assert ModelVersion.from_card({"id": "m", "created": 5}).key == "m@5"
