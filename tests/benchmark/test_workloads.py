"""Workload generation: exact token lengths, seeds, a shared prefix that is really shared,
and trace files (good and bad)."""

import json

import pytest

from qserve.runtime.benchmark.errors import BenchmarkError
from qserve.runtime.benchmark.prompt_tokenizer import LocalTokenizer
from qserve.runtime.benchmark.workloads import (PromptBuilder, WorkloadParams, default_corpus,
                                                make_workload)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return LocalTokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def builder(tok):
    return PromptBuilder(tok, default_corpus())


def test_random_prompts_have_exact_token_lengths(tok, builder):
    specs = make_workload("random", WorkloadParams(num_prompts=12, input_len=37, output_len=9),
                          builder)
    assert len(specs) == 12
    for s in specs:
        assert len(tok.encode(s.prompt)) == 37 == s.prompt_len  # re-tokenized independently
        assert s.output_len == 9 and s.arrival is None
    assert len({s.prompt for s in specs}) == 12  # different windows of the corpus


def test_range_ratio_bounds_and_seeds(builder):
    p = WorkloadParams(num_prompts=30, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    a = make_workload("random", p, builder)
    assert all(20 <= s.prompt_len <= 60 and 10 <= s.output_len <= 30 for s in a)
    assert len({s.prompt_len for s in a}) > 5
    again = make_workload("random", p, builder)
    assert [(s.prompt, s.output_len) for s in again] == [(s.prompt, s.output_len) for s in a]
    other = make_workload("random", WorkloadParams(**{**p.__dict__, "seed": 4}), builder)
    assert [s.prompt for s in other] != [s.prompt for s in a]


def test_shared_prefix_is_really_shared(tok, builder):
    p = WorkloadParams(num_prompts=6, prefix_len=150, question_len=12, output_len=4)
    specs = make_workload("shared-prefix", p, builder)
    ids = [tok.encode(s.prompt) for s in specs]
    first = ids[0][:150]
    assert all(x[:150] == first for x in ids)  # the 150-token document, token for token
    assert all(s.prefix_len >= 150 for s in specs)
    assert len({tuple(x[150:]) for x in ids}) == 6  # each user's own question
    assert all(len(x) == s.prompt_len > 150 + 12 for x, s in zip(ids, specs))


def test_mixed_has_short_and_long_requests(builder):
    p = WorkloadParams(num_prompts=40, input_len=16, output_len=8, long_fraction=0.3,
                       long_input_len=200, long_output_len=3, seed=1)
    specs = make_workload("mixed", p, builder)
    long = [s for s in specs if s.prompt_len == 200]
    short = [s for s in specs if s.prompt_len == 16]
    assert len(long) + len(short) == 40 and 4 <= len(long) <= 20
    assert {s.output_len for s in long} == {3} and {s.output_len for s in short} == {8}


def test_trace_file(tmp_path, tok, builder):
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0.5, "input_len": 20, "output_len": 4},
            {"timestamp": 0.0, "prompt": "def f(x): return x", "output_len": 2},
            {"timestamp": 1.25, "input_len": 7, "output_len": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = make_workload("trace", WorkloadParams(trace_file=str(path)), builder)
    assert [s.arrival for s in specs] == [0.0, 0.5, 1.25]
    assert [s.prompt_len for s in specs] == [len(tok.encode("def f(x): return x")), 20, 7]
    assert [s.output_len for s in specs] == [2, 4, 1]
    assert specs[0].prompt == "def f(x): return x"


@pytest.mark.parametrize("content, message", [
    ('{"timestamp": 0, "input_len": 5}\n', r"trace.jsonl:1: \"output_len\" must be"),
    ('{"timestamp": 0, "input_len": 5, "output_len": 2}\n{oops\n', r"trace.jsonl:2: not valid"),
    ('{"timestamp": -1, "input_len": 5, "output_len": 2}\n', r"\"timestamp\" must be"),
    ('{"timestamp": 0, "output_len": 2}\n', r"give \"prompt\" \(text\) or \"input_len\""),
    ('[1, 2]\n', r"must be a JSON object"),
    ('\n\n', r"no requests"),
])
def test_bad_trace_files_say_what_is_wrong(tmp_path, builder, content, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    with pytest.raises(BenchmarkError, match=message):
        make_workload("trace", WorkloadParams(trace_file=str(path)), builder)


def test_bad_parameters(tmp_path, builder):
    with pytest.raises(BenchmarkError, match="no such file"):
        make_workload("trace", WorkloadParams(trace_file=str(tmp_path / "nope.jsonl")), builder)
    with pytest.raises(BenchmarkError, match="needs --trace-file"):
        make_workload("trace", WorkloadParams(), builder)
    with pytest.raises(BenchmarkError, match="unknown workload 'sharegpt'"):
        make_workload("sharegpt", WorkloadParams(), builder)
    with pytest.raises(BenchmarkError, match="range-ratio"):
        make_workload("random", WorkloadParams(range_ratio=1.5), builder)
