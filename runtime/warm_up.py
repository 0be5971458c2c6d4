"""Warm-up requests before serving, so the first client does not pay for kernel builds."""

from __future__ import annotations

from .sampling_params import SamplingParams


LONG_PROMPT = 256  # tokens of the first warm-up prompt, where the KV pool holds them


def warm_up(engine, tokenizer) -> None:
    """Mutates the engine's caches only (its requests finish): a 256-token prompt alone
    (the prefill path of the FP8 linears, a decode batch of one), then two short prompts
    together (a decode batch of two). A KV pool too small for 256 tokens gets the longest
    power-of-two prompt it holds, so a small --kv-cache-gib starts as it serves."""
    ids = tokenizer.encode("Hello", add_special_tokens=True) or [0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    n = LONG_PROMPT
    while n > len(ids) and not engine.scheduler.fits(n + params.max_tokens):
        n //= 2
    for wave in ((("warmup-long", (ids * n)[:max(n, len(ids))]),),
                 (("warmup-0", ids), ("warmup-1", ids))):
        for rid, prompt in wave:
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished:
            engine.step()
