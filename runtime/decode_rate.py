"""Decode speed of an artifact, measured in-process: greedy tokens per second at a few
batch sizes, for reports that state what a choice costs (the quality budget's summary).

    rates = decode_rates("DIR", batches=(1, 16))   # [DecodeRate(batch=1, ...), ...]

Each batch generates `tokens` greedy tokens per prompt (EOS ignored) through `LLM.generate`,
`reps` times after a warm-up, and keeps the fastest; the rate counts output tokens, so it
includes the prompts' prefill (a short prompt per request). The benchmark with the parts
of a step is `python -m qserve.runtime.benchmark.step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeRate:
    batch: int             # sequences decoded together
    tokens_per_s: float    # output tokens a second over all of them (best of the reps)


def decode_rates(model: str, batches: tuple[int, ...] = (1, 16), tokens: int = 32,
                 reps: int = 2) -> list[DecodeRate]:
    """Greedy decode rate of artifact `model` at each batch size, with the torch thread
    count as the caller set it."""
    from .llm import LLM
    from .sampling_params import SamplingParams

    if tokens < 2 or reps < 1 or not batches or min(batches) < 1:
        raise ValueError(f"decode_rates: tokens >= 2, reps >= 1 and batch sizes >= 1, got "
                         f"tokens={tokens}, reps={reps}, batches={batches}")
    llm = LLM(model)
    warm_up(llm, max(batches))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rates = []
    for batch in batches:
        prompts = story_prompts(batch)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            llm.generate(prompts, params)
            best = min(best, time.perf_counter() - t)
        rates.append(DecodeRate(batch, batch * tokens / best))
    return rates


def story_prompts(n: int) -> list[str]:
    """n short distinct prompts to decode after (each shorter than a KV block, so no
    request reuses another's prefill)."""
    return [f"Story number {i}: once upon a time" for i in range(n)]


def warm_up(llm, n: int) -> None:
    """A few greedy tokens for n requests through `llm` (an LLM), so the timed runs do not
    pay for kernel builds, weight packing or compiling at that batch size."""
    from .sampling_params import SamplingParams

    llm.generate([f"Warm-up {i}" for i in range(n)], SamplingParams(max_tokens=4, temperature=0.0))


def describe(rates: list[DecodeRate]) -> str:
    """'12.3 / 456.7 tok/s at batch 1 / 16'."""
    return (" / ".join(f"{r.tokens_per_s:.1f}" for r in rates) + " tok/s at batch "
            + " / ".join(str(r.batch) for r in rates))
