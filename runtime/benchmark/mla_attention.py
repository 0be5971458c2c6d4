"""Benchmark: one decode-attention layer at long context, GQA FP8 against MLA latent FP8.

    python -m qserve.runtime.benchmark.mla_attention [--batch 16] [--context 4096]
        [--rank 127] [--rope-dim 64] [--threads 2] [--reps 10]

SmolLM2-135M's attention shapes (9 q heads; GQA: 3 kv heads of 64, K and V pools; MLA
converted with `--mla RANK`: one cached vector of rank + 1 + rope_dim values, read as key
and value). Each variant is what one decode step of one layer runs after its projections:
- gqa: the engine's paged attention over the FP8 K and V pools;
- mla: the absorbed form as MLAAttention runs it in the engine — W_UK folded into the
  query, paged attention over the FP8 latent pool (the pool passed as K and V), W_UV
  applied to the result;
- mla_c: the same as the C decode path calls the kernel: values are the latent's first
  rank + 1 columns only (the RoPE key after them is no value);
- mla_torch: the same through kernels/mla_decode.py's torch path (the GPU kernel's twin).
Timings are interleaved round-robin; medians over rounds. KV bytes read per step are the
pools' bytes for the batch's context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ...kernels.mla_decode import mla_decode
from ...kernels.native_attention import native_attention
from ...kernels.paged_attention import kernel_scales, paged_attention

HQ, HKV, D, BS = 9, 3, 64, 16


def _pool(num_blocks: int, width: int, heads: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(num_blocks, BS, heads, width, generator=g) * 0.5
    return x.to(torch.float8_e4m3fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.mla_attention")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=127)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    b, ctx = a.batch, a.context
    nb = (ctx + BS - 1) // BS
    num_blocks = b * nb + 1
    tables = torch.randperm(num_blocks, generator=g)[:b * nb].view(b, nb).to(torch.int32)
    seq_lens = torch.full((b,), ctx, dtype=torch.int64)
    qsl = torch.arange(b + 1, dtype=torch.int64)
    scale = torch.tensor([0.01])
    latent_w = a.rank + 1 + a.rope_dim

    k_pool, v_pool = _pool(num_blocks, D, HKV, g), _pool(num_blocks, D, HKV, g)
    q_gqa = torch.randn(b, HQ, D, generator=g).to(torch.bfloat16)
    latent = _pool(num_blocks, latent_w, 1, g)
    q_nope = torch.randn(b, HQ, 2 * D, generator=g).to(torch.bfloat16)  # converted: 2 mixed heads
    q_pe = torch.randn(b, HQ, a.rope_dim, generator=g).to(torch.bfloat16)
    w_uk = (torch.randn(HQ, 2 * D, a.rank + 1, generator=g) * 0.05).to(torch.bfloat16)
    w_uv_t = (torch.randn(HQ, a.rank + 1, D, generator=g) * 0.05).to(torch.bfloat16)

    def gqa():
        return paged_attention(q_gqa, k_pool, v_pool, tables, qsl, seq_lens, scale, scale,
                               D ** -0.5, None, None)

    def absorbed_q():
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, R+1]
        return torch.cat((q_lat, q_pe), dim=-1)  # [B, H, R+1+P]

    def mla():
        q = absorbed_q()
        ctx_lat = paged_attention(q, latent, latent, tables, qsl, seq_lens, scale, scale,
                                  0.07, None, None)[..., :a.rank + 1]
        return torch.bmm(ctx_lat.to(torch.bfloat16).transpose(0, 1), w_uv_t)

    qk_lat, v_lat = kernel_scales(scale, scale, 0.07, 1)

    def mla_c():
        ctx_lat = native_attention(absorbed_q(), latent, latent, tables, qsl, seq_lens, qk_lat,
                                   v_lat, None, None, value_dim=a.rank + 1)[..., :a.rank + 1]
        return torch.bmm(ctx_lat.to(torch.bfloat16).transpose(0, 1), w_uv_t)

    def mla_torch():
        q = absorbed_q()
        ctx_lat = mla_decode(q, latent, scale, tables, seq_lens, a.rank + 1, 0.07)
        return torch.bmm(ctx_lat.to(torch.bfloat16).transpose(0, 1), w_uv_t)

    variants = {"gqa": gqa, "mla": mla, "mla_c": mla_c, "mla_torch": mla_torch}
    for fn in variants.values():  # warm up (and build native kernels)
        fn()
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(a.reps):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    kv_bytes = {"gqa": 2 * b * ctx * HKV * D, "mla": b * ctx * latent_w,
                "mla_c": b * ctx * latent_w, "mla_torch": b * ctx * latent_w}
    print(f"{b} sequences x {ctx} tokens of context, one layer, {a.threads} threads, "
          f"{a.reps} interleaved rounds; MLA rank {a.rank} + 1 + RoPE {a.rope_dim} = "
          f"{latent_w} values/token vs GQA {2 * HKV * D}")
    print("| variant | median ms | min ms | KV bytes read | GB/s |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f} | {kv_bytes[name] / 2**20:.1f} MiB | "
              f"{kv_bytes[name] / med / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
