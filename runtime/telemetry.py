"""OpenTelemetry traces of a request across `qserve gateway`, `qserve router` and
`qserve serve`: one trace per request, a span per hop and stage, linked across processes
by the W3C `traceparent` header.

Off unless configured, by the standard variables: `OTEL_TRACES_EXPORTER` (`otlp`, or
`console`), or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; the exporter then is OTLP over HTTP);
`OTEL_SDK_DISABLED=true` turns it off; `OTEL_SERVICE_NAME` names the process (default:
qserve-gateway, qserve-router, qserve-serve). Off, nothing of OpenTelemetry is imported
and every call here returns at its first line.

    configure("qserve-serve")                      # once, at a command's start
    with span("gateway.cache", {"cache": "hit"}):  # a child of the current span
        ...
    s = start_span("serve.request", parent=extract(headers), kind="server"); ...
    end(s, {"http.response.status_code": 200})     # set the attributes, end it (None: no-op)
    inject(headers)                                # traceparent of the current span
    record_span("serve.queue", start_s, end_s, attrs, parent=s)   # monotonic seconds
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

_tracer = None  # an opentelemetry Tracer while tracing is on
# wall-clock nanoseconds = monotonic seconds * 1e9 + this (spans timed after the fact)
_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def wanted() -> bool:
    """Whether the environment asks for traces."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter:
        return exporter != "none"
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(service: str, exporter=None) -> bool:
    """Turn tracing on in this process when the environment asks for it, or with
    `exporter` (a SpanExporter; tests pass an in-memory one, exported synchronously).
    Returns whether tracing is on. A second call replaces the first's exporter."""
    global _tracer
    if exporter is None and not wanted():
        _tracer = None
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_env_exporter()))
    _tracer = provider.get_tracer("qserve")
    return True


def _env_exporter():
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower()
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r} is not supported here: use otlp, "
                         f"console or none.")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout: the OTEL_EXPORTER_OTLP_* vars


def disable() -> None:
    global _tracer
    _tracer = None


def _kind(kind: str | None):
    from opentelemetry.trace import SpanKind

    return {"server": SpanKind.SERVER, "client": SpanKind.CLIENT,
            None: SpanKind.INTERNAL}[kind]


@contextlib.contextmanager
def span(name: str, attributes: dict | None = None, kind: str | None = None) -> Iterator:
    """A span around the block, a child of the current one (None when tracing is off)."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, kind=_kind(kind),
                                       attributes=_clean(attributes)) as s:
        yield s


def start_span(name: str, attributes: dict | None = None, parent=None,
               kind: str | None = None):
    """A span that outlives a block (end it with `end`), under `parent` (a context
    from `extract`, or a span), else under the current span; None when off."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.set_span_in_context(parent) if _is_span(parent) else parent
    return _tracer.start_span(name, context=context, kind=_kind(kind),
                              attributes=_clean(attributes))


def end(span_, attributes: dict | None = None) -> None:
    """Set `attributes` (None values left out) on a span from `start_span` and end it; a
    no-op for None (tracing off)."""
    if span_ is None:
        return
    for key, value in (_clean(attributes) or {}).items():
        span_.set_attribute(key, value)
    span_.end()


@contextlib.contextmanager
def current(span_) -> Iterator[None]:
    """Make `span_` the current span in the block (children and `inject` follow it)."""
    if _tracer is None or span_ is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span_, end_on_exit=False):
        yield


def record_span(name: str, start_s: float, end_s: float, attributes: dict | None = None,
                parent=None) -> None:
    """A finished span from monotonic times (stages timed elsewhere, e.g. the engine)."""
    if _tracer is None or parent is None:
        return
    from opentelemetry import trace

    context = trace.set_span_in_context(parent) if _is_span(parent) else parent
    s = _tracer.start_span(name, context=context, attributes=_clean(attributes),
                           start_time=int(start_s * 1e9) + _EPOCH_NS)
    s.end(end_time=max(int(end_s * 1e9) + _EPOCH_NS, int(start_s * 1e9) + _EPOCH_NS))


def inject(headers: dict) -> dict:
    """Add the current span's `traceparent` (and `tracestate`) to `headers`; returns it."""
    if _tracer is not None:
        from opentelemetry import propagate

        propagate.inject(headers)
    return headers


def extract(headers) -> object | None:
    """The remote parent context in a request's headers (a Starlette Headers or a dict of
    str), or None when off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    return propagate.extract({k.lower(): v for k, v in dict(headers).items()})


def _is_span(obj) -> bool:
    return obj is not None and hasattr(obj, "get_span_context")


def _clean(attributes: dict | None) -> dict | None:
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
