"""Prefill/decode disaggregation end to end: a real prefill worker and a real decode
worker (`qserve serve --role ...` of a tiny FP8 artifact) behind `qserve router` give the
same greedy tokens as one colocated server, with the prompt's KV shipped between them;
the router follows the prefix cache, refuses a worker of another artifact, and replaces a
decode worker that is down."""

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from fake_backend import ServerThread  # noqa: E402
from server.live_server import LiveServer  # noqa: E402
from tiny_models import write_tiny_llama  # noqa: E402

from qserve.runtime.disagg.prefill_cost import Work  # noqa: E402
from qserve.runtime.disagg.router_app import create_router_app  # noqa: E402
from qserve.runtime.disagg.router_state import CHARS_PER_TOKEN, RouterState  # noqa: E402

ARGS = LiveServer.TINY_ARGS + ["--allow-ungated", "--kv-cache-gib", "0.01"]
PROMPT = ("The history of the printing press is a story of innovation. " * 4).strip()
REQ = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
       "ignore_eos": True}


@pytest.fixture(scope="module")
def artifact(tiny_fp8_artifact):
    return tiny_fp8_artifact


@pytest.fixture(scope="module")
def workers(artifact):
    with LiveServer(artifact, args=ARGS) as both, \
            LiveServer(artifact, args=ARGS + ["--role", "prefill"]) as p1, \
            LiveServer(artifact, args=ARGS + ["--role", "prefill"]) as p2, \
            LiveServer(artifact, args=ARGS + ["--role", "decode"]) as d1:
        yield {"both": both.base, "p1": p1.base, "p2": p2.base, "d1": d1.base,
               "artifact": artifact}


def text_of(resp) -> str:
    return resp.json()["choices"][0]["text"]


def stream_text(resp) -> str:
    import json
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            out.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(out)


def test_disaggregated_tokens_equal_colocated_and_the_kv_travels(workers):
    want = text_of(httpx.post(workers["both"] + "/v1/completions", json=REQ, timeout=60))
    state = RouterState([workers["p1"]], [workers["d1"]])
    with ServerThread(create_router_app(state)) as url:
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        assert r.status_code == 200, r.text
        assert text_of(r) == want
        assert int(r.headers["x-qserve-kv-bytes"]) > 0
        # no prefill rate measured before the first request: no TTFT prediction to send
        assert "x-qserve-predicted-ttft-ms" not in r.headers
        # the decode worker computed only the prompt's last token: the full blocks came
        # through its prefix cache, the partial one as the transfer's tail
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert (prompt_tokens - 1) % 16 and cached == prompt_tokens - 1
        assert state.decode[0].first_token_s.value is None   # timed on streams only
        s = httpx.post(url + "/v1/completions", json=dict(REQ, stream=True), timeout=60)
        assert stream_text(s) == want
        assert float(s.headers["x-qserve-predicted-ttft-ms"]) > 0  # the rate is measured now
        assert 0 < state.decode[0].first_token_s.value < 60
        # the prompt's chars per token, as the prefill worker counted its tokens
        assert state.chars_per_token("/v1/completions") == \
            pytest.approx(len(PROMPT) / prompt_tokens)
        assert state.chars_per_token("/v1/chat/completions") == CHARS_PER_TOKEN  # unmeasured
        # the router remembers no more of p1's prompts than p1's KV cache holds (the cap
        # follows the learned size at the next poll)
        info = httpx.get(workers["p1"] + "/v1/disagg/info").json()
        want = round(info["total_kv_blocks"] * info["block_size"] * state.chars_per_token())
        deadline = time.monotonic() + 5
        while state.tree.cap(workers["p1"]) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state.tree.cap(workers["p1"]) == want
        d_info = httpx.get(workers["d1"] + "/v1/disagg/info").json()
        steps = d_info["decode_step_s"]
        assert steps and all(int(n) >= 1 and 0 < t < 60 for n, t in steps.items())
        assert d_info["staged_kv_imports"] == 0  # every import written and committed
        metrics = httpx.get(url + "/metrics").text
        assert "qserve_router_kv_transfers_total 2" in metrics
        assert "qserve_router_local_prefills_total 0" in metrics


