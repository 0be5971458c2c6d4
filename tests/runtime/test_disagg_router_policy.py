"""The disaggregation router's decisions, as pure functions: the approximate prefix tree,
cache-aware prefill choice with the load-balance override, decode choice by load and KV
room, and SLO-based early rejection with its Retry-After and counters."""

import time

import pytest

from qserve.runtime.disagg.admission import (
    AdmissionCounters,
    Prediction,
    Rejection,
    SloConfig,
    admit,
    predict,
    retry_after,
    unavailable,
)
from qserve.runtime.disagg.prefill_cost import MIN_SAMPLES, PrefillCost, Work
from qserve.runtime.disagg.prefix_tree import ApproxPrefixTree
from qserve.runtime.disagg.selection import (
    Choice,
    LocalPrefillPolicy,
    SelectionPolicy,
    choose_decode,
    choose_prefill,
    is_imbalanced,
    prefill_locally,
)
from qserve.runtime.disagg.worker_state import Ewma, WorkerState


# --- prefix tree --------------------------------------------------------------------------

def test_tree_shared_and_diverging_prefixes():
    tree = ApproxPrefixTree()
    tree.insert("hello world", "A", now=1.0)
    tree.insert("hello there", "B", now=2.0)
    assert tree.match("hello world!") == {"A": 11, "B": 6}
    assert tree.match("hello there") == {"A": 6, "B": 11}
    assert tree.match("hello") == {"A": 5, "B": 5}
    assert tree.match("help") == {"A": 3, "B": 3}
    assert tree.match("goodbye") == {}
    assert tree.match("") == {}
    assert tree.size("A") == 11
    assert tree.size("B") == 11
    tree.insert("hello there", "A", now=3.0)   # only "there" is new to A
    assert tree.size("A") == 16
    assert tree.match("hello there") == {"A": 11, "B": 11}


def test_tree_insert_of_a_prefix_splits_without_growing():
    tree = ApproxPrefixTree()
    tree.insert("abcdef", "A", now=1.0)
    tree.insert("abc", "B", now=2.0)
    tree.insert("", "C", now=3.0)
    assert tree.match("abcdef") == {"A": 6, "B": 3}
    assert tree.match("abcxyz") == {"A": 3, "B": 3}
    assert (tree.size("A"), tree.size("B"), tree.size("C")) == (6, 3, 0)
    tree.insert("abcdef", "A", now=4.0)         # again: nothing new
    assert tree.size("A") == 6


def test_tree_counts_unicode_code_points():
    tree = ApproxPrefixTree()
    tree.insert("日本語のテキスト", "A", now=1.0)
    tree.insert("🌍🌍 héllo", "B", now=1.0)
    assert tree.match("日本語の文章") == {"A": 4}
    assert tree.match("🌍🌎") == {"B": 1}
    assert tree.match("🌍🌍 hello") == {"B": 4}     # "é" is not "e"
    assert tree.size("A") == 8
    assert tree.size("B") == 8


def test_tree_many_workers_on_one_text():
    tree = ApproxPrefixTree()
    for i, worker in enumerate(["A", "B", "C"]):
        tree.insert("system prompt: be brief", worker, now=float(i))
    assert tree.match("system prompt: be brief. hi") == {"A": 23, "B": 23, "C": 23}
    assert tree.match("system prompt: be kind") == {"A": 18, "B": 18, "C": 18}
    assert [tree.size(w) for w in "ABC"] == [23, 23, 23]


def test_tree_evicts_least_recently_used_first():
    tree = ApproxPrefixTree(max_chars_per_worker=10)
    tree.insert("aaaaa", "A", now=1.0)
    tree.insert("bbbbb", "A", now=2.0)
    tree.insert("ccccc", "A", now=3.0)
    tree.insert("aaaaa", "A", now=4.0)       # used again: now "bbbbb" is the oldest
    assert tree.size("A") == 15
    tree.evict(now=5.0)
    assert tree.size("A") == 10
    assert tree.match("bbbbb") == {}
    assert tree.match("aaaaa") == {"A": 5}
    assert tree.match("ccccc") == {"A": 5}
    tree.evict(now=6.0)                       # at the cap: nothing more goes
    assert tree.size("A") == 10


