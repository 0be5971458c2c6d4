"""Sampler: next tokens (and logprobs) for a batch of requests from fp32 logits.

Order of operations, as in vLLM:
    logit_bias -> grammar mask (structured outputs: disallowed tokens to -inf)
    -> penalties (repetition, frequency, presence) -> greedy rows: argmax
    -> temperature -> top-k -> top-p -> min-p -> sample
Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) draws token i with
probability p_i. The noise of a request with a seed comes from its own torch.Generator,
so its tokens do not depend on which other requests share the batch; requests without a
seed share the sampler's generator (or torch's global one).

Logprobs are those of the raw model distribution (log_softmax of the logits as given,
before penalties and temperature), which is vLLM v1's default (`raw_logprobs`).

`argmax_decides(chunks, forking)` says whether a step needs nothing of its logits but each
row's argmax (every sampled request greedy and plain): the engine then asks the model for
the greedy tokens alone, which an LM head with 8-bit weights computes on the CPU without
making the [rows, vocab] logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Container, NamedTuple, Sequence

import torch

from .sampling_params import SamplingParams
from .structured.grammar_state import GrammarState, apply_bitmask, new_bitmask

if TYPE_CHECKING:
    from .scheduler import ScheduledChunk

# Rows of prompt logits turned into log-probabilities at a time (bounds memory for
# long prompts: 256 x 262k vocab x 4 bytes = 268 MB).
PROMPT_LOGPROBS_CHUNK = 256


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) alternatives, most likely first


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


class SamplingState:
    """Per-request sampling state: prompt and output tokens (for penalties) and the
    seeded generator. `output_token_ids`: a list the owner appends to (a Request passes its
    own, so the outputs are kept once); without one, `append_output` fills a new list."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int],
                 output_token_ids: list[int] | None = None):
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = [] if output_token_ids is None else output_token_ids
        self._generator: torch.Generator | None = None
        # where the request is in its grammar (structured outputs); the engine sets it and
        # advances it on each accepted token
        self.grammar: GrammarState | None = None

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's generator (created on first use, seeded), or None without a seed."""
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.params.seed)
        return self._generator


