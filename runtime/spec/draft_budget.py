"""How many drafts a step verifies, chosen by what verifying them costs on this machine.

A verifying step scores 1 + d tokens of a request where a plain step scores one. Where
the weights' bytes decide a step's time (a wide-vector CPU, a GPU) the extra rows are
nearly free; where the multiplications decide it (an AVX2 CPU: fp32 FMAs) a step of six
rows costs ~2.5 plain ones, and drafts that are mostly rejected make decoding slower than
no speculation. So each step, before the drafts go to the scheduler:

    budget = DraftBudget(k)
    proposals = budget.cap(proposals, running)      # trims the drafts it may cap
    budget.record(rows, seconds)                    # every decode/verify step's time
    budget.observe(request_id, drafts, accepted)    # every verdict

The cap c (0..k, one for the step's capped requests) maximizes the expected tokens per
second: sum over requests of E(a_r, min(c, d_r)) tokens, E(a, d) = 1 + a + ... + a^d (each
draft accepted with probability a_r, the request's own moving average; drafts after a
rejection are dropped), in t(rows) seconds, t from the step times measured by rows. A
size not measured yet is taken at a cost that makes it worth trying (more rows than any
measured: the largest's time; fewer: the smallest's time per row), so the sizes the
choice moves between get measured. A request held at no drafts for
PROBE_AFTER steps is given the prior again, so a continuation that turns repetitive is
found. Greedy requests are capped (their tokens are the argmax whatever is drafted, so
the cap changes their speed, never their text) and so are sampled ones without a seed
(rejection sampling keeps their distribution whatever is drafted); seeded sampled requests
keep every draft (a verification draws differently from token-by-token sampling, so a
timing-dependent cap would make a seed's output depend on the machine's load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..request import Request
from ..step_times import StepTimes, step_at
from .proposer import Proposal

PRIOR = 0.5          # acceptance assumed for a request without verdicts
ALPHA = 0.3          # weight of one verdict in a request's moving average
PROBE_AFTER = 16     # steps at no drafts after which a request gets PRIOR again


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verifying step emits for one request: 1 + a + a^2 + ... + a^drafts."""
    return sum(acceptance ** i for i in range(drafts + 1))


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
    def cap(self, proposals: dict[str, Proposal], running: Sequence[Request]) -> dict[str, Proposal]:
        """`proposals` with the drafts of each request it may cap (greedy, or sampled
        without a seed) cut to the step's best cap (none left: the request leaves the
        dict). Unchanged where no step was measured yet."""
        table = self.times.snapshot()
        if not table or not proposals:
            return proposals
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        fixed = decoding  # rows every choice scores: the last token of each decoding request
        by_id = {r.request_id: r for r in running}
        capped: list[tuple[str, int, float]] = []  # (request, drafts, acceptance)
        for rid, p in proposals.items():
            req = by_id.get(rid)
            if req is not None and (req.params.is_greedy or req.params.seed is None):
                s = self.states.setdefault(rid, DraftState())
                capped.append((rid, len(p.token_ids), s.acceptance))
            else:
                fixed += len(p.token_ids)
        if not capped:
            return proposals
        best_cap, best_rate = 0, -1.0
        for c in range(self.k + 1):
            rows = fixed + sum(min(c, d) for _, d, _ in capped)
            tokens = decoding + sum(expected_tokens(a, min(c, d)) - 1 for _, d, a in capped)
            rate = tokens / _seconds(table, max(rows, 1))
            if rate > best_rate * (1 + 1e-9):  # a tie keeps the smaller cap
                best_cap, best_rate = c, rate
        out = dict(proposals)
        for rid, d, _ in capped:
            s = self.states[rid]
            if best_cap == 0:
                s.held += 1
                if s.held >= PROBE_AFTER:  # look again, as at the request's start
                    s.acceptance, s.held = PRIOR, 0
                del out[rid]
                continue
            s.held = 0
            if best_cap < d:
                p = proposals[rid]
                out[rid] = Proposal(p.token_ids[:best_cap],
                                    None if p.probs is None else p.probs[:best_cap])
        return out


def _seconds(table: dict[int, float], rows: int) -> float:
    """A step of `rows` tokens: within the measured sizes, step_at's (measured, else
    linear between the nearest on either side); beyond the largest, the largest's time
    (more rows look free), below the smallest, the smallest's time per row (fewer rows look
    cheap): either way the unmeasured size looks worth trying, and trying it measures it.
    (step_at extrapolates the other way, as an upper bound for admission.)"""
    smallest, largest = min(table), max(table)
    if rows > largest:
        return table[largest]
    if rows < smallest:
        return table[smallest] * rows / smallest
    return step_at(table, rows)
