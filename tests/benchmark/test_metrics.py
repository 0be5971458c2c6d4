"""Metric math against values computed by hand from synthetic timings."""

import math

import pytest

from qserve.runtime.benchmark.client import RequestResult
from qserve.runtime.benchmark.errors import BenchmarkError
from qserve.runtime.benchmark.metrics import compute_metrics, latency_stats


def _results():
    # r1: 4 tokens, TTFT 0.1 s, E2EL 0.4 s  -> TPOT 0.1 s, ITL 0.1 0.1 0.1
    # r2: 2 tokens, TTFT 0.2 s, E2EL 0.5 s  -> TPOT 0.3 s, ITL 0.3
    # r3: 1 token,  TTFT 0.05 s, E2EL 0.05 s -> no TPOT, no ITL
    # r4: failed
    return [
        RequestResult(True, 10, 4, 4, ttft=0.1, e2el=0.4, itl=[0.1, 0.1, 0.1]),
        RequestResult(True, 20, 2, 2, ttft=0.2, e2el=0.5, itl=[0.3]),
        RequestResult(True, 5, 1, 1, ttft=0.05, e2el=0.05, itl=[]),
        RequestResult(False, 7, 0, 3, error="HTTP 500: boom"),
    ]


def test_counts_and_throughputs():
    m = compute_metrics(_results(), duration_s=2.0, skipped=1)
    assert (m.completed, m.failed, m.skipped) == (3, 1, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.expected_output_tokens) == (35, 7, 7)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 3.5
    assert m.total_token_throughput == 21.0
    assert m.goodput is None
    assert m.errors == ["HTTP 500: boom"]


def test_latency_percentiles_by_hand():
    m = compute_metrics(_results(), duration_s=2.0)
    # TTFT ms sorted [50, 100, 200]: p90 at rank 1.8 -> 100 + 0.8 * 100
    assert m.ttft.count == 3
    assert m.ttft.mean == pytest.approx(350 / 3, rel=1e-12)
    assert m.ttft.median == pytest.approx(100, rel=1e-12)
    assert m.ttft.percentiles["p90"] == pytest.approx(180, rel=1e-12)
    assert m.ttft.percentiles["p99"] == pytest.approx(198, rel=1e-12)
    mean = 350 / 3
    std = math.sqrt(((50 - mean) ** 2 + (100 - mean) ** 2 + (200 - mean) ** 2) / 3)
    assert m.ttft.std == pytest.approx(std, rel=1e-12)
    # TPOT ms [100, 300] (r3 has none)
    assert m.tpot.count == 2
    assert m.tpot.mean == pytest.approx(200, rel=1e-12)
    assert m.tpot.percentiles["p90"] == pytest.approx(280, rel=1e-12)
    # ITL ms [100, 100, 100, 300]: every gap pooled; p90 at rank 2.7 -> 100 + 0.7 * 200
    assert m.itl.count == 4
    assert m.itl.mean == pytest.approx(150, rel=1e-12)
    assert m.itl.median == pytest.approx(100, rel=1e-12)
    assert m.itl.percentiles["p90"] == pytest.approx(240, rel=1e-12)
    assert m.itl.percentiles["p99"] == pytest.approx(294, rel=1e-12)
    # E2EL ms sorted [50, 400, 500]
    assert m.e2el.median == pytest.approx(400, rel=1e-12)
    assert m.e2el.percentiles["p90"] == pytest.approx(480, rel=1e-12)


def test_goodput_counts_requests_within_every_slo():
    # r1 meets both, r2 misses TTFT (200 > 150), r3 meets both (no TPOT counts as 0)
    m = compute_metrics(_results(), duration_s=2.0, slos_ms={"ttft": 150, "tpot": 200})
    assert m.goodput == 1.0
    # a TPOT bound of 50 ms drops r1 (100 ms) too
    m = compute_metrics(_results(), duration_s=2.0, slos_ms={"ttft": 150, "tpot": 50})
    assert m.goodput == 0.5


def test_custom_percentiles_and_empty_samples():
    s = latency_stats([0.001, 0.002, 0.003, 0.004], percentiles=(25.0, 75.0))
    assert s.percentiles == {"p25": pytest.approx(1.75), "p75": pytest.approx(3.25)}
    empty = latency_stats([], percentiles=(50.0,))
    assert (empty.count, empty.mean, empty.percentiles) == (0, 0.0, {"p50": 0.0})


def test_bad_slo_and_duration_are_clear_errors():
    with pytest.raises(BenchmarkError, match="unknown SLO metric 'latency'"):
        compute_metrics(_results(), 2.0, slos_ms={"latency": 10})
    with pytest.raises(BenchmarkError, match="positive"):
        compute_metrics(_results(), 2.0, slos_ms={"ttft": 0})
    with pytest.raises(BenchmarkError, match="no time"):
        compute_metrics(_results(), 0.0)


def test_metrics_round_trip_through_json():
    import json

    from qserve.runtime.benchmark.metrics import BenchmarkMetrics

    m = compute_metrics(_results(), duration_s=2.0, slos_ms={"ttft": 150})
    assert BenchmarkMetrics.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_steady_decode_is_the_window_where_every_request_decodes():
    # a: sent at 0, first token at 1.0, 8 more 0.125 s apart -> ends at 2.0
    # b: sent at 0.5, first token at 1.5, the same -> ends at 2.5
    # window (1.5, 2.0]: a's chunks at 1.625 .. 2.0 and b's at the same times: 8 chunks
    a = RequestResult(True, 10, 9, 9, start=0.0, ttft=1.0, e2el=2.0, itl=[0.125] * 8)
    b = RequestResult(True, 10, 9, 9, start=0.5, ttft=1.0, e2el=2.0, itl=[0.125] * 8)
    m = compute_metrics([a, b], duration_s=2.5)
    s = m.steady_decode
    assert (s.streams, s.window_s, s.chunks) == (2, 0.5, 8)
    assert s.chunk_rate == 16.0 and s.gap_ms == 125.0
    assert type(m).from_dict(m.to_dict()) == m  # kept in and read back from a JSON report
    # b sent after a ended: they never decode together
    late = RequestResult(True, 10, 9, 9, start=2.5, ttft=1.0, e2el=2.0, itl=[0.125] * 8)
    assert compute_metrics([a, late], duration_s=4.5).steady_decode is None
