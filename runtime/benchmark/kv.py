"""Benchmark: KV bytes per token (FP8 vs bf16) and paged-allocation waste.

    python -m qserve.runtime.benchmark.kv [MODEL] [--requests 16] [--max-tokens 32] [--threads 2]
                                          [--context 4096]

Runs the engine over prompts cut from the held-out text (lengths spread between 50 and
400 tokens) and samples, after every step, the share of allocated KV slots that hold no
token (the unfilled tail of each request's last block). Reports the mean and the worst
step, the KV bytes per token of both pool dtypes, and how many tokens and how many
2k-token streams fit in a fixed 1 GiB KV budget. Then runs one request of `--context`
prompt tokens and reports the most KV it held at once, against what it would hold if
every layer kept every token (they differ where sliding-window layers give back blocks
behind their window: runtime/kv_groups.py).
"""

from __future__ import annotations

import argparse
import time

import torch

from ...evals.golden_text import load_heldout_text
from ..engine import EngineConfig, LLMEngine
from ..kv_cache import KVCacheSpec
from ..loaded_model import load
from ..sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096,
                    help="Prompt tokens of the long-context request (0: skip it).")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    lm = load(args.model)
    cfg = lm.model.config
    engine = LLMEngine.from_model(lm, EngineConfig(max_num_batched_tokens=512))
    text = " ".join(load_heldout_text())
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    g = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        n = int(torch.randint(50, 400, (1,), generator=g))
        start = int(torch.randint(0, len(ids) - n, (1,), generator=g))
        engine.add_request(f"b{i}", ids[start:start + n],
                           SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                          ignore_eos=True))
    bs = engine.blocks.block_size
    waste = []
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        running = engine.scheduler.running
        slots = sum(len(engine.blocks.block_table(r.request_id)) * bs for r in running)
        used = sum(r.num_computed_tokens for r in running)
        if slots:
            waste.append(1 - used / slots)
    dt = time.perf_counter() - t0
    budget = 2**30
    print(f"{args.model}: {args.requests} requests, {steps} steps in {dt:.1f}s, "
          f"{args.threads} threads, KV pool {engine.kv_cache.spec.dtype}")
    print(f"paged-allocation waste: mean {sum(waste) / len(waste):.2%}, "
          f"worst step {max(waste):.2%} (block size {bs})")
    for dtype in ("fp8", "bf16"):
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bs, dtype)
        tokens = spec.num_blocks_for(budget) * bs
        print(f"{dtype:>4}: {spec.bytes_per_token} bytes/token; 1 GiB holds {tokens} tokens "
              f"= {tokens // 2048} streams of 2,048 tokens")
    if args.context:
        _long_context(engine, ids, args.context)


def _long_context(engine: LLMEngine, ids: list[int], context: int) -> None:
    """Peak KV held by one request of `context` prompt tokens + 8 generated."""
    prompt = (ids * (context // len(ids) + 1))[:context]
    engine.add_request("long", prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True))
    peak = 0
    while engine.has_unfinished:
        engine.step()
        if engine.blocks.has_request("long"):
            peak = max(peak, engine.blocks.num_held_blocks("long"))
    spec = engine.kv_cache.spec
    held = peak * spec.bytes_per_block
    every_layer = engine.blocks.blocks_needed(context + 8) * spec.bytes_per_token * spec.block_size
    print(f"one request of {context} + 8 tokens: held at most {held / 2**20:.1f} MiB of KV "
          f"({peak} blocks over {engine.kv_cache.groups.num_groups} layer groups, windows "
          f"{engine.kv_cache.groups.windows}); every layer keeping every token: "
          f"{every_layer / 2**20:.1f} MiB ({every_layer / held:.2f}x)")


if __name__ == "__main__":
    main()
