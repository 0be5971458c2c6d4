"""/metrics (Prometheus text), /health, /v1/models, /tokenize, /detokenize, /tokenizer_info."""

import re

from conftest import assert_error, client_for, run

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+="[^"]*"\})? (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """name{labels} -> value; fails on any line that is not valid exposition text."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("# HELP ") or not line:
            continue
        m = LINE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    for name in samples:
        base = re.sub(r"(_bucket|_sum|_count)$", "", name.split("{")[0])
        assert base in types or name.split("{")[0] in types, name
    return samples


HISTOGRAMS = ("qserve_time_to_first_token_seconds", "qserve_inter_token_latency_seconds",
              "qserve_request_latency_seconds")


def test_metrics_parse_and_increase(app):
    async def main():
        async with client_for(app) as c:
            before = (await c.get("/metrics")).text
            r = await c.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 5,
                                                      "ignore_eos": True})
            assert r.status_code == 200
            await c.post("/v1/completions", json={"prompt": [3, 4], "top_p": 7})
            after = await c.get("/metrics")
            return before, after

    before, after = run(main())
    assert after.headers["content-type"].startswith("text/plain")
    b, a = parse_metrics(before), parse_metrics(after.text)
    for name in ("qserve_num_requests_waiting", "qserve_num_requests_running",
                 "qserve_kv_blocks_used", "qserve_kv_blocks_free", "qserve_kv_blocks_total",
                 "qserve_prefix_cache_hit_rate", "qserve_num_preemptions_total",
                 "qserve_requests_in_flight"):
        assert name in a, name
    assert a['qserve_requests_total{outcome="length"}'] == b['qserve_requests_total{outcome="length"}'] + 1
    assert a['qserve_requests_total{outcome="invalid"}'] == b['qserve_requests_total{outcome="invalid"}'] + 1
    assert a["qserve_generation_tokens_total"] == b["qserve_generation_tokens_total"] + 5
    assert a["qserve_time_to_first_token_seconds_count"] == 1
    assert a["qserve_inter_token_latency_seconds_count"] == 4
    for h in HISTOGRAMS:
        buckets = [v for k, v in a.items() if k.startswith(h + "_bucket")]
        assert buckets == sorted(buckets)
        assert a[h + '_bucket{le="+Inf"}'] == a[h + "_count"]


def test_models_and_health(app):
    async def main():
        async with client_for(app) as c:
            return (await c.get("/v1/models"), await c.get("/v1/models/tiny"),
                    await c.get("/v1/models/other"), await c.get("/health"),
                    await c.get("/"))

    models, one, other, health, page = run(main())
    card = models.json()["data"][0]
    assert card["id"] == "tiny" and card["object"] == "model"
    assert card["max_model_len"] == 64 * 16  # no model limit given: the KV pool (64 blocks)
    assert one.json()["id"] == "tiny"
    assert_error(other, 404, "model", "model_not_found")
    assert health.json() == {"status": "ok"}
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text and "getReader()" in page.text


def test_tokenize_detokenize_info(app, lm):
    text = "The quick brown fox"
    ids = lm.tokenizer.encode(text, add_special_tokens=False)

    async def main():
        async with client_for(app) as c:
            tok = (await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                   "return_token_strs": True})).json()
            chat = (await c.post("/tokenize", json={
                "messages": [{"role": "user", "content": "hi"}]})).json()
            detok = (await c.post("/detokenize", json={"tokens": ids})).json()
            info = (await c.get("/tokenizer_info")).json()
            bad = await c.post("/detokenize", json={"tokens": [10**6]})
            neither = await c.post("/tokenize", json={})
            return tok, chat, detok, info, bad, neither

    tok, chat, detok, info, bad, neither = run(main())
    assert tok["tokens"] == ids and tok["count"] == len(ids)
    assert "".join(tok["token_strs"]) == text
    assert tok["max_model_len"] == 1024
    rendered = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == lm.tokenizer.encode(rendered, add_special_tokens=False)
    assert detok == {"prompt": text}
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["chat_template"] == lm.tokenizer.chat_template
    assert_error(bad, 400, "tokens")
    assert_error(neither, 400, "prompt")
