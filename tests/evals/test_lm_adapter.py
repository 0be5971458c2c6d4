"""The lm-eval model `qserve` on a tiny random model: scoring matches the engine's own
prompt logprobs, generation keeps request order across setting groups."""

import sys
from pathlib import Path

import pytest
import torch

from qserve.evals.lm_adapter import QserveLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    torch.set_num_threads(1)
    root = write_tiny_llama(tmp_path_factory.mktemp("adapter") / "tiny")
    return QserveLM(model=str(root), dtype="float32", batch_size=8)


def test_generation_order_and_groups(lm):
    a = ("hello world", {"until": [], "max_gen_toks": 5})
    b = ("the cat sat", {"until": ["zz"], "max_gen_toks": 3})
    mixed = lm._generate([a, b, a, b])
    assert mixed[0] == mixed[2] and mixed[1] == mixed[3]
    assert mixed[0] == lm.greedy(["hello world"], 5)[0]


def test_scoring_sums_continuation_logprobs(lm):
    ctx = lm.tok_encode("one two three")
    cont = lm.tok_encode(" four five", add_special_tokens=False)
    (ll, greedy), = lm._score([(ctx, cont)])
    out = lm.llm.generate([ctx + cont], __import__("qserve.runtime.sampling_params",
                          fromlist=["SamplingParams"]).SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    expect = sum(t.logprob for t in out.prompt_logprobs[-len(cont):])
    assert ll == pytest.approx(expect, rel=1e-5, abs=1e-5)
    assert isinstance(greedy, bool)
    with pytest.raises(ValueError, match="empty continuation"):
        lm._score([(ctx, [])])
