"""Verification of draft tokens against the target by rejection sampling.

For drafts d_1..d_k drawn from q and the target's distributions p_1..p_{k+1} (one per
position, computed in one forward pass):

    for i in 1..k: accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
                   on rejection emit a token from norm(max(0, p_i - q_i)) and stop
    all accepted:  emit a bonus token from p_{k+1}

Every emitted token is then distributed exactly as the target alone would sample it
(Leviathan et al. / Chen et al., 2023). Deterministic drafts (n-gram) have q one-hot.
Greedy requests accept while the draft equals the target's argmax and emit the argmax
at the first mismatch, so their output equals non-speculative greedy decoding.

p is the target's *sampling* distribution: logit_bias and the grammar mask (structured
outputs: row i allows what the grammar allows after drafts d_1..d_i, which the proposer
already cut to the grammar's), then temperature, top-k, top-p and min-p, as the Sampler
applies them (requests with repetition/frequency/presence penalties are not
speculated, since their penalties would change along the drafts).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..sampler import (SamplingState, TokenLogprobs, _logprobs_rows, apply_logit_bias,
                       filtered_probs)
from ..structured.grammar_state import apply_bitmask
from ..sampling_params import SamplingParams


class Verdict(NamedTuple):
    token_ids: list[int]  # accepted drafts, then one corrected or bonus token
    num_accepted: int  # drafts accepted (len(token_ids) - 1)
    logprobs: list[TokenLogprobs] | None  # per emitted token when the request asked


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: logits [R, V] fp32 -> probs
    [R, V] fp32 (sampler.filtered_probs with the request's parameters on every row)."""
    R = logits.shape[0]

    def column(value, dtype=torch.float32) -> torch.Tensor:  # [R]
        return torch.full((R,), value, dtype=dtype, device=logits.device)

    return filtered_probs(logits, column(params.temperature), column(params.top_k, torch.long),
                          column(params.top_p), column(params.min_p))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] (need not be normalised): the exponential race."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / e.clamp_min(1e-20)).argmax())


def accept_mask(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """[k] bool: draft i is accepted iff u_i < p_i(d_i) / q_i(d_i), i.e. with probability
    min(1, p/q). u ~ U[0, 1), all [k] fp32."""
    return u * q_draft < p_draft


def verify(logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
           state: SamplingState, generator: torch.Generator | None = None) -> Verdict:
    """logits [k+1, V] fp32 (raw target logits at the last committed token and each draft),
    drafts [k], draft_probs [k, V] fp32 or None (one-hot). Draws from the request's seeded
    generator if it has one, else from `generator` (None: torch's global one)."""
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} rows of target logits, got {tuple(logits.shape)}.")
    if draft_probs is not None and draft_probs.shape != (k, logits.shape[1]):
        raise ValueError(f"draft probs must be [k, vocab] = [{k}, {logits.shape[1]}], got "
                         f"{tuple(draft_probs.shape)}.")
    params = state.params
    raw = logits
    if params.logit_bias or state.grammar is not None:
        logits = logits.clone()
        apply_logit_bias(logits, [params] * (k + 1))
        if state.grammar is not None:  # [k+1, ceil(V/32)] int32
            apply_bitmask(logits, state.grammar.masks_along(drafts), list(range(k + 1)))
    if params.is_greedy:
        target = logits.argmax(dim=-1).tolist()  # [k+1]
        n = 0
        while n < k and drafts[n] == target[n]:
            n += 1
        tokens = list(drafts[:n]) + [target[n]]
    else:
        gen = state.generator(logits.device) or generator
        p = sampling_probs(logits, params)  # [k+1, V]
        d = torch.tensor(list(drafts), dtype=torch.long, device=logits.device)  # [k]
        rows = torch.arange(k, device=logits.device)
        p_d = p[rows, d]  # [k]
        q_d = draft_probs[rows, d] if draft_probs is not None else torch.ones_like(p_d)
        u = torch.rand(k, generator=gen, device=logits.device)
        accepted = accept_mask(u, p_d, q_d).tolist()
        n = accepted.index(False) if False in accepted else k
        if n < k:
            if draft_probs is not None:
                residual = (p[n] - draft_probs[n]).clamp_min(0)
            else:
                residual = p[n].clone()
                residual[drafts[n]] = 0.0  # max(0, p - onehot)
            if float(residual.sum()) <= 0:  # only by rounding: p == q there
                residual = p[n]
            last = draw(residual, gen)
        else:
            last = draw(p[k], gen)
        tokens = list(drafts[:n]) + [last]
    lps = None
    if params.logprobs is not None:
        lp = torch.log_softmax(raw[:len(tokens)], dim=-1)  # raw model distribution
        lps = _logprobs_rows(lp, tokens, [params.logprobs] * len(tokens))
    return Verdict(tokens, n, lps)