def test_tree_eviction_trims_from_the_leaves_per_worker():
    tree = ApproxPrefixTree(max_chars_per_worker=8)
    tree.insert("abcdefgh", "A", now=1.0)
    tree.insert("abcdWXYZ", "A", now=2.0)    # tree: "abcd" -> "efgh" | "WXYZ"
    tree.insert("abcdefgh", "B", now=0.5)    # B is older but under its cap
    assert (tree.size("A"), tree.size("B")) == (12, 8)
    tree.evict(now=3.0)
    assert (tree.size("A"), tree.size("B")) == (8, 8)
    assert tree.match("abcdefgh") == {"A": 4, "B": 8}
    assert tree.match("abcdWXYZ") == {"A": 8, "B": 4}
    tree.max_chars_per_worker = 3
    tree.evict(now=4.0)                       # A: "WXYZ" then "abcd"; B: "efgh" then "abcd"
    assert (tree.size("A"), tree.size("B")) == (0, 0)
    assert tree.match("abcdefgh") == {}


def test_tree_eviction_of_equal_ages_goes_in_text_order():
    tree = ApproxPrefixTree(max_chars_per_worker=4)
    tree.insert("zzzz", "A", now=1.0)
    tree.insert("mmmm", "A", now=1.0)
    tree.insert("aaaa", "A", now=1.0)
    tree.evict(now=2.0)
    assert tree.size("A") == 4
    assert tree.match("zzzz") == {"A": 4}
    assert tree.match("aaaa") == {} and tree.match("mmmm") == {}


def test_tree_caps_each_worker_at_its_own_size():
    tree = ApproxPrefixTree(max_chars_per_worker=100)
    tree.set_cap("A", 25)
    tree.insert("a" * 20, "A", now=1.0)
    tree.insert("b" * 20, "A", now=2.0)
    tree.insert("c" * 60, "B", now=1.0)
    tree.evict(now=3.0)
    assert tree.match("a" * 20) == {} and tree.match("b" * 20) == {"A": 20}  # older first
    assert tree.size("A") == 20 and tree.cap("A") == 25
    assert tree.size("B") == 60 and tree.cap("B") == 100               # the default cap
    with pytest.raises(ValueError):
        tree.set_cap("A", -1)


def test_tree_remove_worker():
    tree = ApproxPrefixTree()
    tree.insert("hello world", "A", now=1.0)
    tree.insert("hello world", "B", now=1.0)
    tree.insert("hello there", "A", now=2.0)
    tree.remove_worker("A")
    assert tree.size("A") == 0
    assert tree.match("hello world") == {"B": 11}
    assert tree.match("hello there") == {"B": 6}
    tree.remove_worker("B")
    tree.remove_worker("nobody")
    assert tree.match("hello world") == {}
    tree.insert("hello", "A", now=3.0)
    assert tree.match("hello world") == {"A": 5}
    assert tree.size("A") == 5


def test_tree_rejects_a_negative_cap():
    with pytest.raises(ValueError):
        ApproxPrefixTree(max_chars_per_worker=-1)


# --- worker state -------------------------------------------------------------------------

def test_ewma_is_seeded_by_its_first_sample():
    e = Ewma()
    assert e.value is None
    assert e.update(10.0) == 10.0
    assert e.update(20.0, alpha=0.5) == 15.0
    assert e.update(31.0, alpha=0.25) == 19.0
    assert Ewma(10.0).update(20.0) == 0.2 * 20.0 + 0.8 * 10.0


@pytest.mark.parametrize("x, alpha", [(1.0, 0.0), (1.0, 1.5), (float("nan"), 0.2),
                                      (float("inf"), 0.2)])
def test_ewma_rejects_bad_input(x, alpha):
    with pytest.raises(ValueError):
        Ewma().update(x, alpha=alpha)


def test_only_a_prompt_that_had_the_worker_to_itself_is_a_speed_sample():
    """Behind a queue, a prompt's wait holds what was left of the prompt in progress, which
    the router does not know: counting that prompt whole would take the worker for
    faster than it is. Such samples are left out."""
    w = WorkerState("http://p0", "prefill")
    w.record_prefill(Work.prompt(200), 1.2, ahead=Work.prompt(1000))   # behind a queue
    assert w.prefill_tokens_per_s.value is None and w.prefill_cost.samples == 0
    w.record_prefill(Work.prompt(200), 0.2, ahead=Work())
    assert w.prefill_tokens_per_s.value == pytest.approx(1000.0)
    w.record_prefill(Work.prompt(300, cached=200), 0.1, ahead=Work())  # 100 computed
    assert w.prefill_tokens_per_s.value == pytest.approx(1000.0)
    for bad in ((Work.prompt(0), 1.0, Work()), (Work.prompt(5), 0.0, Work()),
                (Work.prompt(5), 1.0, Work(1, -1, 0.0)), (Work(2, 10, 50.0), 1.0, Work())):
        with pytest.raises(ValueError):
            w.record_prefill(*bad)


