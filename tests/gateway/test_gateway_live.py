"""The gateway as a real `qserve gateway` process in front of a real `qserve serve` of a
tiny FP8 artifact: same tokens as the backend directly, traces pinned to the artifact
digest, an unreachable backend cooled down at start, SIGHUP reload without dropping a
stream, a bad reload refused, and traces exported as eval prompts."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.live_server import LiveServer  # noqa: E402

from qserve.runtime.benchmark.server_process import ServerProcess, free_port  # noqa: E402
from qserve.runtime.formats.artifact_reader import open_artifact  # noqa: E402

PROMPT = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12,
          "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def artifact(tiny_fp8_artifact):
    return tiny_fp8_artifact


@pytest.fixture(scope="module")
def backend(artifact):
    with LiveServer(artifact, args=LiveServer.TINY_ARGS + ["--allow-ungated"]) as live:
        yield live.base


def gateway_process(config_path: Path, log: Path) -> ServerProcess:
    """`qserve gateway --config` as a real process (so it can get SIGHUP), up once its
    /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "qserve.runtime.cli", "gateway", "--config",
           str(config_path), "--port", str(port)]
    return ServerProcess("gateway", cmd, port, log, env={"HF_HUB_OFFLINE": "1"},
                         startup_timeout=60)


def test_gateway_in_front_of_a_real_qserve(artifact, backend, tmp_path):
    traces = tmp_path / "traces.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = {"backends": [{"name": "q", "url": backend, "models": ["tiny"]},
                        {"name": "dead", "url": dead, "models": ["tiny"]}],
           "groups": [{"name": "tiny", "backends": ["q", "dead"]}],
           "trace": {"path": str(traces)}}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    direct = httpx.post(backend + "/v1/completions", json=PROMPT).json()["choices"][0]["text"]
    with gateway_process(path, tmp_path / "gateway.log") as gw:
        # the unreachable backend starts cooled down: every request goes to the live one
        for _ in range(3):
            r = httpx.post(gw.base + "/v1/completions", json=PROMPT, timeout=30)
            assert r.status_code == 200 and r.headers["x-qserve-route"] == "tiny/q"
            assert r.json()["choices"][0]["text"] == direct
        assert 'qserve_gateway_circuit_state{backend="dead"} 2' in \
            httpx.get(gw.base + "/metrics").text

        # SIGHUP mid-stream: the stream finishes; the new config (an alias) takes effect
        cfg["groups"][0]["aliases"] = ["tiny-latest"]
        path.write_text(yaml.safe_dump(cfg))
        with httpx.stream("POST", gw.base + "/v1/completions",
                          json=dict(PROMPT, stream=True), timeout=30) as s:
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            gw.proc.send_signal(signal.SIGHUP)
            rest = [line for line in lines if line.startswith("data: ")]
        events = [first] + rest
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]
                       if json.loads(e[6:]).get("choices"))
        assert text == direct
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = httpx.post(gw.base + "/v1/completions", json=dict(PROMPT, model="tiny-latest"))
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == direct

        # a bad config on reload is refused: the running one stays
        path.write_text("backends: [\n")
        gw.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        r = httpx.post(gw.base + "/v1/completions", json=dict(PROMPT, model="tiny-latest"))
        assert r.status_code == 200
    output = (tmp_path / "gateway.log").read_text()
    assert "config reload refused" in output and "is not valid YAML" in output

    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    digest = open_artifact(artifact).digest
    assert len(rows) == 6 and all(r["status"] == 200 for r in rows)
    assert {r["artifact_digest"] for r in rows} == {digest}
    assert {r["gate_report_digest"] for r in rows} == {None}     # never gated
    assert rows[0]["completion_tokens"] == 12 and rows[0]["response"] == direct

    out = tmp_path / "prompts.jsonl"
    res = subprocess.run([sys.executable, "-m", "qserve.runtime.cli", "gateway", "export",
                          str(traces), "--sample", "3", "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    # six traces of one prompt: exported once
    assert [e["prompt"] for e in exported] == [PROMPT["prompt"]]


def test_sigterm_stops_the_gateway_cleanly_with_exit_0(tmp_path):
    """Like `qserve serve` and `qserve cluster`: a graceful stop is a success, not a death
    by the signal (143)."""
    import signal

    cfg = {"backends": [{"name": "q", "url": f"http://127.0.0.1:{free_port()}",
                         "models": ["tiny"]}],
           "groups": [{"name": "tiny", "backends": ["q"]}]}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with gateway_process(path, tmp_path / "gateway.log") as gw:
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(timeout=30) == 0, (tmp_path / "gateway.log").read_text()
