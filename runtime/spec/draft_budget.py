"""How many drafts a step verifies, chosen by what verifying them costs on this machine.

A verifying step scores 1 + d tokens of a request where a plain step scores one. Where
the weights' bytes decide a step's time (a wide-vector CPU, a GPU) the extra rows are
nearly free; where the multiplications decide it (an AVX2 CPU: fp32 FMAs) a step of six
rows costs ~2.5 plain ones, and drafts that are mostly rejected make decoding slower than
no speculation. So each step, before the drafts go to the scheduler:

    budget = DraftBudget(k)
    wanted = budget.plan(batch, running)            # before a draft model runs: drafts to make
    proposals = budget.cap(proposals, running)      # trims the drafts it may cap
    budget.record(rows, seconds)                    # every decode/verify step's time
    budget.observe(request_id, drafts, accepted)    # every verdict

The choice is a cap c (0..k) and the m capped requests that draft (those whose drafts are
accepted most; the others draft none this step): the pair that maximizes the expected
tokens per second, sum over requests of E(a_r, min(c, d_r)) tokens, E(a, d) = 1 + a + ...
+ a^d (each draft accepted with probability a_r, the request's own moving average; drafts
after a rejection are dropped), in t(rows) seconds, t from the step times measured by
rows. So in a batch where one request's drafts keep being accepted and another's keep
failing, the first keeps drafting and the second's rows are not paid for. A size not
measured yet is taken at a cost that makes it worth trying (more rows than any
measured: the largest's time; fewer: the smallest's time per row), so the sizes the
choice moves between get measured. A request held at no drafts for
PROBE_AFTER steps is given the prior again, so a continuation that turns repetitive is
found. Greedy requests are capped (their tokens are the argmax whatever is drafted, so
the cap changes their speed, never their text) and so are sampled ones without a seed
(rejection sampling keeps their distribution whatever is drafted); seeded sampled requests
keep every draft (a verification draws differently from token-by-token sampling, so a
timing-dependent cap would make a seed's output depend on the machine's load).

A proposer that runs a model of its own (a draft model, or the target's first layers:
early_exit) spends a forward pass per draft before cap() sees its drafts. For it the choice
is made first (plan): the same choice, from each request's most drafts instead of its
actual ones, is how many it drafts, and a request given none is not drafted for at all. The
step times then hold the drafting too (the engine times a step from before the proposer
runs), so a size of 1 + c rows per request carries the cost of c draft passes, and a
draft model that costs more than its accepted tokens save is cut like a dear
verification.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from ..request import Request
from ..step_times import StepTimes, step_at
from .proposer import Proposal, ProposeRequest

PRIOR = 0.5          # acceptance assumed for a request without verdicts
ALPHA = 0.3          # weight of one verdict in a request's moving average
PROBE_AFTER = 16     # steps at no drafts after which a request gets PRIOR again


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verifying step emits for one request: 1 + a + a^2 + ... + a^drafts."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


@dataclass
class DraftState:
    acceptance: float = PRIOR  # moving average of the per-draft acceptance
    held: int = 0  # consecutive steps this request's drafts were cut to none


@dataclass
class DraftBudget:
    k: int  # the proposer's most drafts per request and step
    times: StepTimes = field(default_factory=StepTimes)  # seconds by rows (tokens) a step
    states: dict[str, DraftState] = field(default_factory=dict)

    # -- what the engine tells it ---------------------------------------------------------
    def record(self, rows: int, seconds: float) -> None:
        """A step of only decode and verify chunks scored `rows` tokens in `seconds`."""
        self.times.record(rows, seconds)

    def observe(self, request_id: str, drafts: int, accepted: int) -> None:
        """A verdict: `accepted` of `drafts` drafts kept (accepted < drafts: one was
        rejected, the rest unscored). The per-draft acceptance estimate of this verdict
        is accepted / (accepted + 1 if one was rejected)."""
        if drafts <= 0:
            return
        trials = accepted + (1 if accepted < drafts else 0)
        s = self.states.setdefault(request_id, DraftState())
        s.acceptance = (1 - ALPHA) * s.acceptance + ALPHA * accepted / trials

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # -- the decision ---------------------------------------------------------------------
    def plan(self, batch: Sequence[ProposeRequest], running: Sequence[Request]) -> dict[str, int]:
        """Before a proposer that runs a model drafts: request id -> the drafts to ask it
        for (the request's most, num_drafts, cut to the step's cap where it may be capped;
        the requests the choice gives none are left out). Every request's most where no
        step was measured yet."""
        wanted = {b.request.request_id: b.num_drafts for b in batch}
        best = self._choose(self._capped(wanted, running), running)
        if best is None:
            return wanted
        cap, drafting, idle = best
        for rid, d, _ in drafting:
            wanted[rid] = min(d, cap)
        for rid, _, _ in idle:
            self._hold(rid)
            del wanted[rid]
        return wanted

    def cap(self, proposals: dict[str, Proposal], running: Sequence[Request]) -> dict[str, Proposal]:
        """`proposals` with the drafts of each request it may cap (greedy, or sampled
        without a seed) cut to the step's cap, or to none where the choice leaves it out
        (the request leaves the dict). Unchanged where no step was measured yet."""
        drafts = {rid: len(p.token_ids) for rid, p in proposals.items()}
        best = self._choose(self._capped(drafts, running), running)
        if best is None:
            return proposals
        cap, drafting, idle = best
        out = dict(proposals)
        for rid, d, _ in drafting:
            self.states[rid].held = 0
            if cap < d:
                p = proposals[rid]
                out[rid] = Proposal(p.token_ids[:cap], None if p.probs is None else p.probs[:cap])
        for rid, _, _ in idle:
            self._hold(rid)
            del out[rid]
        return out

    def _capped(self, drafts: dict[str, int], running: Sequence[Request]
                ) -> tuple[list[tuple[str, int, float]], int]:
        """Of {request id: drafts}, the requests the cap applies to as (id, drafts,
        acceptance), and the draft rows of the others (which every choice scores)."""
        by_id = {r.request_id: r for r in running}
        capped, uncapped_rows = [], 0
        for rid, d in drafts.items():
            req = by_id.get(rid)
            if req is not None and (req.params.is_greedy or req.params.seed is None):
                capped.append((rid, d, self.states.setdefault(rid, DraftState()).acceptance))
            else:
                uncapped_rows += d
        return capped, uncapped_rows

    def _choose(self, split: tuple[list[tuple[str, int, float]], int],
                running: Sequence[Request]
                ) -> tuple[int, list[tuple[str, int, float]], list[tuple[str, int, float]]] | None:
        """(the cap, the capped requests that draft up to it, those that draft none): the
        choice with the most expected tokens per second, or None where nothing is measured
        yet or nothing may be capped. The drafting ones are the most accepted; a tie keeps
        the smaller cap and the fewer requests."""
        capped, uncapped_rows = split
        table = self.times.snapshot()
        if not table or not capped:
            return None
        seconds = _cost(table)
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        fixed = decoding + uncapped_rows  # rows every choice scores
        order = sorted(capped, key=lambda e: -e[2])  # the most accepted first (stable)
        best_cap, best_m = 0, 0
        best_rate = decoding / seconds(max(fixed, 1))
        for c in range(1, self.k + 1):
            rows, tokens = fixed, float(decoding)
            for m, (_, d, a) in enumerate(order, 1):
                rows += min(c, d)
                tokens += expected_tokens(a, min(c, d)) - 1
                rate = tokens / seconds(max(rows, 1))
                if rate > best_rate * (1 + 1e-9):
                    best_cap, best_m, best_rate = c, m, rate
        if best_m == 0:
            return 0, [], order
        return best_cap, order[:best_m], order[best_m:]

    def _hold(self, request_id: str) -> None:
        """The request's drafts were cut to none this step; after PROBE_AFTER such steps
        in a row it gets the prior again, as at its start."""
        s = self.states[request_id]
        s.held += 1
        if s.held >= PROBE_AFTER:
            s.acceptance, s.held = PRIOR, 0


def _cost(table: dict[int, float]):
    """seconds(rows) for one decision, from a StepTimes snapshot: within the measured
    sizes, step_at's (measured, else linear between the nearest on either side); beyond the
    largest, the largest's time (more rows look free), below the smallest, the smallest's
    time per row (fewer rows look cheap): either way the unmeasured size looks worth
    trying, and trying it measures it. (step_at extrapolates the other way, as an upper
    bound for admission.)"""
    sizes = sorted(table)
    smallest, largest = sizes[0], sizes[-1]

    def seconds(rows: int) -> float:
        if rows >= largest:
            return table[largest]
        if rows <= smallest:
            return table[smallest] * rows / smallest
        i = bisect.bisect_left(sizes, rows)
        if sizes[i] == rows:
            return table[rows]
        return step_at({sizes[i - 1]: table[sizes[i - 1]], sizes[i]: table[sizes[i]]}, rows)

    return seconds
