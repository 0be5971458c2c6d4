"""Benchmark: one paged decode-attention layer at SmolLM2-135M shapes, all variants side by side.

    python -m qserve.runtime.benchmark.attention [--threads 2] [--reps 15] [--context 1024]
        [--prefill-chunk 256] [--cold]

9 q heads, 3 kv heads, head_dim 64, 16-token blocks, shuffled block tables, bf16 q;
batches of 1 and 16 sequences decoding at `--context` tokens; FP8 vs bf16 pools; every
decode implementation in DECODE_IMPLS. Timings are interleaved round-robin (one call of
each variant per round) so that a noisy shared machine hits all variants alike; the
median and the minimum over rounds are printed. Compile time (first call) is reported
separately. A prefill chunk (`--prefill-chunk` new tokens at the end of the context, or the
whole context if shorter) is timed through each PREFILL_IMPLS path. `--cold`: each decode
call reads other sequences' blocks than the call before (the pools hold over 64 MiB of
contexts), so the context comes from memory, as in a server's step over many layers and
sequences, instead of from cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ...kernels.kv_store import store_kv
from ...kernels.paged_attention import PREFILL_IMPLS, paged_attention

HQ, HKV, D, BS = 9, 3, 64, 16


def _setup(batch: int, context: int, dtype: str, query_len: int = 1, seed: int = 0,
           copies: int = 1) -> list[tuple]:
    """`copies` inputs over the same pools, each with its own batch of sequences (shuffled
    blocks, disjoint between copies)."""
    g = torch.Generator().manual_seed(seed)
    nb = (context + BS - 1) // BS
    num_blocks = copies * batch * nb + 3
    pool_dtype = torch.uint8 if dtype == "fp8" else torch.bfloat16
    k_pool = torch.zeros(num_blocks, BS, HKV, D, dtype=pool_dtype)
    v_pool = torch.zeros_like(k_pool)
    bt = torch.randperm(num_blocks, generator=g)[: copies * batch * nb].view(copies * batch, nb)
    slots = (bt[:, :, None] * BS + torch.arange(BS)).flatten(1)[:, :context].flatten()
    k = torch.randn(slots.numel(), HKV, D, generator=g)
    v = torch.randn(slots.numel(), HKV, D, generator=g)
    ks = vs = None
    if dtype == "fp8":
        ks, vs = torch.tensor([4.0 / 448]), torch.tensor([4.0 / 448])
    store_kv(k, v, k_pool, v_pool, slots, ks, vs)
    q = torch.randn(batch * query_len, HQ, D, generator=g).to(torch.bfloat16)
    qsl = torch.arange(batch + 1) * query_len
    seq = torch.full((batch,), context)
    return [(q, k_pool, v_pool, bt[i * batch:(i + 1) * batch].to(torch.int32), qsl, seq, ks,
             vs, D ** -0.5) for i in range(copies)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--impls", default="native,eager,chunked,compiled")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--cold", action="store_true",
                    help="Decode calls read contexts that are not in cache.")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    impls = args.impls.split(",")

    cases = {}
    for batch in (1, 16):
        for dtype in ("bf16", "fp8"):
            per_copy = batch * args.context * HKV * D * 2 * (1 if dtype == "fp8" else 2)
            copies = -(-(64 << 20) // per_copy) if args.cold else 1
            inputs = _setup(batch, args.context, dtype, copies=copies)
            for impl in impls:
                cases[f"decode B={batch:<2d} {dtype:4s} {impl}"] = (inputs, impl, "native")
    chunk = min(args.prefill_chunk, args.context)
    for dtype in ("bf16", "fp8"):
        inputs = _setup(1, args.context, dtype, query_len=chunk)
        for prefill in PREFILL_IMPLS:
            cases[f"prefill {chunk}/{args.context} {dtype:4s} {prefill}"] = (inputs, None,
                                                                            prefill)

    first = {}
    with torch.inference_mode():
        for name, (inputs, impl, prefill) in cases.items():  # warm-up; compiles here
            t = time.perf_counter()
            paged_attention(*inputs[0], decode_impl=impl, prefill_impl=prefill)
            first[name] = time.perf_counter() - t
            paged_attention(*inputs[0], decode_impl=impl, prefill_impl=prefill)
        times = {name: [] for name in cases}
        for i in range(args.reps):
            for name, (inputs, impl, prefill) in cases.items():
                t = time.perf_counter()
                paged_attention(*inputs[(i + 1) % len(inputs)], decode_impl=impl,
                                prefill_impl=prefill)
                times[name].append(time.perf_counter() - t)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, context "
          f"{args.context}, Hq {HQ}, Hkv {HKV}, D {D}, block {BS}, {args.reps} interleaved rounds"
          f"{', decode contexts read cold' if args.cold else ''}")
    print(f"{'case':34s} {'median ms':>10s} {'min ms':>9s} {'first call s':>13s}")
    for name, ts in times.items():
        print(f"{name:34s} {statistics.median(ts) * 1e3:10.2f} {min(ts) * 1e3:9.2f} "
              f"{first[name]:13.2f}")


if __name__ == "__main__":
    main()
