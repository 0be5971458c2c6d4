"""OpenTelemetry traces: a request through the gateway, the router and a prefill and a
decode worker (all in this process, on loopback ports) is one trace, a span per hop and
stage, linked by traceparent; with no OTEL_* variable set tracing is off and its SDK is
not even imported (FastAPI imports the OpenTelemetry API by itself where it is
installed)."""

import subprocess
import sys
import time

import httpx
import pytest
import torch
from fake_backend import ServerThread

from qserve.runtime import telemetry

pytest.importorskip("opentelemetry.sdk")


def _worker(artifact, role):
    from qserve.runtime.async_engine import AsyncEngine
    from qserve.runtime.disagg import create_connector
    from qserve.runtime.engine import EngineConfig, LLMEngine
    from qserve.runtime.loaded_model import load
    from qserve.runtime.server import create_app
    from qserve.runtime.server.disagg_routes import DisaggRole

    lm = load(str(artifact), torch.float32)
    engine = AsyncEngine(LLMEngine.from_model(lm, EngineConfig(
        num_kv_blocks=64, kv_dtype="bf16", max_num_batched_tokens=64, decode_impl="eager")))
    disagg = DisaggRole(role)
    if role == "decode":
        disagg.receiver = create_connector("socket", host="127.0.0.1", port=0, listen=True)
    return engine, disagg, create_app(engine, lm.tokenizer, "tiny", disagg=disagg)


@pytest.fixture
def exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    assert telemetry.configure("qserve-test", exporter=exp)
    yield exp
    telemetry.disable()


def test_a_request_through_gateway_router_and_workers_is_one_trace(tiny_fp8_artifact,
                                                                    exporter):
    from qserve.runtime.disagg.router_app import create_router_app
    from qserve.runtime.disagg.router_state import RouterState
    from qserve.runtime.gateway.app import create_gateway_app
    from qserve.runtime.gateway.config import parse_config
    from qserve.runtime.gateway.state import GatewayState

    torch.set_num_threads(1)
    p_engine, _, p_app = _worker(tiny_fp8_artifact, "prefill")
    d_engine, d_role, d_app = _worker(tiny_fp8_artifact, "decode")
    try:
        with ServerThread(p_app) as p_url, ServerThread(d_app) as d_url, \
                ServerThread(create_router_app(RouterState([p_url], [d_url]))) as r_url:
            cfg = parse_config({"backends": [{"name": "r", "url": r_url, "models": ["tiny"]}],
                                "groups": [{"name": "small", "backends": ["r"],
                                            "model": "tiny"}],
                                "cache": {"enabled": True}}, {})
            with ServerThread(create_gateway_app(GatewayState(cfg))) as g_url:
                r = httpx.post(g_url + "/v1/completions", timeout=60, json={
                    "model": "small", "prompt": "The history of the printing press " * 3,
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                want = {"gateway POST /v1/completions", "gateway.cache", "gateway.upstream",
                        "router POST /v1/completions", "router.admission", "router.prefill",
                        "router.kv_handoff", "router.decode", "serve.disagg_prefill",
                        "serve.kv_send", "serve.request", "serve.queue", "serve.prefill",
                        "serve.decode"}
                deadline = time.monotonic() + 10
                while (want - {s.name for s in exporter.get_finished_spans()}
                       and time.monotonic() < deadline):
                    time.sleep(0.05)
    finally:
        p_engine.shutdown()
        d_engine.shutdown()
        d_role.receiver.close()  # its threads would outlive the test
    spans = exporter.get_finished_spans()
    names = {s.name for s in spans}
    assert want <= names, want - names
    assert len({s.context.trace_id for s in spans}) == 1  # one trace
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)

    def parent_of(name):
        (s,) = by_name[name]
        return next(p.name for p in spans if p.context.span_id == s.parent.span_id)

    assert by_name["gateway POST /v1/completions"][0].parent is None  # the root
    assert parent_of("router POST /v1/completions") == "gateway.upstream"
    assert parent_of("serve.disagg_prefill") == "router.prefill"
    assert parent_of("serve.request") == "router.decode"
    assert parent_of("router.kv_handoff") == "router.prefill"
    prefills = {next(p.name for p in spans if p.context.span_id == s.parent.span_id)
                for s in by_name["serve.prefill"]}
    assert prefills == {"serve.disagg_prefill", "serve.request"}  # one on each worker
    decode = by_name["serve.decode"][0]
    assert decode.attributes["qserve.completion_tokens"] == 4
    assert by_name["gateway.cache"][0].attributes["qserve.cache"] == "miss"


def test_tracing_is_off_and_its_sdk_unloaded_without_the_variables(tmp_path):
    code = ("import sys, qserve.runtime.gateway.app, qserve.runtime.server.app, "
            "qserve.runtime.disagg.router_app\n"
            "from qserve.runtime import telemetry\n"
            "print(telemetry.configure('x'), any(m.startswith('opentelemetry.sdk') "
            "for m in sys.modules))")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_the_standard_variables_turn_it_on(monkeypatch):
    for name, value, on in (("OTEL_TRACES_EXPORTER", "console", True),
                            ("OTEL_TRACES_EXPORTER", "none", False),
                            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318", True)):
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.setenv(name, value)
        assert telemetry.wanted() is on
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.wanted() is False
