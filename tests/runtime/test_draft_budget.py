"""The draft budget (runtime/spec/draft_budget.py): the cap that maximizes expected tokens
per second from measured step times and per-request acceptance; in the engine, greedy
outputs identical to the non-speculative engine's whatever it cuts."""

import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.request import Request
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.draft_budget import (PRIOR, PROBE_AFTER, DraftBudget, DraftState,
                                              expected_tokens)
from qserve.runtime.spec.proposer import Proposal, ProposeRequest, make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import spec_engine_config, spec_prompts, write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.draft_budget

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _decoding(rid, params=GREEDY):
    req = Request(rid, [1, 2, 3], params)
    req.num_computed_tokens = 2  # one token left to compute: decoding
    return req


def _budget(table, k=5):
    b = DraftBudget(k)
    for rows, seconds in table.items():
        b.record(rows, seconds)
    return b


def _drafts(n):
    return Proposal(list(range(100, 100 + n)))


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 5) == 6


def test_no_measured_step_keeps_every_draft():
    b = DraftBudget(5)
    props = {"a": _drafts(5)}
    assert b.cap(props, [_decoding("a")]) == props


def test_rows_that_cost_nothing_keep_every_draft_and_unmeasured_sizes_are_tried():
    # a size beyond the measured ones is taken at the largest measured size's time
    assert _budget({1: 0.010}).cap({"a": _drafts(5)}, [_decoding("a")])["a"].token_ids == \
        list(range(100, 105))
    near_free = _budget({1: 0.010, 6: 0.0105})
    assert len(near_free.cap({"a": _drafts(5)}, [_decoding("a")])["a"].token_ids) == 5


def test_fewer_rows_than_any_measured_are_tried_at_the_smallest_sizes_cost_per_row():
    # only six-row verifications measured (60 ms): one row is taken at 10 ms, so no
    # draft (1 token in 10 ms) beats five at the prior (1.97 tokens in 60 ms)
    b = _budget({6: 0.060})
    assert b.cap({"a": _drafts(5)}, [_decoding("a")]) == {}


def test_costly_verification_takes_the_cap_that_pays():
    # an AVX2-like machine: 2 rows 21 ms, 6 rows 45 ms against 18 ms for one. At the
    # prior (0.5): 1 draft gives 1.5 tokens in 21 ms (71/s) > 1 in 18 (56/s) > 1.75 in 27
    b = _budget({1: 0.018, 2: 0.021, 6: 0.045})
    out = b.cap({"a": _drafts(5)}, [_decoding("a")])
    assert out["a"].token_ids == [100]
    for _ in range(8):  # every draft rejected: no draft pays any more
        b.observe("a", 1, 0)
    assert b.states["a"].acceptance < 0.1
    assert b.cap({"a": _drafts(5)}, [_decoding("a")]) == {}
    for _ in range(PROBE_AFTER - 1):  # held at none, then given the prior again
        assert b.cap({"a": _drafts(5)}, [_decoding("a")]) == {}
    assert b.states["a"].acceptance == PRIOR
    assert b.cap({"a": _drafts(5)}, [_decoding("a")])["a"].token_ids == [100]


def test_a_request_whose_drafts_are_accepted_keeps_more():
    b = _budget({1: 0.018, 2: 0.021, 6: 0.045})
    for _ in range(20):
        b.observe("a", 5, 5)
    assert b.states["a"].acceptance > 0.99
    assert len(b.cap({"a": _drafts(5)}, [_decoding("a")])["a"].token_ids) == 5


def test_only_the_requests_whose_drafts_pay_draft():
    """Of two greedy requests, one whose drafts are nearly always accepted and one whose
    drafts nearly always fail: the first keeps two (3.85 tokens in 26 ms, 148/s), the
    second drafts none, where one cap for both would verify one draft of each (3.0 tokens
    in 26 ms, 115/s)."""
    b = _budget({2: 0.020, 3: 0.023, 4: 0.026, 7: 0.045, 12: 0.070})
    b.states["good"] = DraftState(acceptance=0.95)
    b.states["bad"] = DraftState(acceptance=0.05)
    running = [_decoding("good"), _decoding("bad")]
    out = b.cap({"good": _drafts(5), "bad": _drafts(5)}, running)
    assert out == {"good": _drafts(2)}
    assert b.states["bad"].held == 1 and b.states["good"].held == 0
    planned = b.plan([ProposeRequest(r, 5) for r in running], running)
    assert planned == {"good": 2}


def test_seeded_sampled_requests_keep_their_drafts_unseeded_ones_are_capped():
    b = _budget({1: 0.018, 7: 0.1, 12: 0.3})  # the seeded drafts' 7 rows are scored anyway
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    unseeded = SamplingParams(max_tokens=8, temperature=0.8)
    props = {"s": _drafts(5), "g": _drafts(5), "u": _drafts(5)}
    out = b.cap(props, [_decoding("s", seeded), _decoding("g"), _decoding("u", unseeded)])
    assert out == {"s": props["s"]}


