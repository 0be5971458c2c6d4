"""A single-sequence generation loop over a contiguous KV cache.

The reference path for one prompt: prefill in one pass, then one token per step. The
continuous-batching engine replaces it for serving; this loop stays as the simple oracle
the engine's greedy output is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .attention import AttentionMetadata, ContiguousCacheAttention


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")


def _pick(logits: torch.Tensor, params: GenerationParams, gen: torch.Generator | None) -> int:
    """Next token from fp32 logits [vocab]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p  # always keeps the top
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.inference_mode()
def generate(model, prompt_ids: list[int], params: GenerationParams,
             wrap_attention=None) -> Iterator[int]:
    """Yield generated token ids; stops at a stop token (yielded) or max_new_tokens.

    `wrap_attention(backend)` may wrap the KV cache backend (e.g. FP8 KV quantization).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token.")
    gen = None
    if params.seed is not None:
        gen = torch.Generator().manual_seed(params.seed)
    cache = ContiguousCacheAttention()
    if wrap_attention is not None:
        cache = wrap_attention(cache)
    ids = torch.tensor(prompt_ids, dtype=torch.int64)
    positions = torch.arange(len(prompt_ids))
    meta = AttentionMetadata.single(len(prompt_ids))
    hidden = model(ids, positions, meta, cache)  # [T, hidden]
    context = len(prompt_ids)
    for _ in range(params.max_new_tokens):
        logits = model.compute_logits(hidden[-1:])[0]  # [vocab] fp32
        token = _pick(logits, params, gen)
        yield token
        if token in params.stop_token_ids:
            return
        meta = AttentionMetadata.single(1, context_len=context)
        hidden = model(torch.tensor([token]), torch.tensor([context]), meta, cache)
        context += 1
