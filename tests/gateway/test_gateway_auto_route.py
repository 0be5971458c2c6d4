"""model "auto": the difficulty router picks the small or the large group, says so in a
header and in the trace, and honours the configured threshold."""

import json

import httpx
from gateway_harness import FakeBackend, running_gateway

from qserve.runtime.gateway.difficulty import DifficultyRouter

EASY = "Extract the e-mail domain from: contact at example.org"
HARD = ("Write a Python program that parses a CSV file of transactions, groups them by "
        "month, computes running balances, and explain step by step why your algorithm is "
        "correct, then prove its time complexity.")


def config(threshold):
    return {"backends": [{"name": "s", "models": ["small-m"]},
                         {"name": "l", "models": ["large-m"]}],
            "groups": [{"name": "small", "backends": ["s"], "model": "small-m"},
                       {"name": "large", "backends": ["l"], "model": "large-m"}],
            "routing": {"auto": {"small": "small", "large": "large", "threshold": threshold}}}


def ask(url, text):
    return httpx.post(url + "/v1/chat/completions",
                      json={"model": "auto", "messages": [{"role": "user", "content": text}]})


def test_auto_sends_easy_requests_small_and_hard_ones_large(tmp_path):
    router = DifficultyRouter.load()
    easy, hard = router.score_prompt(EASY), router.score_prompt(HARD)
    assert easy < 0.5 < hard
    backends = {"s": FakeBackend("s", model="small-m"), "l": FakeBackend("l", model="large-m")}
    traces = tmp_path / "t.jsonl"
    with running_gateway(config(0.5), backends, trace_path=traces) as (url, _):
        r = ask(url, EASY)
        assert r.headers["x-qserve-route"] == "small/s"
        assert r.headers["x-qserve-difficulty"] == f"small score={easy:.3f}"
        r = ask(url, HARD)
        assert r.headers["x-qserve-route"] == "large/l"
        assert r.headers["x-qserve-difficulty"] == f"large score={hard:.3f}"
        assert "auto_route_total{target=\"small\"} 1" in httpx.get(url + "/metrics").text
    assert backends["s"].requests[0]["model"] == "small-m"
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    assert [r["group"] for r in rows] == ["small", "large"]
    assert rows[0]["difficulty"] == easy and rows[0]["route"].startswith("auto -> small")


def test_the_threshold_is_a_config_value():
    backends = {"s": FakeBackend("s", model="small-m"), "l": FakeBackend("l", model="large-m")}
    with running_gateway(config(0.0), backends) as (url, _):      # everything is "hard"
        assert ask(url, EASY).headers["x-qserve-route"] == "large/l"
    with running_gateway(config(1.0), backends) as (url, _):      # everything is "easy"
        assert ask(url, HARD).headers["x-qserve-route"] == "small/s"
