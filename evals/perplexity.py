"""Perplexity of a model on real text, with a strided sliding window.

Each document is tokenized on its own (with the tokenizer's BOS if it adds one). Windows
of `window` tokens advance by `stride`; each window scores only the tokens no earlier
window scored, so every token after the first is scored exactly once with between
window - stride and window - 1 tokens of context. Perplexity = exp(total NLL / tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.attention import AttentionMetadata, DenseAttention
from ..runtime.tokenizer import Tokenizer

LOGIT_ROWS = 256  # rows of logits computed at once ([256, vocab] fp32 at a time)


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll_sum: float
    num_tokens: int  # tokens scored
    num_docs: int
    window: int
    stride: int


@dataclass(frozen=True)
class _Window:
    ids: list[int]  # the window's tokens
    score_from: int  # positions >= score_from (predicted from the previous token) count


def _windows(ids: list[int], window: int, stride: int) -> list[_Window]:
    out: list[_Window] = []
    scored_upto = 1  # token 0 is never predicted
    start = 0
    while scored_upto < len(ids):
        end = min(start + window, len(ids))
        out.append(_Window(ids[start:end], scored_upto - start))
        scored_upto = end
        if end == len(ids):
            break
        start = max(0, min(start + stride, end - 1))
    return out


@torch.inference_mode()
def _window_nll(model, windows: list[_Window], attention) -> tuple[float, int]:
    """Summed NLL and scored-token count over a batch of windows (one forward pass)."""
    flat = torch.tensor([t for w in windows for t in w.ids], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(w.ids)) for w in windows])
    meta = AttentionMetadata.from_lengths([len(w.ids) for w in windows])
    hidden = model(flat, positions, meta, attention)  # [T, hidden]
    rows, targets = [], []
    base = 0
    for w in windows:
        for p in range(max(w.score_from, 1), len(w.ids)):
            rows.append(base + p - 1)  # hidden at p-1 predicts token p
            targets.append(w.ids[p])
        base += len(w.ids)
    nll = 0.0
    for i in range(0, len(rows), LOGIT_ROWS):
        r = torch.tensor(rows[i:i + LOGIT_ROWS])
        logits = model.compute_logits(hidden[r])  # [rows, vocab] fp32
        nll += F.cross_entropy(logits, torch.tensor(targets[i:i + LOGIT_ROWS]),
                               reduction="sum").item()
    return nll, len(rows)


def perplexity(
    model,
    tokenizer: Tokenizer,
    texts: list[str],
    window: int = 1024,
    stride: int = 512,
    max_tokens: int | None = None,
    batch_tokens: int = 4096,
    progress=None,
    attention=None,
) -> PerplexityResult:
    """Perplexity of `model` on `texts`. `max_tokens` caps the tokens scored (a prefix).

    `attention`: the backend to run with (default: dense, no KV history); give an FP8-KV
    wrapper to measure an artifact with its KV cache quantization.
    """
    attention = attention if attention is not None else DenseAttention()
    if not texts:
        raise ValueError("perplexity needs at least one text.")
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride}, window={window}.")
    windows: list[_Window] = []
    budget = max_tokens if max_tokens is not None else math.inf
    docs = 0
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=True)
        docs += 1
        for w in _windows(ids, window, stride):
            scored = len(w.ids) - max(w.score_from, 1)
            if scored > budget:  # trim the last window to the budget
                w = _Window(w.ids[:max(w.score_from, 1) + int(budget)], w.score_from)
                scored = int(budget)
            if scored > 0:
                windows.append(w)
                budget -= scored
            if budget <= 0:
                break
        if budget <= 0:
            break
    nll, count = 0.0, 0
    batch: list[_Window] = []
    for w in windows + [None]:
        if w is None or (batch and sum(len(b.ids) for b in batch) + len(w.ids) > batch_tokens):
            if batch:
                n, c = _window_nll(model, batch, attention)
                nll, count = nll + n, count + c
                if progress is not None:
                    progress(c)
            batch = []
        if w is not None:
            batch.append(w)
    return PerplexityResult(math.exp(nll / count), nll, count, docs, window, stride)
