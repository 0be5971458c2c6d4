"""The scheduler on its own (runtime/scheduler.py), stepped by hand without a model: the
token budget, chunked prefill, the prefill cap in decoding steps, FCFS admission, the
sequence limit, preemption by recompute, prefix reuse, drafts, aborts and the refusal of
requests that could never fit."""

import pytest

from qserve.runtime.block_manager import BlockManager
from qserve.runtime.request import Request, RequestStatus
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.scheduler import Scheduler, SchedulerConfig

BS = 4  # tokens per KV block


def _sched(num_blocks=32, **config) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, namespace="test"), SchedulerConfig(**config))


def _req(rid: str, n: int, max_tokens: int = 8, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def _step(s: Scheduler, drafts=None) -> dict[str, int]:
    """One step as the engine runs it: schedule, advance, and give every request whose
    chunk reached its last token one new token. Returns {request id: tokens scheduled}."""
    out = s.schedule(drafts)
    s.update_from_output(out)
    for c in out.chunks:
        if c.samples:
            c.request.append_output(7)
    return {c.request.request_id: c.num_tokens for c in out.chunks}


def test_budget_chunks_a_long_prompt_and_decodes_go_first():
    s = _sched(max_num_batched_tokens=8)
    a, b = _req("a", 3), _req("b", 20)
    s.add_request(a)
    s.add_request(b)
    assert _step(s) == {"a": 3, "b": 5}  # a whole, b's first chunk fills the budget
    assert _step(s) == {"a": 1, "b": 7}  # a decodes first, b gets the rest
    assert _step(s) == {"a": 1, "b": 7}
    assert b.num_computed_tokens == 19 and b.num_tokens == 20
    assert _step(s) == {"a": 1, "b": 1}  # b's last prompt token, which samples
    assert len(b.output_token_ids) == 1


def test_prefill_cap_applies_only_to_steps_that_decode():
    s = _sched(max_num_batched_tokens=16, max_prefill_tokens_with_decodes=2)
    big = _req("big", 40)
    s.add_request(big)
    assert _step(s) == {"big": 16}  # nothing decodes: the whole budget
    s.add_request(_req("small", 2, first=100))
    assert _step(s) == {"big": 16}  # big is still mid-prefill: no decode in this step
    assert _step(s) == {"big": 8, "small": 2}
    assert _step(s) == {"big": 1, "small": 1}


def test_decoding_step_caps_a_new_prompt():
    s = _sched(max_num_batched_tokens=16, max_prefill_tokens_with_decodes=3)
    s.add_request(_req("a", 2))
    _step(s)  # a prefilled, sampled: now decoding
    s.add_request(_req("b", 10, first=50))
    assert _step(s) == {"a": 1, "b": 3}
    assert _step(s) == {"a": 1, "b": 3}


def test_max_num_seqs_holds_back_admission_in_order():
    s = _sched(max_num_seqs=2)
    for rid in "abc":
        s.add_request(_req(rid, 2, first=10 * ord(rid)))
    assert set(_step(s)) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]
    s.finish(s.running[0], RequestStatus.FINISHED_STOPPED)
    assert "c" in _step(s)


def test_fcfs_the_head_of_the_queue_is_not_overtaken():
    s = _sched(num_blocks=6, max_num_batched_tokens=64)  # 24 token slots
    s.add_request(_req("a", 12))  # 3 blocks
    s.add_request(_req("b", 16, first=100))  # 4 blocks: does not fit beside a
    s.add_request(_req("c", 2, first=200))  # would fit, but b is ahead
    assert _step(s) == {"a": 12}
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_preemption_frees_the_newest_and_requeues_it_first():
    s = _sched(num_blocks=4, max_num_batched_tokens=64)  # 16 token slots
    a, b = _req("a", 7, max_tokens=9), _req("b", 7, max_tokens=9, first=100)
    s.add_request(a)
    s.add_request(b)
    assert _step(s) == {"a": 7, "b": 7}  # 2 blocks each, 1 free slot each
    assert _step(s) == {"a": 1, "b": 1}  # both fill their second block
    out = s.schedule()  # both need a third block: only b (the newest) can give way
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert s.waiting[0] is b and not s.blocks.has_request("b")
    s.update_from_output(out)
    a.append_output(7)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    cached = s.tokens_cached
    got = _step(s)["b"]  # recomputed: prompt and its 2 outputs, less what the cache kept
    assert got + (s.tokens_cached - cached) == 9 and b.num_computed_tokens == 9


def test_prefix_reuse_and_prompt_logprobs_opt_out():
    s = _sched()
    first = _req("a", 12)
    s.add_request(first)
    _step(s)
    s.finish(first, RequestStatus.FINISHED_STOPPED)  # its full blocks stay cached
    again = _req("b", 12)
    s.add_request(again)
    assert _step(s) == {"b": 4}  # 2 blocks reused; the last block is computed
    assert again.num_cached_tokens == 8 and s.tokens_cached == 8
    scoring = Request("c", list(range(12)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    s.add_request(scoring)
    assert _step(s)["c"] == 12  # prompt logprobs need every prompt token computed
    off = _sched(enable_prefix_caching=False)
    for rid in "xy":
        r = _req(rid, 12)
        off.add_request(r)
        assert _step(off) == {rid: 12}
        off.finish(r, RequestStatus.FINISHED_STOPPED)


def test_drafts_extend_decodes_within_the_budget_and_never_preempt():
    s = _sched(max_num_batched_tokens=6)
    a = _req("a", 3)
    s.add_request(a)
    _step(s)
    out = s.schedule({"a": [11, 12, 13, 14, 15, 16, 17]})
    (chunk,) = out.chunks
    assert chunk.draft_token_ids == (11, 12, 13, 14, 15)  # budget 6 = 1 token + 5 drafts
    assert chunk.num_tokens == 6 and chunk.samples
    tight = _sched(num_blocks=2, max_num_batched_tokens=64)  # 8 token slots
    b = _req("b", 6, max_tokens=2)
    tight.add_request(b)
    _step(tight)
    out = tight.schedule({"b": [1, 2, 3, 4]})  # 7 slots used + 5 would not fit
    assert not out.preempted and out.chunks[0].draft_token_ids == ()


def test_abort_from_either_queue_frees_blocks():
    s = _sched(max_num_seqs=1)
    s.add_request(_req("a", 5))
    s.add_request(_req("b", 5, first=50))
    _step(s)
    free_before = s.blocks.num_free_blocks
    assert s.abort("b").status is RequestStatus.FINISHED_ABORTED  # waiting
    assert s.abort("a").status is RequestStatus.FINISHED_ABORTED  # running
    assert s.abort("nope") is None
    assert not s.has_unfinished
    assert s.blocks.num_free_blocks == s.blocks.num_blocks > free_before


def test_a_request_that_could_never_fit_is_refused_at_once():
    s = _sched(num_blocks=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks .* the cache has 4"):
        s.add_request(_req("big", 12, max_tokens=8))  # 20 tokens: 5 blocks
    assert not s.has_unfinished
    with pytest.raises(ValueError, match=">= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)
