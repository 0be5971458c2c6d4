"""`qserve bench` against a real `qserve serve` process on a tiny random model."""

import json
import os
import subprocess
import sys

import pytest
from live_server import LiveServer


def _bench(*args, timeout=120):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "qserve.runtime.cli", "bench", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    with LiveServer(tiny_model_dir) as server:
        yield server


def test_sweep_counts_and_complete_json(live, tmp_path):
    out = tmp_path / "r.json"
    done = _bench("--endpoint", live.base + "/v1", "--num-prompts", "6", "--input-len", "24",
                  "--output-len", "8", "--concurrency", "1,3", "--goodput", "ttft:60000",
                  "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "output throughput (tok/s)" in done.stdout
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["workload"] == "random"
    assert report["tokenizer"].startswith("server ")
    assert [r["concurrency"] for r in report["runs"]] == [1, 3]
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"], m["skipped"]) == (6, 0, 0)
        assert m["total_output_tokens"] == m["expected_output_tokens"] == 48
        assert m["total_input_tokens"] == 6 * 24  # usage.prompt_tokens (no BOS here)
        assert m["goodput"] == pytest.approx(m["request_throughput"])
        assert m["output_throughput"] == pytest.approx(48 / m["duration_s"])
        reqs = run["requests"]
        assert len(reqs) == 6
        assert all(r["usage_reported"] and r["output_len"] == 8 and r["prompt_len"] == 24
                   for r in reqs)
        assert all(0 < r["ttft"] <= r["e2el"] for r in reqs)
        assert m["itl"]["count"] == sum(len(r["itl"]) for r in reqs) > 0
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert set(m[name]["percentiles"]) == {"p50", "p90", "p99"}
    assert (tmp_path / "r-latency.png").stat().st_size > 0
    assert (tmp_path / "r-throughput.png").stat().st_size > 0


def test_shared_prefix_reaches_the_prefix_cache(live, tmp_path):
    out = tmp_path / "s.json"
    done = _bench("--endpoint", live.base, "--workload", "shared-prefix", "--num-prompts", "4",
                  "--prefix-len", "64", "--question-len", "4", "--output-len", "2",
                  "--concurrency", "1", "--api", "chat", "--out", str(out), "--plots", "none",
                  "--no-progress")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["workload_params"]["prefix_tokens_shared"] >= 64
    m = report["runs"][0]["metrics"]
    assert (m["completed"], m["total_output_tokens"]) == (4, 8), m["errors"]
    assert not (tmp_path / "s-latency.png").exists()
    import httpx

    metrics = httpx.get(live.base + "/metrics").text
    hits = [line for line in metrics.splitlines() if "prefix" in line and "hit" in line
            and not line.startswith("#")]
    assert hits and float(hits[0].split()[-1]) > 0, metrics


def test_bad_trace_file_is_a_clear_error(live, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_len": 5}\n')
    done = _bench("--endpoint", live.base, "--workload", "trace", "--trace-file", str(trace),
                  "--out", str(tmp_path / "t.json"))
    assert done.returncode == 2
    assert "t.jsonl:1" in done.stderr and "output_len" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "t.json").exists()


def test_unreachable_endpoint_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _bench("--endpoint", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "u.json"))
    assert done.returncode == 2
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    done = _bench("--endpoint", "localhost:8000")
    assert done.returncode == 2 and "must be an http:// URL" in done.stderr
