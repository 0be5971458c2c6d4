"""N-gram prompt lookup: draft the tokens that followed the last occurrence of the
context's final n tokens (n from `max_n` down to `min_n`) anywhere earlier in the prompt
or output. Deterministic (q is one-hot), no model, no artifact part.

Options: min_n (default 2), max_n (default 3). A one-token match drafts from any earlier
occurrence of the last token, mostly wrongly: on the golden prompts (SmolLM2, 1 thread, k
= 4) min_n 1 had 16.7% of drafts accepted and 1.01x, min_n 2 35.6% and 1.05x (k = 3: 1.18x).
"""

from __future__ import annotations

from typing import Sequence

from .proposer import Proposal, Proposer, ProposeRequest, SpeculativeConfig, register_proposer


def lookup(tokens: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Tokens after the most recent earlier match of the longest matching suffix n-gram."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(tokens[L - n:])
        first = suffix[0]
        for start in range(L - n - 1, -1, -1):  # most recent match first
            if tokens[start] == first and list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + num_drafts])
                if follow:
                    return follow
    return []


@register_proposer("ngram")
class NgramProposer(Proposer):
    any_device = True  # token lookups on the host

    def __init__(self, config: SpeculativeConfig, target=None, **_) -> None:
        self.min_n = int(config.options.get("min_n", 2))
        self.max_n = int(config.options.get("max_n", 3))
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram proposer: need 1 <= min_n <= max_n, got min_n={self.min_n}, "
                             f"max_n={self.max_n}.")

    def propose(self, batch: Sequence[ProposeRequest]) -> list[Proposal]:
        return [Proposal(lookup(b.request.all_token_ids, b.num_drafts, self.min_n, self.max_n))
                for b in batch]
