"""Greedy agreement of a candidate (e.g. an FP8 artifact) with a reference model.

For each prompt the reference generates `num_tokens` greedy tokens. Then:
  - token agreement: the candidate, fed the prompt plus the reference's tokens (teacher
    forcing), picks the same top-1 token at each of those positions;
  - sequence match: the candidate's own free-running greedy output is identical over all
    `num_tokens` tokens.
Prompts are prefixes of the held-out documents (real text, never used for calibration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.attention import AttentionMetadata, DenseAttention
from ..runtime.generate import GenerationParams, generate

PROMPT_CHARS = 240  # characters of each held-out document used as a prompt


@dataclass(frozen=True)
class AgreementResult:
    token_agreement: float  # fraction of positions with the same top-1 token
    sequences_identical: float  # fraction of prompts with identical greedy output
    num_prompts: int
    num_tokens: int  # per prompt


def heldout_prompts(texts: list[str]) -> list[str]:
    return [t[:PROMPT_CHARS] for t in texts]


@torch.inference_mode()
def _argmax_along(model, ids: list[int], attention) -> torch.Tensor:
    x = torch.tensor(ids)
    hidden = model(x, torch.arange(len(ids)), AttentionMetadata.single(len(ids)), attention)
    return model.compute_logits(hidden).argmax(-1)  # [L]


def reference_continuations(model, prompt_ids: list[list[int]], num_tokens: int,
                            wrap_attention=None) -> list[list[int]]:
    params = GenerationParams(max_new_tokens=num_tokens)
    return [list(generate(model, ids, params, wrap_attention)) for ids in prompt_ids]


def agreement(candidate, prompt_ids: list[list[int]], ref_out: list[list[int]],
              wrap_attention=None) -> AgreementResult:
    """Compare `candidate` against precomputed reference continuations."""
    wrap = wrap_attention or (lambda a: a)
    same = total = identical = 0
    num_tokens = len(ref_out[0]) if ref_out else 0
    for ids, ref in zip(prompt_ids, ref_out):
        top1 = _argmax_along(candidate, ids + ref, wrap(DenseAttention()))
        picked = top1[len(ids) - 1:len(ids) - 1 + len(ref)].tolist()
        same += sum(a == b for a, b in zip(picked, ref))
        total += len(ref)
        own = list(generate(candidate, ids, GenerationParams(max_new_tokens=len(ref)), wrap_attention))
        identical += own == ref
    return AgreementResult(same / max(total, 1), identical / max(len(prompt_ids), 1),
                           len(prompt_ids), num_tokens)
