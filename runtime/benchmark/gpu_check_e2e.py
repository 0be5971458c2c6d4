"""End-to-end part of the GPU check: greedy generation through the engine with the model
and its paged KV cache on the device (kernels chosen by kernels/dispatch.py: Triton on
CUDA), against the same engine on CPU with the torch kernels.

The engine builds its KV cache and its step inputs on the CPU today, so this wraps the
model (`_OnDevice`: token ids and positions moved to the device, logits brought back
for the sampler) and builds the KVCache on the device; the attention metadata stays on
the host and the Triton wrappers copy it over. Nothing else of the runtime changes.
Greedy agreement is reported, not asserted: bf16 on two devices may legitimately
diverge after a near-tie.
"""

from __future__ import annotations

import os
import time

import torch


class _OnDevice:
    """The model as the ModelRunner calls it, run on `device`."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.config = model.config

    def __call__(self, ids, positions, meta, backend):  # [T] int64 host -> [T, hidden] device
        return self.model(ids.to(self.device), positions.to(self.device), meta, backend)

    def compute_logits(self, hidden):  # [N, hidden] device -> [N, vocab] fp32 host
        return self.model.compute_logits(hidden).cpu()


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
    return [outs[f"r{i}"] for i in range(len(prompts))], time.perf_counter() - started, steps


def _engine(lm, device: torch.device, kernels: str):
    from ..engine import EngineConfig, LLMEngine
    from ..kv_cache import KVCache, KVCacheSpec

    cfg = lm.model.config
    kv_dtype = "fp8" if lm.kv_scales else "bf16"
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, kv_dtype)
    cache = KVCache(spec, 256, lm.kv_scales or None, device=device)
    model = lm.model if device.type == "cpu" else _OnDevice(lm.model, device)
    config = EngineConfig(kv_dtype=kv_dtype, decode_impl="eager")
    os.environ["QSERVE_KERNELS"] = kernels
    return LLMEngine(model, lm.tokenizer, cache, f"{lm.path}:{device}:{kernels}", config)


def _resolve(model: str) -> str:
    """A built-in name runs as its cached FP8 artifact (FP8 KV) when `qserve serve` or
    `qserve quantize` has made one; otherwise as given (a built-in name: bf16, bf16 KV)."""
    from ...quantize.builtin_artifact import cached_builtin_artifact

    return cached_builtin_artifact(model)


def run_e2e(model: str, device: torch.device, prompts: list[str], max_tokens: int) -> dict:
    """Greedy tokens on the device (Triton kernels) vs on CPU (torch kernels)."""
    from ..loaded_model import load

    old = os.environ.get("QSERVE_KERNELS")
    model = _resolve(model)
    try:
        lm = load(model, torch.bfloat16)
    except Exception as exc:
        return dict(status="skipped", reason=f"could not load {model!r}: "
                                             f"{type(exc).__name__}: {exc}"[:500])
    res = dict(model=model, kv_dtype="fp8" if lm.kv_scales else "bf16", prompts=prompts,
               max_tokens=max_tokens)
    try:
        with torch.inference_mode():
            ref, ref_s, _ = _generate(_engine(lm, torch.device("cpu"), "torch"),
                                      lm.tokenizer, prompts, max_tokens)
            lm.model.to(device)
            got, got_s, steps = _generate(_engine(lm, device, "triton"), lm.tokenizer,
                                          prompts, max_tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
    except Exception as exc:
        res.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:1000])
        return res
    finally:
        lm.model.to("cpu")
        if old is None:
            os.environ.pop("QSERVE_KERNELS", None)
        else:
            os.environ["QSERVE_KERNELS"] = old
    agree = []
    for a, b in zip(got, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(n)
    tokens = sum(len(g) for g in got)
    res.update(status="ran", device_seconds=got_s, cpu_torch_seconds=ref_s, steps=steps,
               tokens_per_s=tokens / got_s, leading_tokens_equal_to_cpu=agree,
               texts=[lm.tokenizer.decode(g) for g in got])
    return res
