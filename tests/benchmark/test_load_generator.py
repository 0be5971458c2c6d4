"""Arrival schedules of the load generator."""

import math
import random

import pytest

from qserve.runtime.benchmark.errors import BenchmarkError
from qserve.runtime.benchmark.load_generator import LoadConfig, arrival_times
from qserve.runtime.benchmark.workloads import RequestSpec


def _specs(n, arrivals=None):
    return [RequestSpec("x", 1, 1, arrival=None if arrivals is None else arrivals[i])
            for i in range(n)]


def test_all_at_once_without_a_rate():
    assert arrival_times(_specs(4), LoadConfig()) == [0.0] * 4


def test_poisson_gaps_are_seeded_exponentials():
    times = arrival_times(_specs(5), LoadConfig(request_rate=2.0, seed=7))
    rng = random.Random(7)
    expected, t = [], 0.0
    for _ in range(5):
        expected.append(t)
        t += rng.expovariate(2.0)
    assert times == expected
    many = arrival_times(_specs(20000), LoadConfig(request_rate=4.0, seed=1))
    assert many[-1] / (len(many) - 1) == pytest.approx(0.25, rel=0.03)  # mean gap 1/rate


def test_trace_arrivals_win_and_bad_rates_fail():
    assert arrival_times(_specs(3, [0.0, 0.5, 2.0]), LoadConfig(request_rate=100.0)) == \
        [0.0, 0.5, 2.0]
    with pytest.raises(BenchmarkError, match="--request-rate must be positive"):
        arrival_times(_specs(2), LoadConfig(request_rate=0.0))
    assert math.isinf(LoadConfig().request_rate)
