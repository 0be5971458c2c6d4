"""Fuzz check: schemathesis generates requests from the live server's /openapi.json.

Every operation the schema declares gets up to `examples` schema-valid requests
(schemathesis's positive mode) and as many schema-violating ones (negative mode, where
the schema leaves anything to violate). Criteria: no 5xx, no server error inside a
200 SSE stream, every 4xx body an OpenAI error object, and an answer to every request
(a refused or reset connection means the server went down). Responses are checked here
rather than shrunk by hypothesis, so a failure costs one request, not a search.

The server runs with a small KV pool: the context (and so any generated max_tokens)
stays a few hundred tokens, which keeps one generated example to seconds on a CPU.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from .errors import BenchmarkError
from .reliability_result import CheckResult
from .reliability_server import ServeOptions, openai_error_problem, start_server

FUZZ_KV_CACHE_GIB = "0.004"  # ~186 tokens of context for smollm2-135m (bf16 KV)
MAX_KEPT_FAILURES = 20


@dataclass
class FuzzFailure:
    operation: str
    mode: str
    status: int | None
    problem: str
    request: str  # a curl command that repeats it
    response: str  # the start of the body


@dataclass
class OperationStats:
    operation: str
    examples: int = 0
    by_mode: dict[str, int] = field(default_factory=dict)
    status_counts: dict[str, int] = field(default_factory=dict)  # "positive 400" -> n
    not_applicable: list[str] = field(default_factory=list)  # modes with nothing to generate


def classify_response(status: int, content_type: str, body: bytes) -> str | None:
    """The problem with one response, or None. 5xx is a problem; so is a server error
    event inside an SSE stream and a 4xx body that is not an OpenAI error object."""
    if status >= 500:
        return f"HTTP {status} (server error)"
    if 400 <= status < 500:
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return f"HTTP {status} body is not JSON"
        problem = openai_error_problem(parsed)
        return f"HTTP {status} body is not an OpenAI error: {problem}" if problem else None
    if status == 200 and content_type.startswith("text/event-stream"):
        for line in body.decode("utf-8", "replace").splitlines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if not data.startswith("{"):
                continue
            try:
                event = json.loads(data)
            except ValueError:
                return "SSE event is not JSON"
            if isinstance(event, dict) and "error" in event:
                err = event["error"] if isinstance(event["error"], dict) else {}
                if err.get("type") == "server_error":
                    return f"server error event in a 200 stream: {str(err)[:200]}"
    return None


def run_fuzz_against(base: str, examples: int, seed: int = 0,
                     request_timeout: float = 120.0) -> CheckResult:
    """Fuzz the server at `base` (already running) and judge the answers."""
    try:
        import schemathesis
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis.errors import Unsatisfiable
        from schemathesis import GenerationMode
    except ImportError:
        raise BenchmarkError("the fuzz check needs schemathesis 4: "
                             "pip install 'qserve[reliability]'") from None

    res = CheckResult("fuzz")
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    failures: list[FuzzFailure] = []
    problems: Counter[str] = Counter()
    transport_errors: list[str] = []
    ops: list[OperationStats] = []
    statuses: Counter[str] = Counter()
    schema_errors: list[str] = []
    with_body: list[str] = []
    rejected_valid: list[dict] = []  # schema-valid requests the server refused (samples)
    for result in schema.get_all_operations():
        try:
            op = result.ok()
        except Exception as e:  # an operation the schema describes in a way it cannot use
            schema_errors.append(str(e)[:300])
            continue
        stats = OperationStats(op.label)
        ops.append(stats)
        if isinstance(op.definition.raw, dict) and op.definition.raw.get("requestBody"):
            with_body.append(op.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            count = 0
            mode_name = mode.value

            def one(case):
                nonlocal count
                count += 1
                try:
                    r = case.call(base_url=base, timeout=request_timeout)
                except Exception as e:  # requests' connection errors and timeouts
                    transport_errors.append(f"{op.label}: {type(e).__name__}: {e}"[:300])
                    return
                statuses[str(r.status_code)] += 1
                key = f"{mode_name} {r.status_code}"
                stats.status_counts[key] = stats.status_counts.get(key, 0) + 1
                if mode_name == "positive" and 400 <= r.status_code < 500 \
                        and sum(x["operation"] == op.label for x in rejected_valid) < 4:
                    rejected_valid.append({"operation": op.label, "status": r.status_code,
                                           "body": _body_text(case)[:300],
                                           "answer": r.content[:300].decode("utf-8", "replace")})
                problem = classify_response(r.status_code, _header(r.headers, "content-type"),
                                            r.content)
                if problem is None:
                    return
                key = f"{op.label}: {problem.split(':')[0]}"
                problems[key] += 1
                if problems[key] <= 3 and len(failures) < MAX_KEPT_FAILURES:
                    failures.append(FuzzFailure(op.label, mode_name, r.status_code, problem,
                                                _curl(case, base),
                                                r.content[:500].decode("utf-8", "replace")))

            test = given(case=op.as_strategy(generation_mode=mode))(one)
            test = settings(max_examples=examples, deadline=None, database=None,
                            phases=[Phase.explicit, Phase.generate],
                            suppress_health_check=list(HealthCheck))(test)
            test = hypothesis_seed(seed)(test)
            try:
                test()
            except Unsatisfiable:
                stats.not_applicable.append(mode.value)
            stats.by_mode[mode.value] = count
            stats.examples += count
    total = sum(s.examples for s in ops)
    n5xx = sum(v for k, v in statuses.items() if k.startswith("5"))
    res.measurements.update(
        operations=len(ops), examples=total, status_counts=dict(sorted(statuses.items())),
        per_operation=[asdict(s) for s in ops], problems=dict(problems),
        failures=[asdict(f) for f in failures], transport_errors=transport_errors[:10],
        schema_errors=schema_errors, examples_per_operation_and_mode=examples,
        request_bodies_declared=with_body, schema_valid_rejected_samples=rejected_valid,
        schema_valid_rejected=sum(v for s in ops for k, v in s.status_counts.items()
                                  if k.startswith("positive 4")),
        schema_valid_sent=sum(s.by_mode.get("positive", 0) for s in ops))
    res.require("operations exercised", total > 0 and len(ops) > 0,
                f"{len(ops)} operations, {total} requests")
    res.require("no 5xx", n5xx == 0, f"{n5xx} responses with status 5xx")
    stream_errors = sum(v for k, v in problems.items() if "server error event" in k)
    res.require("no server error in a stream", stream_errors == 0,
                f"{stream_errors} 200 streams carrying a server_error event")
    bad4xx = sum(v for k, v in problems.items() if "not an OpenAI error" in k
                 or "body is not JSON" in k)
    res.require("every 4xx is an OpenAI error object", bad4xx == 0,
                f"{bad4xx} 4xx responses with another body")
    res.require("every request answered", not transport_errors,
                f"{len(transport_errors)} requests got no HTTP answer"
                + (f" (first: {transport_errors[0]})" if transport_errors else ""))
    return res


def _header(headers: dict, name: str) -> str:
    """One header of a schemathesis response (values are lists), case-insensitively."""
    for k, v in headers.items():
        if k.lower() == name:
            return v[0] if isinstance(v, list) and v else str(v)
    return ""


def _body_text(case) -> str:
    """The case's JSON body; for a case without one, its path and query parameters."""
    body = getattr(case, "body", None)
    try:
        return json.dumps(body)
    except (TypeError, ValueError):
        params = {"path": getattr(case, "path_parameters", None),
                  "query": getattr(case, "query", None)}
        return json.dumps({k: v for k, v in params.items() if v}, default=str)


def _curl(case, base: str) -> str:
    try:
        return case.as_curl_command(headers=None)[:2000].replace(
            str(case.operation.schema.get_base_url()).rstrip("/"), base)
    except Exception:  # the curl rendering is a convenience; never fail the check on it
        return f"{case.operation.label} body={_body_text(case)[:1500]}"


def run_fuzz(opts: ServeOptions, examples: int, seed: int = 0) -> CheckResult:
    """Start a server with a small KV pool and fuzz it."""
    t0 = time.monotonic()
    with start_server(opts, "fuzz", ("--kv-cache-gib", FUZZ_KV_CACHE_GIB)) as server:
        res = run_fuzz_against(server.base, examples, seed)
        res.measurements["server_log"] = str(server.log)
        alive = server.proc.poll() is None
    res.require("server alive at the end", alive, "the server process had exited"
                if not alive else "running")
    res.notes.append(f"server started with --kv-cache-gib {FUZZ_KV_CACHE_GIB} so that a "
                     "generated max_tokens stays within a few hundred tokens")
    res.duration_s = time.monotonic() - t0
    return res