def _token_mask(rows: Sequence[Sequence[int]], vocab_size: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs, flattened: the coordinates of every listed token."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
    row_idx = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    tok_idx = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)
    if tok_idx.numel() and (int(tok_idx.min()) < 0 or int(tok_idx.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties.")
    return row_idx, tok_idx


def apply_penalties(logits: torch.Tensor, prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalised copy of `logits` [B, V] fp32; the per-row penalties are [B] fp32.

    repetition r (prompt or output tokens): x / r if x > 0 else x * r
    then, with c = count of the token in the output:  x - frequency * c - presence * (c > 0)
    """
    B, V = logits.shape
    out_rows, out_toks = _token_mask(output_token_ids, V, logits.device)
    counts = torch.zeros(B, V, dtype=logits.dtype, device=logits.device)  # [B, V] fp32
    counts.index_put_((out_rows, out_toks), torch.ones_like(out_toks, dtype=logits.dtype),
                      accumulate=True)
    seen = counts > 0  # [B, V] bool
    logits = logits.clone()
    if bool((repetition != 1).any()):
        p_rows, p_toks = _token_mask(prompt_token_ids, V, logits.device)
        in_context = seen.clone()
        in_context[p_rows, p_toks] = True
        r = repetition.unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(in_context, penalised, logits)
    logits -= frequency.unsqueeze(1) * counts
    logits -= presence.unsqueeze(1) * seen.to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's logit_bias to logits [B, V] fp32, in place."""
    rows = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if rows:
        r, t, b = zip(*rows)
        dev = logits.device
        logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                          torch.tensor(b, dtype=logits.dtype, device=dev), accumulate=True)


def apply_grammar(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
    """Mask, in place, each constrained row of logits [B, V] fp32 to the tokens its
    grammar allows next (the others become -inf)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    mask = new_bitmask(logits.shape[0], logits.shape[1])  # [B, ceil(V / 32)] int32
    for i in rows:
        grammars[i].fill(mask, i)
    apply_bitmask(logits, mask, rows)


def constrain(logits: torch.Tensor, states: Sequence["SamplingState"]) -> torch.Tensor:
    """logits [B, V] fp32 with every row's logit_bias added and grammar applied: a copy
    when any row has either, else `logits` itself."""
    grammars = [s.grammar for s in states]
    params = [s.params for s in states]
    if all(g is None for g in grammars) and not any(p.logit_bias for p in params):
        return logits
    x = logits.clone()
    apply_logit_bias(x, params)
    apply_grammar(x, grammars)
    return x


def argmax_decides(chunks: Sequence["ScheduledChunk"], forking: Container[str]) -> bool:
    """Whether a step's sampled tokens are the argmax of each sampled row's raw logits and
    nothing else reads those logits: the one test of the greedy fast path, where the model
    runner returns the rows' greedy tokens (ModelRunner.execute(greedy=True), the model's
    greedy_tokens) instead of their logits and the engine takes them as sampled.

    chunks: the step's scheduled chunks; forking: ids of requests whose n > 1 samples wait
    to fork from their first token. Every reader of the sampled rows' logits, and what
    this asks so that it reads nothing (true of every chunk that samples):
      - Sampler.__call__: `constrain` (logit_bias, the grammar mask of structured outputs),
        penalties (presence, frequency, repetition), temperature sampling (top-k, top-p,
        min-p, seeded or not), logprobs (log_softmax) -> greedy (temperature 0), no
        logit_bias, no penalty, no logprobs, no grammar; for such a row the Sampler
        returns torch.argmax of the logits as given, which greedy_tokens equals;
      - verification of drafts (speculative decoding, the grammar's jump-forward tokens)
        -> no draft tokens;
      - forked samples of an n > 1 request, which sample from their parent's row
        (LLMEngine._fork_samples) -> no request in `forking`.
    Prompt logprobs read the prompt rows' logits, which the runner makes apart
    (RunnerOutput.prompt_logits): they do not stop it. SamplingParams has no other mask
    (no min_tokens, no bad words); a new one that reads the logits must be added here.
    False for a step that samples nothing (no rows to save)."""
    sampled = [c for c in chunks if c.samples]
    if not sampled:
        return False
    for c in sampled:
        state = c.request.sampling
        p = state.params
        if (c.draft_token_ids or c.request.request_id in forking or not p.is_greedy
                or p.logprobs is not None or p.logit_bias or p.needs_penalties
                or p.structured is not None or state.grammar is not None):
            return False
    return True


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the tokens whose logit is >= the k-th largest (ties kept); top_k [B]
    int64, a value <= 0 or >= V disables the row. Returns a masked copy (-inf)."""
    V = logits.shape[-1]
    enabled = (top_k > 0) & (top_k < V)
    if not bool(enabled.any()):
        return logits
    k = torch.where(enabled, top_k, torch.ones_like(top_k))
    max_k = int(k.max())
    kth = torch.topk(logits, max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    kth = torch.where(enabled.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus: keep a token if the probability mass of the tokens ranked above it is
    < top_p (so the most likely token always stays); top_p [B] fp32, 1 disables the row."""
    if not bool((top_p < 1).any()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending, [B, V]
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)  # mass of this token and those below it
    drop[:, -1] = False
    drop &= (top_p < 1).unsqueeze(1)
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < min_p * (the row's max probability); min_p [B]."""
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The distribution a sampled row draws from: logits [R, V] fp32 and per-row [R]
    temperature, top-k (long), top-p, min-p -> probs [R, V] fp32, the filters applied in
    that order after the temperature. The one definition the Sampler, the speculative
    verifier and the reference generation loop share."""
    x = logits / temperature.unsqueeze(1)
    x = apply_top_k(x, top_k)
    x = apply_top_p(x, top_p)
    x = apply_min_p(x, min_p)
    return torch.softmax(x, dim=-1)


def _logprobs_rows(logprobs: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """TokenLogprobs for each row of `logprobs` [N, V]: the given token and top alternatives."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(num_top, default=0)
    top_vals = top_ids = None
    if max_top > 0:
        top = torch.topk(logprobs, max_top, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    result = []
    for i, (tok, lp, k) in enumerate(zip(token_ids, chosen, num_top)):
        alts = list(zip(top_ids[i][:k], top_vals[i][:k])) if k > 0 else []
        result.append(TokenLogprobs(int(tok), lp, alts))
    return result


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int],
                    num_top: int = 0) -> list[TokenLogprobs | None]:
    """Logprob of every prompt token given the ones before it.

    logits [L or L-1, V] fp32, row i computed after prompt token i (so it predicts token
    i+1; a last row predicting past the prompt is ignored). Returns one entry per prompt
    token, None for the first (nothing predicts it), as in the OpenAI API. Read-only.
    """
    n = len(prompt_ids)
    if logits.dim() != 2 or logits.shape[0] not in (n, n - 1) or n == 0:
        raise ValueError(f"prompt logits must be [len(prompt) or len(prompt)-1, vocab], "
                         f"got {tuple(logits.shape)} for {n} prompt tokens.")
    result: list[TokenLogprobs | None] = [None]
    for start in range(0, n - 1, PROMPT_LOGPROBS_CHUNK):
        end = min(start + PROMPT_LOGPROBS_CHUNK, n - 1)
        lp = torch.log_softmax(logits[start:end].float(), dim=-1)  # [chunk, V] fp32
        result += _logprobs_rows(lp, prompt_ids[start + 1:end + 1], [num_top] * (end - start))
    return result


class Sampler:
    """Samples one token per row. Stateless apart from the generator for unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """logits [B, V] fp32, one SamplingState per row. Reads the states (and draws from
        seeded rows' generators) but does not append the sampled tokens to them."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [batch, vocab] with one row per state, got "
                             f"{tuple(logits.shape)} for {len(states)} states.")
        if logits.dtype != torch.float32:
            raise ValueError(f"the sampler takes fp32 logits, got {logits.dtype}: "
                             f"call .float() first.")
        params = [s.params for s in states]
        device = logits.device
        B, V = logits.shape

        def column(values, dtype=torch.float32) -> torch.Tensor:  # [B]
            return torch.tensor(values, dtype=dtype, device=device)

        x = constrain(logits, states)
        if any(p.needs_penalties for p in params):
            x = apply_penalties(
                x, [s.prompt_token_ids if s.params.repetition_penalty != 1 else () for s in states],
                [s.output_token_ids for s in states],
                column([p.repetition_penalty for p in params]),
                column([p.frequency_penalty for p in params]),
                column([p.presence_penalty for p in params]))
        greedy = [p.is_greedy for p in params]
        token_ids = torch.argmax(x, dim=-1) if any(greedy) else None  # [B] int64
        if not all(greedy):
            probs = filtered_probs(  # [B, V] fp32
                x, column([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
                column([p.top_k for p in params], torch.long),
                column([p.top_p for p in params]), column([p.min_p for p in params]))
            q = torch.empty_like(probs)
            q.exponential_(generator=self.generator)
            for i, (state, g) in enumerate(zip(states, greedy)):
                gen = None if g else state.generator(device)
                if gen is not None:
                    q[i].exponential_(generator=gen)
            sampled = (probs / q.clamp_min(1e-20)).argmax(dim=-1)  # [B] int64
            token_ids = sampled if token_ids is None else torch.where(
                column(greedy, torch.bool), token_ids, sampled)
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._logprobs(logits, ids, params))

    @staticmethod
    def _logprobs(logits: torch.Tensor, ids: list[int],
                  params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(params)
        if rows:
            lp = torch.log_softmax(logits[rows], dim=-1)  # [R, V] fp32, raw distribution
            for i, tl in zip(rows, _logprobs_rows(lp, [ids[i] for i in rows],
                                                  [params[i].logprobs for i in rows])):
                out[i] = tl
        return out