def test_the_queue_counts_what_is_left_of_it():
    """A prefill worker runs its prompts in order: the queue's cost, less the time it has
    been on the head (since the queue began, or since the last prompt finished)."""
    w, d = WorkerState("http://p0", "prefill"), WorkerState("http://d0", "decode")
    w.prefill_tokens_per_s.update(1000.0)
    first, second = Work.prompt(1000), Work.prompt(500)
    w.enqueue(first, now=10.0)
    w.enqueue(second, now=10.2)                      # the head is still the first
    assert w.prefill_s(Work.prompt(200), now=10.0) == pytest.approx(1.7)
    assert w.prefill_s(Work.prompt(200), now=10.4) == pytest.approx(1.3)
    assert w.prefill_s(Work.prompt(200), now=12.0) == pytest.approx(0.2)   # overdue: own
    w.dequeue(first, now=11.0)                       # on the second since 11.0
    assert w.prefill_s(Work.prompt(200), now=11.1) == pytest.approx(0.6)
    w.dequeue(second, now=11.5)
    assert w.queued == Work() and w.head_since is None
    assert w.prefill_s(Work.prompt(200), now=20.0) == pytest.approx(0.2)
    assert predict(w, d, 200).ttft_s == pytest.approx(0.2)


def _cost_of(work):    # a worker whose attention makes long prompts slower per token
    return 0.01 * work.requests + 1.5e-3 * work.tokens + 5e-7 * work.square


def test_prefill_time_is_fitted_from_short_and_long_prompts():
    """One rate per token fitted to short prompts misses long ones (and the other way
    round); the fitted cost predicts both, and a queue of mixed prompts."""
    w, d = WorkerState("http://p0", "prefill"), WorkerState("http://d0", "decode")
    samples = [Work.prompt(128), Work.prompt(1024), Work.prompt(128), Work.prompt(1024),
               Work.prompt(256), Work.prompt(512, cached=256)]
    for own in samples:
        w.record_prefill(own, _cost_of(own), Work())
    assert w.prefill_cost.samples == len(samples)
    a, b, c = w.prefill_cost.coefficients
    assert (a, b, c) == pytest.approx((0.01, 1.5e-3, 5e-7), rel=1e-6)
    for n in (64, 2048):
        assert predict(w, d, n).ttft_s == pytest.approx(_cost_of(Work.prompt(n)))
    queue = Work.prompt(1024) + Work.prompt(128, cached=64)
    w.enqueue(queue, now=time.monotonic())
    assert predict(w, d, 300, cached_tokens=100).ttft_s == pytest.approx(
        _cost_of(queue + Work.prompt(300, cached=100)), rel=1e-3)
    # the plain rate, for comparison: off by more than 10% at one end or the other
    rate = w.prefill_tokens_per_s.value
    assert max(abs(n / rate / _cost_of(Work.prompt(n)) - 1) for n in (64, 2048)) > 0.1


def test_prefill_cost_waits_for_samples_and_for_prompts_of_different_sizes():
    cost = PrefillCost()
    for _ in range(MIN_SAMPLES - 1):
        cost.record(Work.prompt(128), 0.2)
    assert cost.seconds(Work.prompt(128)) is None and cost.coefficients is None
    cost.record(Work.prompt(128), 0.2)
    # prompts of one size: a per-token rate only (the terms cannot be told apart)
    assert cost.coefficients == pytest.approx((0.0, 0.2 / 128, 0.0))
    assert cost.seconds(Work.prompt(1024)) == pytest.approx(1.6)


