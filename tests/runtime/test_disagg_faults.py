"""Faults in a disaggregated cluster, with real worker processes (`qserve serve --role`
of a tiny FP8 artifact) behind the router: a prefill worker that dies mid-transfer and a
decode worker that dies before its first token are replaced (the client gets the same
answer); a decode worker that dies mid-stream ends the stream with an error event; a
restarted worker rejoins; no KV block or received transfer is left behind on the workers
that live (their block counts). The deaths come from failpoints (runtime/failpoints.py)
or SIGKILL."""

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from fake_backend import ServerThread  # noqa: E402
from server.live_server import LiveServer  # noqa: E402

from qserve.runtime.disagg.router_app import create_router_app  # noqa: E402
from qserve.runtime.disagg.router_state import RouterState  # noqa: E402

ARGS = LiveServer.TINY_ARGS + ["--allow-ungated", "--kv-cache-gib", "0.01"]
PREFILL, DECODE = ARGS + ["--role", "prefill"], ARGS + ["--role", "decode"]
PROMPT = ("Rivers carve valleys slowly, one grain of sand at a time. " * 4).strip()
REQ = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
       "ignore_eos": True}


@pytest.fixture(scope="module")
def artifact(tiny_fp8_artifact):
    return tiny_fp8_artifact


def failing(artifact, args, failpoint: str) -> LiveServer:
    server = LiveServer(artifact, args=args)
    server.env["QSERVE_FAILPOINTS"] = failpoint
    return server


def wait_until(check, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def settled(url: str) -> bool:
    """Every KV block free (or evictable cache), no request and no transfer pending."""
    i = httpx.get(url + "/v1/disagg/info", timeout=5).json()
    return (i["free_kv_blocks"] == i["total_kv_blocks"] and i["in_flight"] == 0
            and i["pending_kv_transfers"] == 0 and i["staged_kv_imports"] == 0)


def up(url: str, role: str, worker: str) -> str:
    text = httpx.get(url + "/metrics", timeout=5).text
    return f'qserve_router_worker_up{{role="{role}",worker="{worker}"}} 1' in text


def down(url: str, role: str, worker: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=5).text
    return f'qserve_router_worker_up{{role="{role}",worker="{worker}"}} 0' in text


def answer(url: str, req: dict = REQ) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json=req, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_a_prefill_worker_that_dies_mid_transfer_is_replaced(artifact):
    with failing(artifact, PREFILL, "kv-send-partial") as bad, \
            LiveServer(artifact, args=PREFILL) as good, \
            LiveServer(artifact, args=DECODE) as d:
        with ServerThread(create_router_app(RouterState([good.base], [d.base]))) as url:
            want = answer(url).json()["choices"][0]["text"]
        state = RouterState([bad.base, good.base], [d.base])
        with ServerThread(create_router_app(state)) as url:
            other = dict(REQ, prompt=PROMPT + " And then?")
            want_other = None
            state.tree.insert(other["prompt"], bad.base, time.monotonic())  # bad goes first
            r = answer(url, other)
            assert r.headers["x-qserve-prefill"].startswith(good.base)
            assert bad.proc.wait(timeout=10) == 70            # it died in the failpoint
            assert "failpoint kv-send-partial" in bad.proc.stdout.read()
            assert down(url, "prefill", bad.base)
            want_other = answer(url, other).json()["choices"][0]["text"]   # good alone
            assert r.json()["choices"][0]["text"] == want_other
            assert answer(url).json()["choices"][0]["text"] == want
        # the half frame was dropped by the decode worker's receiver; nothing leaked
        wait_until(lambda: settled(d.base) and settled(good.base), "workers to settle")


def test_a_decode_worker_that_dies_before_its_first_token_is_replaced(artifact):
    with LiveServer(artifact, args=PREFILL) as p, \
            failing(artifact, DECODE, "decode-exit-on-kv") as bad, \
            LiveServer(artifact, args=DECODE) as good:
        with ServerThread(create_router_app(RouterState([p.base], [good.base]))) as url:
            want = answer(url).json()["choices"][0]["text"]
        state = RouterState([p.base], [bad.base, good.base])
        with ServerThread(create_router_app(state)) as url:
            state.decode[1].in_flight = 1          # `good` looks busier: `bad` goes first
            for stream in (False, True):
                r = httpx.post(url + "/v1/completions", json=dict(REQ, stream=stream),
                               timeout=60)
                assert r.status_code == 200, r.text
                assert r.headers["x-qserve-decode"].startswith(good.base)
                if stream:
                    text = "".join(json.loads(line[6:])["choices"][0]["text"]
                                   for line in r.text.splitlines()
                                   if line.startswith("data: {"))
                else:
                    text = r.json()["choices"][0]["text"]
                    assert bad.proc.wait(timeout=10) == 70
                    assert "failpoint decode-exit-on-kv" in bad.proc.stdout.read()
                assert text == want
            state.decode[1].in_flight -= 1
        wait_until(lambda: settled(p.base) and settled(good.base), "workers to settle")


def test_a_decode_worker_killed_mid_stream_ends_it_with_an_error_and_rejoins(artifact):
    with LiveServer(artifact, args=PREFILL) as p, LiveServer(artifact, args=DECODE) as d:
        state = RouterState([p.base], [d.base])
        with ServerThread(create_router_app(state)) as url:
            want = answer(url).json()["choices"][0]["text"]
            long = dict(REQ, max_tokens=280, stream=True)
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as s:
                assert s.status_code == 200, s.read()
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3:
                        d.proc.kill()                  # mid-stream, 277 tokens to go
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "worker_failed_mid_stream"
            tokens = [e for e in events if e.startswith("{") and "choices" in e]
            assert 3 <= len(tokens) < 280
            wait_until(lambda: down(url, "decode", d.base), "the router to mark it down")
            r = httpx.post(url + "/v1/completions", json=REQ, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available"
            assert 'retry-after' in r.headers
            wait_until(lambda: settled(p.base), "the prefill worker to settle")
            # restarted on the same address (its KV receiver gets a new port): it rejoins
            again = LiveServer(artifact, args=DECODE)
            again.port, again.base = d.port, d.base
            with again:
                wait_until(lambda: up(url, "decode", d.base), "the worker to rejoin")
                r = answer(url)
                assert r.headers["x-qserve-decode"].startswith(d.base)
                assert r.json()["choices"][0]["text"] == want
                wait_until(lambda: settled(again.base) and settled(p.base), "to settle")


def test_an_unknown_failpoint_name_stops_the_process_with_the_known_ones():
    import os
    import subprocess

    env = dict(os.environ, QSERVE_FAILPOINTS="kv-send-partial,no-such-point")
    r = subprocess.run([sys.executable, "-c", "import qserve.runtime.failpoints"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "unknown failpoints no-such-point; known: decode-exit-on-kv, kv-send-partial" \
        in r.stderr
