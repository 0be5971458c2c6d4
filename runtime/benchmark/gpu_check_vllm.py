"""vLLM part of the GPU check: the same artifact and decode workload through vLLM's CUDA
build, where that build is importable on the device machine (it has no network: nothing
is installed here), so the engine's decode rate has its peer's beside it.

vLLM's offline API gives no per-token clock, so its decode tokens/s for n concurrent
greedy requests is the difference of two timed runs of the same n prompts, one producing
`tokens` tokens a request and one producing a single token (the prompt steps and first
tokens), so prompt work cancels out:

    rate = n * (tokens - 1) / (seconds(tokens) - seconds(1))

qserve's rate (gpu_check_e2e.decode_rates) leaves out the same work: its clock starts once
every request has its first token.
"""

from __future__ import annotations

import time


def decode_rate(streams: int, tokens: int, seconds_full: float,
                seconds_first: float) -> float | None:
    """Decode tokens/s from a run of `tokens` tokens a request and one of a single token
    (None when the difference is not positive: too short to time)."""
    if tokens < 2 or streams < 1:
        raise ValueError(f"decode_rate needs tokens >= 2 and streams >= 1, got {tokens}, "
                         f"{streams}.")
    spent = seconds_full - seconds_first
    return round(streams * (tokens - 1) / spent, 1) if spent > 0 else None


def run_vllm(model: str, streams: tuple[int, ...], tokens: int = 64) -> dict:
    """vLLM's decode tokens/s on `model` (an artifact directory) at each stream count, or
    why it did not run (not importable, or an error while loading or generating)."""
    try:
        import vllm
    except ImportError as exc:
        return {"status": "not installed", "error": str(exc)[:300]}
    try:
        llm = vllm.LLM(model=model, dtype="bfloat16", enforce_eager=False,
                       max_num_seqs=max(streams), gpu_memory_utilization=0.5)

        def timed(n: int, max_tokens: int) -> float:
            params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True)
            prompts = [f"Request {i}: write a story." for i in range(n)]
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - started

        timed(1, 2)  # warm-up: graphs, kernels
        rows = []
        for n in streams:
            full, first = timed(n, tokens), timed(n, 1)
            rows.append(dict(streams=n, tokens_per_s=decode_rate(n, tokens, full, first),
                             seconds=round(full, 4), first_token_seconds=round(first, 4)))
    except Exception as exc:  # reported: the check's other parts still stand
        return {"status": "failed", "version": getattr(vllm, "__version__", "?"),
                "error": f"{type(exc).__name__}: {exc}"[:1000]}
    return {"status": "ran", "version": vllm.__version__, "decode": rows}