def test_prefill_cost_keeps_its_coefficients_non_negative_and_forgets_old_samples():
    cost = PrefillCost()
    # time that falls with the square: no negative coefficient is fitted for it
    for n in (100, 200, 400, 800, 1600):
        cost.record(Work.prompt(n), 1e-3 * n - 1e-8 * n * n)
    assert all(c >= 0 for c in cost.coefficients)
    for _ in range(150):                         # the worker becomes twice as slow
        for n in (128, 640, 1024):
            cost.record(Work.prompt(n), 2 * _cost_of(Work.prompt(n)))
    assert cost.seconds(Work.prompt(256)) == pytest.approx(2 * _cost_of(Work.prompt(256)),
                                                           rel=1e-3)
    with pytest.raises(ValueError):
        cost.record(Work(), 1.0)
    with pytest.raises(ValueError):
        Work.prompt(10, cached=11)


def test_worker_state_role_is_checked():
    assert WorkerState("http://p0", "prefill").prefill_tokens_per_s.value is None
    with pytest.raises(ValueError):
        WorkerState("http://x", "both")


# --- prefill choice -----------------------------------------------------------------------

def prefill(url, in_flight=0, healthy=True):
    return WorkerState(url, "prefill", healthy=healthy, in_flight=in_flight)


def decode(url, in_flight=0, free=None, healthy=True):
    return WorkerState(url, "decode", healthy=healthy, in_flight=in_flight, free_kv_blocks=free)


TEXT = "".join(chr(ord("a") + i % 26) for i in range(100))   # 100 chars, no repeats early


def tree_holding(**held):
    """A tree where each worker holds `n` leading chars of TEXT (then a private tail)."""
    tree = ApproxPrefixTree()
    for worker, n in held.items():
        tree.insert(TEXT[:n] + "#" + worker, worker, now=1.0)
    return tree


def test_prefill_follows_the_cache():
    tree = tree_holding(A=82, B=30)
    workers = [prefill("A", in_flight=3), prefill("B"), prefill("C")]
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()) == Choice("A", "cache 0.82", 82)


def test_prefill_cache_threshold_is_inclusive():
    workers = [prefill("A"), prefill("B"), prefill("C")]
    at = choose_prefill(workers, TEXT, tree_holding(A=50, B=10), SelectionPolicy())
    below = choose_prefill(workers, TEXT, tree_holding(A=49, B=10), SelectionPolicy())
    assert at == Choice("A", "cache 0.50", 50)
    assert below == Choice("C", "smallest tree")     # C holds nothing: the most room


def test_prefill_smallest_tree_ties_go_to_load_then_url():
    tree = tree_holding(A=10)
    workers = [prefill("D", in_flight=1), prefill("C", in_flight=1), prefill("B", in_flight=2),
               prefill("A")]
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()) == Choice("C", "smallest tree")
    workers[0].in_flight = 0
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()) == Choice("D", "smallest tree")


def test_prefill_equal_matches_go_to_load_then_url():
    tree = tree_holding(B=80, C=80)
    workers = [prefill("A"), prefill("C"), prefill("B")]
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()).worker == "B"
    workers[2].in_flight = 1
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()).worker == "C"


@pytest.mark.parametrize("hot, cold, expected", [
    (5, 1, Choice("A", "cache 0.90", 90)),     # max - min = 4: not above the absolute threshold
    (6, 1, Choice("B", "balance")),        # 5 > 4 and 6 > 1.5 * 1
    (15, 10, Choice("A", "cache 0.90", 90)),   # 5 > 4 but 15 is not above 1.5 * 10
    (16, 10, Choice("B", "balance")),      # 6 > 4 and 16 > 15
])
def test_prefill_switches_to_least_loaded_past_both_thresholds(hot, cold, expected):
    tree = tree_holding(A=90)
    workers = [prefill("A", in_flight=hot), prefill("B", in_flight=cold),
               prefill("C", in_flight=cold + 1)]
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()) == expected


def test_every_choice_carries_the_prefix_its_worker_is_believed_to_hold():
    """The router predicts the prefill's cost from what is left to compute, whichever rule
    chose the worker."""
    tree = tree_holding(A=90, B=40, C=20)
    policy = SelectionPolicy()
    balanced = choose_prefill([prefill("A", in_flight=16), prefill("B", in_flight=9),
                               prefill("C", in_flight=10)], TEXT, tree, policy)
    assert balanced == Choice("B", "balance", 40)
    below = choose_prefill([prefill("B"), prefill("C")], TEXT, tree_holding(B=40, C=20),
                           SelectionPolicy(cache_threshold=0.5))
    assert below == Choice("C", "smallest tree", 20)   # C's tree is the smaller one
    assert choose_prefill([prefill("D")], TEXT, tree, policy) == Choice("D", "smallest tree", 0)