def test_constrained_requests_with_n_through_the_router_equal_colocated(workers):
    """A JSON-schema request with n = 2 through prefill and decode workers: the decode
    worker imports the prompt's KV for the first sample, forks the second from it, and
    both follow the grammar as on one server."""
    import json

    schema = {"type": "object", "properties": {"w": {"enum": ["press", "ink", "paper"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["w", "n"]}
    req = dict(REQ, max_tokens=40, n=2, guided_json=schema)
    req.pop("ignore_eos")
    want = httpx.post(workers["both"] + "/v1/completions", json=req, timeout=60).json()
    with ServerThread(create_router_app(RouterState([workers["p1"]], [workers["d1"]]))) as url:
        r = httpx.post(url + "/v1/completions", json=req, timeout=60)
    assert r.status_code == 200, r.text
    got = [c["text"] for c in r.json()["choices"]]
    assert got == [c["text"] for c in want["choices"]] and len(got) == 2
    for text in got:
        assert set(json.loads(text)) == {"w", "n"}
    assert int(r.headers["x-qserve-kv-bytes"]) > 0


def test_a_short_prompt_can_be_computed_by_its_decode_worker(workers):
    """Local prefill: under the policy's length the prompt skips the prefill worker (no KV
    travels) and the decode worker computes it, same text; over it, the KV travels; with
    no prefill worker up a short prompt is still served."""
    from qserve.runtime.disagg.router_state import RouterOptions
    from qserve.runtime.disagg.selection import LocalPrefillPolicy

    want = text_of(httpx.post(workers["both"] + "/v1/completions", json=REQ, timeout=60))
    est = round(len(PROMPT) / CHARS_PER_TOKEN)   # the router's estimate, unmeasured
    local = RouterOptions(local_prefill=LocalPrefillPolicy(max_tokens=est))
    state = RouterState([workers["p1"]], [workers["d1"]], local)
    with ServerThread(create_router_app(state)) as url:
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        assert r.status_code == 200, r.text
        assert text_of(r) == want
        assert r.headers["x-qserve-prefill"] == f"local (~{est} tokens)"
        assert r.headers["x-qserve-kv-bytes"] == "0"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < \
            r.json()["usage"]["prompt_tokens"] - 1           # no imported blocks
        s = httpx.post(url + "/v1/completions", json=dict(REQ, stream=True), timeout=60)
        assert stream_text(s) == want
        assert state.decode[0].local_prefill_tokens_per_s.value > 0
        assert state.decode[0].first_token_s.value is None    # a remote-only term
        longer = dict(REQ, prompt=PROMPT + " And more.")
        r = httpx.post(url + "/v1/completions", json=longer, timeout=60)
        assert int(r.headers["x-qserve-kv-bytes"]) > 0
        metrics = httpx.get(url + "/metrics").text
        assert "qserve_router_local_prefills_total 2" in metrics
        assert "qserve_router_kv_transfers_total 1" in metrics
    dead = RouterState(["http://127.0.0.1:9"], [workers["d1"]], local)
    with ServerThread(create_router_app(dead)) as url:
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        assert r.status_code == 200 and text_of(r) == want
        assert r.headers["x-qserve-prefill"].startswith("local")
        r = httpx.post(url + "/v1/completions", json=longer, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available"


def test_the_kv_travels_through_mooncakes_transfer_engine(workers):
    """A decode worker started with --kv-transport mooncake: the prefill worker writes
    the KV into its registered staging buffer with Mooncake's transfer engine (TCP here);
    same text as the colocated server, and nothing left behind on either side."""
    from qserve.runtime.disagg.mooncake_connector import INSTALL_HINT, available

    if not available():
        pytest.skip(f"Mooncake's transfer engine does not import here: {INSTALL_HINT}")
    want = text_of(httpx.post(workers["both"] + "/v1/completions", json=REQ, timeout=60))
    with LiveServer(workers["artifact"],
                    args=ARGS + ["--role", "decode", "--kv-transport", "mooncake"]) as d:
        info = httpx.get(d.base + "/v1/disagg/info").json()
        assert info["kv_transport"] == "mooncake"
        state = RouterState([workers["p1"]], [d.base])
        with ServerThread(create_router_app(state)) as url:
            r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
            assert r.status_code == 200, r.text
            assert text_of(r) == want
            s = httpx.post(url + "/v1/completions", json=dict(REQ, stream=True), timeout=60)
            assert stream_text(s) == want
        info = httpx.get(d.base + "/v1/disagg/info").json()
        assert info["pending_kv_transfers"] == 0 and info["held_kv_requests"] == 0
        assert info["free_kv_blocks"] == info["total_kv_blocks"]
        assert info["staged_kv_imports"] == 0
    p_info = httpx.get(workers["p1"] + "/v1/disagg/info").json()
    assert p_info["held_kv_requests"] == 0 and p_info["in_flight"] == 0


def test_the_prefill_worker_holding_the_prefix_is_chosen(workers):
    state = RouterState([workers["p1"], workers["p2"]], [workers["d1"]])
    computed = []   # the tokens each prefill's rate sample counts
    for w in state.prefill:
        w.record_prefill = lambda own, s, ahead, f=w.record_prefill: (
            computed.append(own.tokens), f(own, s, ahead))
    with ServerThread(create_router_app(state)) as url:
        first = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        chosen = first.headers["x-qserve-prefill"].split(" ")[0]
        for i in range(3):   # same long prefix, other endings: the same worker
            r = httpx.post(url + "/v1/completions",
                           json=dict(REQ, prompt=PROMPT + f" Then {i}."), timeout=60)
            assert r.headers["x-qserve-prefill"].startswith(chosen + " (cache")
            # the prefix came from the worker's cache: not counted as computed, so a
            # cache hit is not taken for prefill speed
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            assert 1 <= computed[-1] <= prompt_tokens - 16
        # four prompts on the chosen worker: its cost is fitted, and shown
        metrics = httpx.get(url + "/metrics").text
        terms = [float(metrics.split(f'qserve_router_prefill_cost_seconds{{worker="{chosen}",'
                                     f'per="{per}"}} ')[1].split()[0])
                 for per in ("request", "token", "token_squared")]
        assert min(terms) >= 0 and max(terms) > 0
        assert f'qserve_router_prefill_tokens_per_second{{worker="{chosen}"}} ' in metrics


def test_a_worker_of_another_artifact_is_refused_and_a_dead_one_skipped(workers,
                                                                              tmp_path):
    other = write_tiny_llama(tmp_path / "other")    # another model: another namespace
    with LiveServer(other, args=ARGS + ["--role", "decode"]) as wrong:
        dead = "http://127.0.0.1:9"                 # nothing listens there
        state = RouterState([workers["p1"]], [dead, wrong.base, workers["d1"]])
        with ServerThread(create_router_app(state)) as url:
            r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
            assert r.status_code == 200
            assert r.headers["x-qserve-decode"].startswith(workers["d1"])
            assert "another artifact or KV layout" in state.refused[wrong.base]
            assert 'worker_up{role="decode",worker="http://127.0.0.1:9"} 0' in \
                httpx.get(url + "/metrics").text


def test_a_request_that_would_miss_the_ttft_slo_is_refused_before_any_prefill(workers):
    from qserve.runtime.disagg.admission import SloConfig
    from qserve.runtime.disagg.router_state import RouterOptions

    state = RouterState([workers["p1"]], [workers["d1"]],
                        RouterOptions(slo=SloConfig(ttft_s=0.5)))
    with ServerThread(create_router_app(state)) as url:
        first = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        assert first.status_code == 200
        p = state.prefill[0]
        assert p.prefill_tokens_per_s.value > 0          # measured on that request
        # a backlog the worker needs ~10 s to clear, as the router sees it
        p.queued = Work(tokens=int(10 * p.prefill_tokens_per_s.value))
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "slo_rejected"
        assert 9 <= int(r.headers["retry-after"]) <= 11
        metrics = httpx.get(url + "/metrics").text
        assert "qserve_router_rejected_total 1" in metrics
        assert "qserve_router_kv_transfers_total 1" in metrics       # no prefill was spent
        # the refused prompt's size, estimated from the chars per token the first measured
        saved = first.json()["usage"]["prompt_tokens"]
        assert f"qserve_router_prefill_tokens_saved_total {saved}" in metrics


def test_workers_refuse_bad_disaggregation_requests_with_openai_errors(workers):
    def err(r):
        return r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]

    prefill = workers["p1"] + "/v1/disagg/prefill"
    assert err(httpx.post(prefill, content=b"{nope")) == (400, "invalid_json", None)
    assert err(httpx.post(prefill, json={"request_id": "r", "prompt": "hi"})) == \
        (400, "invalid_type", "kv_port")
    assert err(httpx.post(prefill, json={"request_id": "r", "kv_port": 70000,
                                         "prompt": "hi"})) == (400, "invalid_value", "kv_port")
    assert err(httpx.post(prefill, json={"request_id": "r", "kv_port": 1})) == \
        (400, "invalid_value", "messages")
    assert err(httpx.post(prefill, json={"request_id": "r", "kv_port": 1,
                                         "prompt": ["a", "b"]})) == (400, "invalid_value",
                                                                      "prompt")
    # a decode worker computes no prompts; a colocated server imports no KV
    r = httpx.post(workers["d1"] + "/v1/disagg/prefill", json={"request_id": "r",
                                                               "kv_port": 1, "prompt": "hi"})
    assert err(r) == (400, "not_prefill_worker", None)
    r = httpx.post(workers["both"] + "/v1/completions", json=REQ,
                   headers={"x-qserve-kv-request-id": "r"})
    assert err(r) == (400, "not_decode_worker", None)


def test_the_cluster_command_serves_and_stops_its_workers_on_sigterm(artifact, tmp_path):
    import os
    import re
    import signal
    import subprocess
    import time

    from qserve.runtime.benchmark.server_process import free_port

    port = free_port()
    log = tmp_path / "cluster.log"
    extra = ["--allow-ungated", "--dtype=fp32", "--kv-cache-gib=0.01",
             "--served-model-name=tiny", "--decode-impl=eager"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qserve.runtime.cli", "cluster", str(artifact),
             "--prefill", "1", "--decode", "1", "--port", str(port),
             *[f"--worker-arg={a}" for a in extra],
             "--prefill-worker-arg=--served-model-name=tiny-prefill"],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
        assert r.status_code == 200 and int(r.headers["x-qserve-kv-bytes"]) > 0
        workers = re.findall(r"worker on port (\d+)", log.read_text())
        assert len(workers) == 2
        names = [httpx.get(f"http://127.0.0.1:{w}/v1/models").json()["data"][0]["id"]
                 for w in workers]                # a role's own option reached it alone
        assert names == ["tiny-prefill", "tiny"]
        # by default the decode worker takes KV in on the prefill worker's cores
        cores = re.findall(r"worker on port \d+, cores \[?([\d, ]+)", log.read_text())
        info = httpx.get(f"http://127.0.0.1:{workers[1]}/v1/disagg/info").json()
        assert info["kv_receive_cores"] == [int(c) for c in cores[0].split(",")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        for w in workers:          # the workers went with it
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{w}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_latent_artifact_travels_as_its_latent_once(tmp_path):
    """DeepSeek-V3 latent attention (MLA, FP8 latent pool): a prefill and a decode worker
    behind the router give the colocated server's text, and what travels is one vector of
    kv_lora_rank + qk_rope_head_dim FP8 bytes per token and layer, not a K and a V."""
    import json

    import torch

    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict
    from tiny_models import write_tiny_deepseek

    src = write_tiny_deepseek(tmp_path / "src", 3, first_k_dense_replace=3, q_lora_rank=24)
    art = tmp_path / "art"
    quantize(str(src), art, recipe_from_dict({"calibration": {"num_samples": 4,
                                                              "seq_len": 64}}),
             dtype=torch.float32)
    cfg = json.loads((art / "config.json").read_text())
    args = ARGS + ["--kv-dtype", "fp8"]
    with LiveServer(art, args=args) as both, \
            LiveServer(art, args=args + ["--role", "prefill"]) as p1, \
            LiveServer(art, args=args + ["--role", "decode"]) as d1:
        want = text_of(httpx.post(both.base + "/v1/completions", json=REQ, timeout=60))
        with ServerThread(create_router_app(RouterState([p1.base], [d1.base]))) as url:
            r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
            assert r.status_code == 200, r.text
            assert text_of(r) == want
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            per_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"]
                                                    + cfg["qk_rope_head_dim"])  # 1 byte
            assert int(r.headers["x-qserve-kv-bytes"]) == (prompt_tokens - 1) * per_token


def test_the_cluster_makes_and_gates_a_builtin_artifact_once_before_its_workers(monkeypatch):
    """`qserve cluster smollm2-135m`: the artifact is made and gated in the cluster's own
    process before any worker starts (workers would each do both on one core, at once),
    and the workers are still given the model's name (quantize and gates faked here)."""
    import subprocess

    from click.testing import CliRunner

    from qserve.evals import serve_gate
    from qserve.quantize import builtin_artifact as ba
    from qserve.runtime.disagg.command import cluster

    events = []
    monkeypatch.setattr(ba, "builtin_artifact",
                        lambda spec, say, progress=None: events.append(("make", spec)) or "/a")
    monkeypatch.setattr(serve_gate, "gate_once", lambda path, say: events.append(("gate", path)))

    class Exited:  # a worker that dies at once: the cluster stops with its error
        def __init__(self, cmd, **kw):
            events.append(("worker", cmd[cmd.index("serve") + 1]))

        def poll(self):
            return 1

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Exited)
    result = CliRunner().invoke(cluster, ["smollm2-135m", "--prefill", "1", "--decode", "1"])
    assert result.exit_code != 0 and "a worker exited while starting" in result.output
    assert events == [("make", "smollm2-135m"), ("gate", "/a"),
                      ("worker", "smollm2-135m"), ("worker", "smollm2-135m")]
    events.clear()  # --allow-ungated for the workers: nothing gated
    CliRunner().invoke(cluster, ["smollm2-135m", "--worker-arg=--allow-ungated"])
    assert ("gate", "/a") not in events and events[0] == ("make", "smollm2-135m")