def test_acceptance_estimate_counts_only_scored_drafts():
    b = DraftBudget(4)
    b.observe("a", 4, 1)  # one kept, the second rejected, two never scored: 1 of 2
    assert b.states["a"].acceptance == pytest.approx(0.7 * PRIOR + 0.3 * 0.5)
    b.observe("a", 4, 4)  # all kept: 4 of 4
    b.release("a")
    assert "a" not in b.states


def test_plan_asks_a_model_proposer_for_the_cap_before_it_drafts():
    running = [_decoding("a"), _decoding("s", SamplingParams(temperature=0.8, seed=3))]
    batch = [ProposeRequest(r, 5) for r in running]
    assert DraftBudget(5).plan(batch, running) == {"a": 5, "s": 5}  # nothing measured
    free = _budget({2: 0.010, 12: 0.0101})
    assert free.plan(batch, running) == {"a": 5, "s": 5}
    dear = _budget({2: 0.010, 3: 0.015, 7: 0.035, 12: 0.060})  # every row as dear
    dear.states["a"] = DraftState(acceptance=0.1)
    assert dear.plan(batch, running) == {"s": 5}  # "a" is not drafted for; the seeded one is
    assert dear.states["a"].held == 1
    one = _budget({1: 0.010, 2: 0.011, 6: 0.060})  # a second row is cheap, more are not
    one.states["a"] = DraftState(acceptance=0.9)
    assert one.plan(batch[:1], running[:1]) == {"a": 1}


def test_a_request_planned_at_none_is_probed_again():
    """plan() holds a request cut to none like cap() does: after PROBE_AFTER such steps
    it has the prior again (else a request once cut would never be drafted for)."""
    dear = _budget({1: 0.010, 6: 0.060})
    running = [_decoding("a")]
    dear.states["a"] = DraftState(acceptance=0.0)
    for _ in range(PROBE_AFTER):
        assert dear.plan([ProposeRequest(running[0], 5)], running) == {}
    assert dear.states["a"].acceptance == PRIOR and dear.states["a"].held == 0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return load(str(write_tiny_llama(tmp_path_factory.mktemp("budget") / "t")), torch.float32)


def _reference_and_speculative(target, tmp_path, proposer):
    """(3 prompts, the non-speculative engine's greedy outputs for them, an LLM that
    speculates with `proposer` at k = 4), with a step budget the prompts fit in: decode-only
    steps, which the cost table takes."""
    options = {"ngram": {"min_n": 1}, "early_exit": {"num_layers": 1},
               "draft_model": {"path": load(str(write_tiny_llama(
                   tmp_path / "draft", seed=1, num_hidden_layers=1)), torch.float32)}}[proposer]
    prompts = spec_prompts(3)
    ref = LLM(target, config=spec_engine_config(max_num_batched_tokens=64)).generate(
        prompts, GREEDY)
    llm = LLM(target, config=spec_engine_config(make_config(proposer, 4, **options),
                                                max_num_batched_tokens=64))
    return prompts, ref, llm


@pytest.mark.parametrize("proposer, cost, cuts", [
    ("ngram", "rows", True), ("ngram", "flat", False), ("early_exit", "rows", True),
    ("draft_model", "rows", True)])
def test_engine_cuts_drafts_only_where_rows_cost(target, tmp_path, proposer, cost, cuts):
    """Step times replaced by a model of the machine: every row as dear as a step (drafts
    never pay once measured) or rows free (they always do). The greedy tokens are the
    non-speculative engine's either way, for proposers with state of their own (a draft
    model's KV cache) too."""
    prompts, ref, llm = _reference_and_speculative(target, tmp_path, proposer)
    budget = llm.engine.spec.budget

    def record(rows, seconds):
        DraftBudget.record(budget, rows, 0.01 * rows if cost == "rows" else 0.01)

    budget.record = record
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.stats().spec
    assert stats.proposed > 0
    assert (stats.cut > 0) == cuts


def test_adaptive_off_verifies_every_draft(target):
    llm = LLM(target, config=spec_engine_config(make_config("ngram", 4, min_n=1,
                                                            adaptive=False)))
    assert llm.engine.spec.budget is None


@pytest.mark.parametrize("proposer", ["draft_model", "early_exit"])
def test_a_draft_model_too_dear_for_its_drafts_is_not_run(target, tmp_path, proposer):
    """A proposer that runs a model drafts only what the budget keeps: with every row as
    dear as a step, after the first measured steps it is asked for no drafts at all (its
    forward passes are saved, not only the verification), and the greedy tokens are the
    non-speculative engine's."""
    prompts, ref, llm = _reference_and_speculative(target, tmp_path, proposer)
    spec = llm.engine.spec
    assert spec.proposer.runs_model
    spec.budget.record = lambda rows, seconds: DraftBudget.record(spec.budget, rows, 0.01 * rows)
    asked = []
    propose = spec.proposer.propose
    spec.proposer.propose = lambda batch: asked.append(sum(b.num_drafts for b in batch)) or \
        propose(batch)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    steps = llm.engine.stats().spec
    # drafted at first (nothing measured), then not until a request is probed again
    assert asked and len(asked) < len(outs[0].token_ids) - 1
    assert steps.cut > 0