def test_imbalance_rule():
    policy = SelectionPolicy(balance_abs_threshold=2, balance_rel_threshold=2.0)
    assert is_imbalanced([0, 3], policy)
    assert not is_imbalanced([0, 2], policy)
    assert not is_imbalanced([4, 7], policy)        # 7 is not above 2 * 4
    assert is_imbalanced([4, 9], policy)
    assert not is_imbalanced([9], policy)
    assert not is_imbalanced([], policy)


def test_prefill_skips_unhealthy_and_decode_workers():
    tree = tree_holding(A=90, D=90)
    workers = [prefill("A", healthy=False), decode("D"), prefill("B")]
    assert choose_prefill(workers, TEXT, tree, SelectionPolicy()) == Choice("B", "smallest tree")
    assert choose_prefill([prefill("A", healthy=False), decode("D")], TEXT, tree,
                          SelectionPolicy()) is None
    assert choose_prefill([], TEXT, tree, SelectionPolicy()) is None


def test_prefill_choice_then_insert_keeps_a_prefix_on_one_worker():
    tree = ApproxPrefixTree()
    workers = [prefill("A"), prefill("B")]
    first = choose_prefill(workers, "You are helpful. Q1", tree, SelectionPolicy())
    tree.insert("You are helpful. Q1", first.worker, now=1.0)
    second = choose_prefill(workers, "You are helpful. Q2", tree, SelectionPolicy())
    other = choose_prefill(workers, "Translate this: hola", tree, SelectionPolicy())
    assert first == Choice("A", "smallest tree")
    assert second == Choice("A", "cache 0.95", 18)   # 18 of 19 chars
    assert other == Choice("B", "smallest tree")


@pytest.mark.parametrize("kwargs", [{"cache_threshold": 1.5}, {"balance_abs_threshold": -1},
                                    {"balance_rel_threshold": 0.5}])
def test_selection_policy_is_checked(kwargs):
    with pytest.raises(ValueError):
        SelectionPolicy(**kwargs)


# --- local prefill ------------------------------------------------------------------------

def test_local_prefill_is_off_by_default_and_takes_only_short_prompts():
    p = prefill("P1")
    assert not prefill_locally(p, 1, LocalPrefillPolicy())
    assert not prefill_locally(None, 1, LocalPrefillPolicy())   # off: a 503 stays a 503
    policy = LocalPrefillPolicy(max_tokens=256)
    assert prefill_locally(p, 256, policy)                       # inclusive
    assert not prefill_locally(p, 257, policy)
    assert prefill_locally(None, 200, policy)                    # no prefill worker up
    assert not prefill_locally(None, 300, policy)
    with pytest.raises(ValueError):
        prefill_locally(p, -1, policy)


def test_local_prefill_can_wait_for_a_prefill_queue():
    policy = LocalPrefillPolicy(max_tokens=256, min_queue_s=0.5)
    p = prefill("P1")
    p.queued = Work(tokens=10_000)
    assert not prefill_locally(p, 100, policy)                   # rate unmeasured: remote
    p.prefill_tokens_per_s.update(2000.0)                        # queue 5 s
    assert prefill_locally(p, 100, policy)
    p.queued = Work(tokens=999)                                  # 0.4995 s
    assert not prefill_locally(p, 100, policy)
    p.queued = Work(tokens=1000)                                 # 0.5 s: inclusive
    assert prefill_locally(p, 100, policy)
    assert not prefill_locally(p, 300, policy)                   # long: remote anyway


@pytest.mark.parametrize("kwargs", [{"max_tokens": -1}, {"min_queue_s": -0.1},
                                    {"min_queue_s": float("nan")}])
def test_local_prefill_policy_is_checked(kwargs):
    with pytest.raises(ValueError):
        LocalPrefillPolicy(**kwargs)


# --- decode choice ------------------------------------------------------------------------

def test_decode_least_loaded_wins():
    workers = [decode("D1", in_flight=2, free=100), decode("D2", in_flight=1, free=10)]
    assert choose_decode(workers, blocks_needed=5) == Choice("D2", "load 1 free 10")


def test_decode_skips_a_worker_without_room():
    workers = [decode("D1", in_flight=2, free=100), decode("D2", in_flight=1, free=4)]
    assert choose_decode(workers, blocks_needed=5) == Choice("D1", "load 2 free 100")
    assert choose_decode(workers, blocks_needed=4) == Choice("D2", "load 1 free 4")
    assert choose_decode(workers, blocks_needed=101) is None


