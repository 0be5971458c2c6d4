"""End-to-end part of the GPU check: the engine on the device (`EngineConfig.device`: the
weights, the paged KV pool and the step inputs there, the Triton kernels, FP8 linears by
the device's ExecutionBackend) against the same engine on the CPU with its own kernels.

Reported, per model: the engine's backend line, greedy tokens equal to the CPU's (how
many leading tokens agree a prompt: bf16 on two devices may legitimately part after a
near-tie, so it is reported, not asserted), how many decode steps the decode graphs
served, and decode tokens/s at several stream counts, with the device's default decode
(CUDA graphs on CUDA) and eagerly (`--enforce-eager`) side by side.
"""

from __future__ import annotations

import gc
import time

import torch


def _generate(engine, tokenizer, prompts, max_tokens) -> tuple[list[list[int]], float, int]:
    from ..sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", tokenizer.encode(p), params)
        outs[f"r{i}"] = []
    steps, started = 0, time.perf_counter()
    while engine.has_unfinished:
        for o in engine.step():
            outs[o.request_id] += o.token_ids
        steps += 1
    if engine.execution is not None and engine.execution.device.type == "cuda":
        torch.cuda.synchronize()
    return [outs[f"r{i}"] for i in range(len(prompts))], time.perf_counter() - started, steps


def _engine(model: str, device: torch.device, kernels: str, max_num_seqs: int = 64,
            decode_graphs: str | None = None):
    """A fresh load (placing a model changes it in place) and its engine on `device`
    (decode_graphs None: the device's default)."""
    from ..engine import EngineConfig, LLMEngine
    from ..loaded_model import load

    lm = load(model, torch.bfloat16)
    config = EngineConfig(device=str(device), kernels=kernels, max_num_seqs=max_num_seqs,
                          num_kv_blocks=None if device.type == "cuda" else 2048,
                          decode_graphs=decode_graphs)
    return LLMEngine.from_model(lm, config), lm.tokenizer


def _release(device: torch.device) -> None:
    """Give a dropped engine's device memory back (its KV pool took most of what was free,
    and the next engine, or vLLM, sizes itself from what is free). An engine freezes the
    objects alive when it is built (engine.freeze_startup_objects): unfrozen first, so a
    collection can reach the dropped one's cycles."""
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _resolve(model: str) -> str:
    """A built-in name runs as its cached artifact when `qserve serve` or `qserve quantize`
    has made one; otherwise as given (a built-in name: bf16, bf16 KV)."""
    from ...quantize.builtin_artifact import cached_builtin_artifact

    return cached_builtin_artifact(model)


def decode_rates(model: str, device: torch.device, streams: tuple[int, ...],
                 tokens: int = 64, kernels: str = "triton",
                 decode_graphs: str | None = None) -> list[dict]:
    """Decode tokens/s of `streams` concurrent greedy requests (short prompts, `tokens`
    generated each) on `device`, prompt steps excluded (the clock starts once every
    request has its first token)."""
    from ..sampling_params import SamplingParams

    engine, tok = _engine(model, device, kernels, max_num_seqs=max(streams),
                          decode_graphs=decode_graphs)
    out = []
    for n in streams:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i in range(n):
            engine.add_request(f"s{n}-{i}", tok.encode(f"Request {i}: write a story."), params)
        started, produced, seen = None, 0, set()
        while engine.has_unfinished:
            for o in engine.step():
                if o.request_id in seen:
                    produced += len(o.token_ids)
                seen.add(o.request_id)
            if started is None and len(seen) == n:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - (started or time.perf_counter())
        out.append(dict(streams=n, tokens=produced, seconds=round(seconds, 4),
                        tokens_per_s=round(produced / seconds, 1) if seconds > 0 else None))
    del engine
    _release(device)
    return out


def run_e2e(model: str, device: torch.device, prompts: list[str], max_tokens: int,
            streams: tuple[int, ...] = (), tokens: int = 64) -> dict:
    """Greedy tokens of the device path (Triton kernels on `device`; on a CPU device
    under the Triton interpreter) against the CPU engine's own, and decode rates of the
    device path at each of `streams` (`tokens` generated a request)."""
    model = _resolve(model)
    res = dict(model=model, prompts=prompts, max_tokens=max_tokens)
    try:
        with torch.inference_mode():
            cpu_engine, tok = _engine(model, torch.device("cpu"), "torch")
            ref, ref_s, _ = _generate(cpu_engine, tok, prompts, max_tokens)
            del cpu_engine
            _release(torch.device("cpu"))
            dev_engine, _ = _engine(model, device, "triton")
            res["backend"] = dev_engine.execution.line()
            res["kv_dtype"] = dev_engine.kv_cache.spec.dtype
            got, got_s, steps = _generate(dev_engine, tok, prompts, max_tokens)
            graphs = dev_engine.runner.graphs
            res["decode_graph_steps"] = 0 if graphs is None else graphs.replays
            del dev_engine, graphs
            _release(device)
            if streams:
                res["decode"] = decode_rates(model, device, streams, tokens)
                if device.type == "cuda":  # the same, eagerly: what the graphs save
                    res["decode_eager"] = decode_rates(model, device, streams, tokens,
                                                       decode_graphs="off")
    except Exception as exc:  # reported: the check's other parts still run
        res.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:1000])
        return res
    agree = []
    for a, b in zip(got, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(n)
    res.update(status="ran", device_seconds=got_s, cpu_seconds=ref_s, steps=steps,
               leading_tokens_equal_to_cpu=agree, texts=[tok.decode(g) for g in got])
    return res
