"""A single-sequence generation loop over a contiguous KV cache.

The reference path for one prompt: prefill in one pass, then one token per step, sampled
by the engine's Sampler. The continuous-batching engine serves (and `qserve generate`
runs through it); this loop stays as the simple oracle the engine's output is compared
with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .attention import AttentionMetadata, ContiguousCacheAttention
from .sampler import Sampler, SamplingState
from .sampling_params import SamplingParams


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


def _sampling_params(params: GenerationParams) -> SamplingParams:
    return SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature,
                          top_p=params.top_p, seed=params.seed)


@torch.inference_mode()
def generate(model, prompt_ids: list[int], params: GenerationParams,
             wrap_attention=None) -> Iterator[int]:
    """Yield generated token ids; stops at a stop token (yielded) or max_new_tokens.

    `wrap_attention(backend)` may wrap the KV cache backend (e.g. FP8 KV quantization).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token.")
    # the engine's sampler: a seeded request draws the same tokens here as when served
    sampler, state = Sampler(), SamplingState(_sampling_params(params), prompt_ids)
    cache = ContiguousCacheAttention()
    if wrap_attention is not None:
        cache = wrap_attention(cache)
    ids = torch.tensor(prompt_ids, dtype=torch.int64)
    positions = torch.arange(len(prompt_ids))
    meta = AttentionMetadata.single(len(prompt_ids))
    hidden = model(ids, positions, meta, cache)  # [T, hidden]
    context = len(prompt_ids)
    for _ in range(params.max_new_tokens):
        logits = model.compute_logits(hidden[-1:])  # [1, vocab] fp32
        token = sampler(logits.float(), [state]).token_ids[0]
        state.append_output(token)
        yield token
        if token in params.stop_token_ids:
            return
        meta = AttentionMetadata.single(1, context_len=context)
        hidden = model(torch.tensor([token]), torch.tensor([context]), meta, cache)
        context += 1