def test_decode_ties_go_to_most_free_blocks_then_url():
    workers = [decode("D3"), decode("D1", in_flight=1, free=50), decode("D2", free=80),
               decode("D0", free=20)]
    assert choose_decode(workers, blocks_needed=1) == Choice("D2", "load 0 free 80")
    workers[2].free_kv_blocks = None                 # unknown ranks after any known count
    assert choose_decode(workers, blocks_needed=1) == Choice("D0", "load 0 free 20")
    workers[3].free_kv_blocks = None
    assert choose_decode(workers, blocks_needed=1) == Choice("D0", "load 0 free ?")


def test_decode_skips_unhealthy_and_prefill_workers():
    workers = [decode("D1", free=100, healthy=False), prefill("P1"), decode("D2", in_flight=3)]
    assert choose_decode(workers, blocks_needed=10) == Choice("D2", "load 3 free ?")
    assert choose_decode(workers[:2], blocks_needed=0) is None
    with pytest.raises(ValueError):
        choose_decode(workers, blocks_needed=-1)


# --- admission ----------------------------------------------------------------------------

def measured(queued=0, rate=1000.0, transfer=None, in_flight=0, step=0.25, stream=None):
    p = WorkerState("P", "prefill", queued=Work(tokens=queued))
    if rate is not None:
        p.prefill_tokens_per_s.update(rate)
    if transfer is not None:
        p.transfer_s_per_token.update(transfer)
    d = WorkerState("D", "decode", in_flight=in_flight)
    if step is not None:
        d.decode_step_s.update(step)
    if stream is not None:
        d.stream_s.update(stream)
    return p, d


def test_predict_from_seeded_rates():
    p, d = measured(queued=1500, rate=1000.0, in_flight=4, step=0.25)
    assert predict(p, d, 500) == Prediction(ttft_s=2.0, tpot_s=0.3125)   # 0.25 * 5 / 4
    p.transfer_s_per_token.update(0.001)
    assert predict(p, d, 500) == Prediction(ttft_s=2.5, tpot_s=0.3125)
    d.in_flight = 0
    assert predict(p, d, 500).tpot_s == 0.25
    d.in_flight = 1
    assert predict(p, d, 500).tpot_s == 0.5
    p.prefill_tokens_per_s.update(3000.0, alpha=0.5)                  # rate 2000
    assert predict(p, d, 500).ttft_s == 1.5


def test_a_cached_prefix_is_not_computed_again_but_still_travels():
    p, d = measured(queued=1500, rate=1000.0)
    assert predict(p, d, 500, cached_tokens=400).ttft_s == pytest.approx(1.6)  # 1600 tokens
    p.transfer_s_per_token.update(0.001)       # the whole prompt's KV is shipped
    assert predict(p, d, 500, cached_tokens=400).ttft_s == pytest.approx(2.1)
    assert admit(p, d, 500, SloConfig(ttft_s=2.2), cached_tokens=400) is None
    assert admit(p, d, 500, SloConfig(ttft_s=2.2)).status == 429          # 2.5 s uncached
    for bad in (-1, 501):
        with pytest.raises(ValueError, match="cached_tokens"):
            predict(p, d, 500, cached_tokens=bad)


def test_the_decode_workers_first_token_time_adds_to_every_ttft():
    """The per-request term (import, first step, hops) is measured on the decode worker and
    added whatever the prompt: a short prompt's TTFT is mostly that term."""
    p, d = measured(queued=0, rate=1000.0)
    assert predict(p, d, 100).ttft_s == pytest.approx(0.1)
    d.first_token_s.update(0.04)
    assert predict(p, d, 100).ttft_s == pytest.approx(0.14)
    assert predict(p, d, 1000).ttft_s == pytest.approx(1.04)
    p.prefill_tokens_per_s = Ewma()                 # no rate: no prediction, term or not
    assert predict(p, d, 100).ttft_s is None


