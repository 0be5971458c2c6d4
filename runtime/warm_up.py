"""Warm-up requests before serving, so the first client does not pay for kernel builds."""

from __future__ import annotations

from .sampling_params import SamplingParams


def warm_up(engine, tokenizer) -> None:
    """Mutates the engine's caches only (its requests finish): a 256-token prompt alone
    (the prefill path of the FP8 linears, a decode batch of one), then two short prompts
    together (a decode batch of two)."""
    ids = tokenizer.encode("Hello", add_special_tokens=True) or [0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for wave in ((("warmup-long", (ids * 256)[:256]),),
                 (("warmup-0", ids), ("warmup-1", ids))):
        for rid, prompt in wave:
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished:
            engine.step()
