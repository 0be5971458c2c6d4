"""Decode step times by number of sequences: the engine's record, the smoothing, and the
interpolation a router predicts time per output token with."""

import math
import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.step_times import ALPHA, StepTimes, step_at

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402


def test_each_size_is_smoothed_on_its_own_and_bad_samples_are_dropped():
    t = StepTimes()
    t.record(4, 0.020)
    t.record(1, 0.010)
    t.record(4, 0.030)
    for rows, seconds in ((0, 0.1), (-1, 0.1), (10**6, 0.1), (2, 0.0), (2, -1.0),
                          (2, math.nan), (2, math.inf)):
        t.record(rows, seconds)
    assert t.snapshot() == {1: 0.010, 4: pytest.approx(ALPHA * 0.030 + (1 - ALPHA) * 0.020)}
    assert list(t.snapshot()) == [1, 4]


def test_step_at_measured_between_and_beyond():
    table = {1: 0.010, 3: 0.014, 5: 0.022}
    assert step_at(table, 3) == 0.014
    assert step_at(table, 2) == pytest.approx(0.012)          # halfway between 1 and 3
    assert step_at(table, 4) == pytest.approx(0.018)
    # beyond: the least-squares slope of all three (0.003 per sequence) from the largest
    assert step_at(table, 7) == pytest.approx(0.022 + 2 * 0.003)
    assert step_at({2: 0.010, 4: 0.010, 6: 0.010}, 9) == pytest.approx(0.010)  # flat
    assert step_at({2: 0.020, 4: 0.010}, 6) == pytest.approx(0.010)   # never decreasing
    assert step_at({2: 0.012, 4: 0.016}, 1) == 0.012        # below: the smallest measured
    assert step_at({2: 0.010}, 4) == pytest.approx(0.020)   # one size: proportional
    assert step_at({2: 0.010}, 1) == 0.010
    assert step_at({}, 3) is None
    with pytest.raises(ValueError):
        step_at(table, 0)


def test_the_engine_records_decode_steps_only(tmp_path):
    torch.set_num_threads(1)
    lm = load(str(write_tiny_llama(tmp_path / "tiny")), torch.float32)
    llm = LLM(lm, config=EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64,
                                      kv_dtype="bf16", decode_impl="eager"))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(5, 35)), list(range(40, 70))], params)   # 30-token prompts
    table = llm.engine.step_times.snapshot()
    # one prompt step for both (60 tokens: a prefill, not recorded), then decode steps of
    # both sequences; none of one sequence, none of more
    assert list(table) == [2] and 0 < table[2] < 60