def test_a_prompt_computed_on_the_decode_worker_is_predicted_from_its_own_rate():
    p, d = measured(queued=10**6, rate=1000.0, in_flight=4, step=0.25)
    d.first_token_s.update(0.5)                     # remote terms play no part locally
    assert predict(None, d, 200) == Prediction(None, 0.3125)   # local rate unmeasured
    assert admit(None, d, 200, SloConfig(ttft_s=0.001)) is None   # never rejects blind
    d.local_prefill_tokens_per_s.update(2000.0)
    assert predict(None, d, 200) == Prediction(pytest.approx(0.1), 0.3125)
    # busy: retry after the minimum; idle: waiting cannot help, so it is served
    assert admit(None, d, 200, SloConfig(ttft_s=0.05)) == Rejection(
        429, "ttft 0.10s > 0.05s", 1, Prediction(pytest.approx(0.1), 0.3125))
    d.in_flight = 0
    assert admit(None, d, 200, SloConfig(ttft_s=0.05)) is None


def test_tpot_comes_from_the_decode_workers_own_step_table_once_reported():
    """The worker's measured step per number of sequences replaces the linear upper bound:
    3 streams running, the new one makes 4."""
    p, d = measured(in_flight=3, step=0.5, stream=10.0)      # linear: 0.5 * 4 / 3
    assert predict(p, d, 100).tpot_s == pytest.approx(0.6667, abs=1e-4)
    d.step_s_by_rows = {1: 0.010, 2: 0.012, 6: 0.020}
    assert predict(p, d, 100).tpot_s == pytest.approx(0.016)   # between 2 and 6
    assert admit(p, d, 100, SloConfig(tpot_s=0.016)) is None
    # an SLO of 0.013 fits 2 streams (0.012; 3 would be 0.014): 2 of the 3 running must
    # finish, one every 10 / 3 s
    r = admit(p, d, 100, SloConfig(tpot_s=0.013))
    assert r.status == 429 and r.reason == "tpot 0.016s > 0.013s"
    assert r.retry_after_s == 7                                  # 2 * 10 / 3 = 6.67
    assert admit(p, d, 100, SloConfig(tpot_s=0.005)).retry_after_s == 10   # none fits


def test_no_prediction_and_no_rejection_without_measurements():
    p, d = measured(queued=10**6, rate=None, in_flight=100, step=None)
    assert predict(p, d, 1000) == Prediction(None, None)
    assert admit(p, d, 1000, SloConfig(ttft_s=0.001, tpot_s=0.001)) is None
    with pytest.raises(ValueError):
        predict(p, d, -1)


def test_admit_within_slo_or_without_one():
    p, d = measured(queued=3000, in_flight=4, step=0.25)       # TTFT 4.0, TPOT 0.3125
    assert admit(p, d, 1000, SloConfig(ttft_s=4.0, tpot_s=0.3125)) is None
    assert admit(p, d, 1000, SloConfig()) is None


def test_ttft_miss_is_a_429_with_the_time_until_the_queue_has_drained_enough():
    p, d = measured(queued=3000)                               # TTFT (3000 + 1000) / 1000 = 4
    assert admit(p, d, 1000, SloConfig(ttft_s=2.5)) == Rejection(
        429, "ttft 4.00s > 2.50s", 2, Prediction(4.0, 0.25))   # 1.5 s, rounded up
    assert admit(p, d, 1000, SloConfig(ttft_s=1.0)).retry_after_s == 3
    assert admit(p, d, 1000, SloConfig(ttft_s=3.9)).retry_after_s == 1


def test_a_prompt_too_long_for_the_slo_is_served_on_an_idle_worker():
    p, d = measured(queued=0)                                  # alone: 5 s > 2 s
    assert admit(p, d, 5000, SloConfig(ttft_s=2.0)) is None
    p.queued = Work(tokens=1500)                            # wait for the queue: 1.5 s
    assert admit(p, d, 5000, SloConfig(ttft_s=2.0)).retry_after_s == 2


def test_tpot_miss_is_a_429_paced_by_finishing_streams():
    # per stream 0.25 / 4 = 0.0625 s; an SLO of 0.2 fits 3 streams with the new one, so 2 of
    # the 4 must finish; a stream lasts 10 s, so one finishes every 2.5 s
    p, d = measured(in_flight=4, step=0.25, stream=10.0)
    assert admit(p, d, 100, SloConfig(tpot_s=0.2)) == Rejection(
        429, "tpot 0.312s > 0.200s", 5, Prediction(0.1, 0.3125))
    d.stream_s = Ewma()                                        # unmeasured: the minimum
    assert admit(p, d, 100, SloConfig(tpot_s=0.2)).retry_after_s == 1


