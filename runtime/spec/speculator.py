"""The engine's side of speculative decoding: ask the proposer for drafts, verify the
target's scores of them, and count what was proposed and accepted.

    spec = Speculator(proposer, k)
    drafts = spec.propose(running)                 # request id -> Proposal (DraftBudget-capped)
    sched = scheduler.schedule(drafts)             # may cut drafts (budget, blocks)
    verdict = spec.verify(chunk, logits_rows)      # accepted drafts + one more token
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..request import Request
from .draft_budget import DraftBudget
from .proposer import Proposal, Proposer, ProposeRequest
from .rejection_sampler import Verdict, verify


@dataclass
class SpecCounters:
    """Totals over the engine's life (Prometheus counters)."""

    proposed: int = 0  # draft tokens scored by the target
    accepted: int = 0  # draft tokens accepted
    steps: int = 0  # request-steps that verified at least one draft
    emitted: int = 0  # tokens those steps emitted (accepted + one each)
    cut: int = 0  # drafts the draft budget cut: not verified, or for a proposer that
    # runs a model not made (runtime/spec/draft_budget.py)

    def count(self, num_drafts: int, verdict: Verdict) -> None:
        """Mutates: add one verifying step of `num_drafts` drafts and its verdict."""
        self.proposed += num_drafts
        self.accepted += verdict.num_accepted
        self.steps += 1
        self.emitted += len(verdict.token_ids)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying step (accepted drafts + the corrected/bonus one)."""
        return self.emitted / self.steps if self.steps else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int,
                 generator: torch.Generator | None = None,
                 disable_by_batch_size: int | None = None, adaptive: bool = True) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size  # SpeculativeConfig's
        # drafts cut to what pays on this machine (draft_budget.py; None: all verified)
        self.budget = DraftBudget(num_speculative_tokens) if adaptive else None
        self.generator = generator
        self.counters = SpecCounters()
        self.per_request: dict[str, SpecCounters] = {}

    @property
    def wants_hidden(self) -> bool:
        """The proposer drafts from the target's hidden states (engine calls observe)."""
        return self.proposer.uses_hidden

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Target layers whose output the proposer also reads (observe's `taps`)."""
        return self.proposer.tap_layers

    def observe(self, req: Request, feature: torch.Tensor,
                taps: torch.Tensor | None = None) -> None:
        """The target's final hidden state [H] at the request's last computed position,
        and its residual stream after `tap_layers` there [n, H]."""
        self.proposer.observe(req.request_id, req.num_computed_tokens - 1, feature, taps)

    def num_drafts_for(self, req: Request) -> int:
        """Drafts this request may take now: 0 unless it is decoding (one uncomputed
        token), has no penalties, and can still emit more than one token."""
        if req.num_tokens - req.num_computed_tokens != 1 or req.params.needs_penalties:
            return 0
        k = self.k
        if req.params.max_tokens is not None:  # never run past max_tokens
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        return max(k, 0)

    def propose(self, running: Sequence[Request]) -> dict[str, Proposal]:
        """Mutates the proposer's and the draft budget's state. Empty proposals are left
        out; none at all while more requests run than disable_by_batch_size; drafts cut by
        the budget (runtime/spec/draft_budget.py), before they are made for a proposer that
        runs a model and after for the others, and counted (SpecCounters.cut)."""
        if self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size:
            return {}
        batch = [ProposeRequest(r, n) for r in running if (n := self.num_drafts_for(r)) > 0]
        if self.budget is not None and self.proposer.runs_model and batch:
            wanted = self.budget.plan(batch, running)  # drafts cut before they are made
            self.counters.cut += sum(b.num_drafts for b in batch) - sum(wanted.values())
            batch = [ProposeRequest(b.request, wanted[b.request.request_id]) for b in batch
                     if b.request.request_id in wanted]
        if not batch:
            return {}
        out = {}
        for b, prop in zip(batch, self.proposer.propose(batch)):
            n = min(len(prop.token_ids), b.num_drafts)
            grammar = b.request.sampling.grammar
            if grammar is not None and n:  # only drafts the grammar allows are scored
                n = grammar.valid_prefix(prop.token_ids[:n])
            if n:
                out[b.request.request_id] = Proposal(prop.token_ids[:n],
                                                     None if prop.probs is None
                                                     else prop.probs[:n])
        if self.budget is None or not out:
            return out
        kept = self.budget.cap(out, running)
        self.counters.cut += sum(len(p.token_ids) for p in out.values()) - \
            sum(len(p.token_ids) for p in kept.values())
        return kept

    def verify(self, req: Request, logits: torch.Tensor, drafts: Sequence[int],
               proposal: Proposal) -> Verdict:
        """logits [len(drafts) + 1, V] fp32. `drafts` may be a prefix of the proposal (the
        scheduler cuts drafts that do not fit). Counts the result."""
        q = None if proposal.probs is None else proposal.probs[:len(drafts)]
        verdict = verify(logits, drafts, q, req.sampling, self.generator)
        for c in (self.counters, self.per_request.setdefault(req.request_id, SpecCounters())):
            c.count(len(drafts), verdict)
        if self.budget is not None:
            self.budget.observe(req.request_id, len(drafts), verdict.num_accepted)
        return verdict

    def decode_rows(self, chunks) -> int | None:
        """Before a step runs: the rows its scheduled chunks score where every chunk is
        one request's last token and its drafts (no prompt rows), which the budget's cost
        table takes (record_step); else None."""
        if self.budget is None or not all(
                c.samples and c.num_tokens == 1 + len(c.draft_token_ids) for c in chunks):
            return None
        return sum(c.num_tokens for c in chunks)

    def record_step(self, rows: int | None, seconds: float) -> None:
        """A step of decode_rows(its chunks) rows took `seconds` (None: not a decode step)."""
        if self.budget is not None and rows is not None:
            self.budget.record(rows, seconds)

    def release(self, request_id: str) -> SpecCounters | None:
        """Forget a finished/aborted request; returns its counters (None if it had none)."""
        self.proposer.release(request_id)
        if self.budget is not None:
            self.budget.release(request_id)
        return self.per_request.pop(request_id, None)