def test_a_step_too_slow_for_the_slo_is_served_on_an_idle_worker():
    p, d = measured(in_flight=0, step=0.25)
    assert admit(p, d, 100, SloConfig(tpot_s=0.2)) is None
    p, d = measured(in_flight=2, step=0.5, stream=8.0)          # every stream must finish
    assert admit(p, d, 100, SloConfig(tpot_s=0.2)).retry_after_s == 8


def test_both_misses_are_reported_and_the_longer_wait_wins():
    p, d = measured(queued=3000, in_flight=4, step=0.25, stream=10.0)
    rejection = admit(p, d, 1000, SloConfig(ttft_s=2.5, tpot_s=0.2))
    assert rejection.status == 429
    assert rejection.reason == "ttft 4.00s > 2.50s; tpot 0.312s > 0.200s"
    assert rejection.retry_after_s == 5


def test_unavailable_is_a_503():
    assert unavailable("no decode worker has 12 free KV blocks") == Rejection(
        503, "no decode worker has 12 free KV blocks", 1, Prediction(None, None))
    assert unavailable("no healthy prefill worker", retry_after_s=2.5).retry_after_s == 3


def test_retry_after_rounds_up_to_whole_seconds():
    assert [retry_after(s) for s in (0.0, 0.2, 1.0, 2.0, 2.0000000001, 2.01)] == [1, 1, 1, 2, 2,
                                                                                   3]


@pytest.mark.parametrize("kwargs", [{"ttft_s": 0.0}, {"tpot_s": -1.0}])
def test_slo_config_is_checked(kwargs):
    with pytest.raises(ValueError):
        SloConfig(**kwargs)


def test_counters_count_rejections_and_saved_prefill_tokens():
    counters = AdmissionCounters()
    p, d = measured(queued=3000)
    counters.record(admit(p, d, 800, SloConfig(ttft_s=1.0)), 800)
    counters.record(unavailable("no healthy prefill worker"), 200)
    counters.record(admit(p, d, 50, SloConfig(ttft_s=1.0)), 50)
    assert counters.rejected == 3
    assert counters.prefill_tokens_saved == 1050
    assert counters.by_status == {429: 2, 503: 1}


def test_a_workers_step_table_is_read_leniently():
    from qserve.runtime.disagg.router_state import _step_table

    assert _step_table({"1": 0.01, "4": "0.02"}) == {1: 0.01, 4: 0.02}
    assert _step_table({"0": 0.01, "x": 0.01, "2": -1, "3": float("nan"), "5": None,
                        "6": [1]}) == {}
    assert _step_table(None) == {} and _step_table([1, 2]) == {}


def test_the_clusters_layout_is_the_one_most_workers_share_not_the_first_to_answer():
    """A worker of another artifact that answers first must not make the router refuse
    the others (the cluster's layout is read from all answers of a refresh)."""
    from qserve.runtime.disagg.router_state import RouterState

    state = RouterState(["http://p1"], ["http://odd", "http://d1", "http://down"])

    def info(role, namespace, port=None):
        return {"role": role, "namespace": namespace, "block_size": 16, "kv_dtype": "fp8",
                "kv_port": port, "free_kv_blocks": 10, "total_kv_blocks": 10}

    infos = [info("prefill", "A"), info("decode", "B", 9001), info("decode", "A", 9002), None]
    state.layout = state._common_layout(infos)
    for w, i in zip(state.workers, infos):
        state._apply(w, i)
    assert state.layout["namespace"] == "A"
    assert [w.healthy for w in state.workers] == [True, False, True, False]
    assert "another artifact" in state.refused["http://odd"]
    assert set(state.refused) == {"http://odd"} and state.kv_ports == {"http://d1": 9002}
    assert state.tree.cap("http://p1") == 10 * 16 * 4      # its KV cache, in chars
    for odd in (-5, 0, "10", None):                         # a report that cannot be a size
        p = RouterState(["http://p1"], [])
        p._apply(p.prefill[0], dict(info("prefill", "A"), total_kv_blocks=odd))
        assert p.tree.cap("http://p1") == p.tree.max_chars_per_worker
    # a tie goes to the first listed worker's layout
    assert RouterState(["http://a"], ["http://b"])._common_layout(
        [info("prefill", "X"), info("decode", "Y", 1)])["namespace"] == "X"
