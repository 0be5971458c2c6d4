"""The kernel cases of the GPU check (runtime/benchmark/gpu_check.py): build inputs at a given size,
compare a sample with the float64 reference on the host, time the kernel and the torch
counterpart. Every function returns a flat dict for the JSON/markdown report.

Errors are max |out - ref| / max |ref| over the sampled rows; bounds as in the tests
(fp32 1e-5, bf16 5e-3 for attention; per-element half-ulp bounds for the GEMM; exact
bytes for the KV store). On the GPU the bf16-q attention dots run on tf32 tensor cores
(see triton_decode_attention.py), which these bounds hold to account at real sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fp8 import quantize_fp8
from .fp8_gemm import fp8_linear_reference
from .kv_store import store_kv_reference
from .paged_attention import paged_attention_reference

ATTN_BOUND = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


@dataclass
class Timer:
    """Median milliseconds: triton.testing.do_bench on CUDA; one wall-clock run otherwise
    (the interpreter dry run, whose times mean nothing)."""

    cuda: bool

    def __call__(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def _paged(lens: list[int], hkv: int, d: int, bs: int, fp8: bool, device):
    """Pools holding random K/V for sequences of `lens` tokens; shuffled block tables."""
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32, device=device)
    starts = torch.tensor([0] + need, device=device).cumsum(0).tolist()
    for b, n in enumerate(need):
        bt[b, :n] = perm[starts[b]:starts[b] + n]
    shape = (num_blocks, bs, hkv, d)
    pools, scales = [], []
    for _ in range(2):
        x = torch.randn(shape, dtype=torch.bfloat16, device=device)
        if fp8:
            s = (torch.rand(hkv, device=device) * 0.004 + 0.008).float()  # ~4 sigma at 448
            pools.append(quantize_fp8(x, s.view(1, 1, hkv, 1)))
            scales.append(s)
        else:
            pools.append(x)
            scales.append(None)
        del x
    return pools[0], pools[1], bt, scales[0], scales[1]


def _sample_error(args, out, seqs, row_start, rows, window, softcap) -> float:
    """Reference on the host for `rows` new tokens from `row_start` of each sampled sequence
    (a query only sees keys up to its own position, so the context is cut after it)."""
    q, kp, vp, bt, qsl, seq, ks, vs, scale = args
    worst = 0.0
    for b in seqs:
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        qlen, seq_len = q1 - q0, int(seq[b])
        r0, n = min(row_start, qlen - 1), min(rows, qlen)
        r0 = min(r0, qlen - n)
        ctx = seq_len - qlen + r0 + n
        blocks = bt[b, : -(-ctx // kp.shape[1])].long()
        sub = (q[q0 + r0:q0 + r0 + n].cpu(), kp[blocks].cpu(), vp[blocks].cpu(),
               torch.arange(blocks.numel(), dtype=torch.int32)[None],
               torch.tensor([0, n]), torch.tensor([ctx]),
               None if ks is None else ks.cpu(), None if vs is None else vs.cpu(), scale)
        ref = paged_attention_reference(*sub, window, softcap)
        got = out[q0 + r0:q0 + r0 + n].cpu().double()
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


def decode_case(timer, device, batch, ctx, hq, hkv, d, fp8=True, q_dtype=torch.bfloat16,
                window=None, softcap=None, num_splits=None, sdpa=True, pv_mode=None) -> dict:
    """pv_mode: run with triton_numerics.PV_TF32_MODE set to it (e.g. "tf32")."""
    from . import triton_numerics

    default = triton_numerics.PV_TF32_MODE
    triton_numerics.PV_TF32_MODE = pv_mode or default
    try:
        res = _decode(timer, device, batch, ctx, hq, hkv, d, fp8, q_dtype, window, softcap,
                      num_splits, sdpa)
    finally:
        triton_numerics.PV_TF32_MODE = default
    res["pv"] = triton_numerics.dot_precisions(q_dtype)[1] if pv_mode is None else pv_mode
    return res


def _decode(timer, device, batch, ctx, hq, hkv, d, fp8, q_dtype, window, softcap, num_splits,
            sdpa) -> dict:
    from .triton_paged_attention import plan_paged_attention

    bs = 16
    kp, vp, bt, ks, vs = _paged([ctx] * batch, hkv, d, bs, fp8, device)
    q = torch.randn(batch, hq, d, device=device).to(q_dtype)
    qsl = torch.arange(batch + 1, device=device)
    seq = torch.full((batch,), ctx, device=device)
    args = (q, kp, vp, bt, qsl, seq, ks, vs, d ** -0.5)
    launch = plan_paged_attention(*args, window, softcap, num_splits)
    out = torch.full_like(q, float("nan"))
    launch.run(out)
    err = _sample_error(args, out, sorted({0, batch - 1}), 0, 1, window, softcap)
    ms = timer(lambda: launch.run(out))
    visible = min(ctx, window or ctx)
    kv_bytes = 2 * batch * visible * hkv * d * kp.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + bt.numel() * 4
    res = dict(kernel="decode", batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d,
               kv="fp8" if fp8 else "bf16", splits=launch.num_splits, window=window,
               softcap=softcap, rel_err=err, bound=ATTN_BOUND[q_dtype],
               ok=err <= ATTN_BOUND[q_dtype], ms=ms, gbps=io_bytes / ms / 1e6)
    if sdpa and window is None and softcap is None:
        del kp, vp
        kd = torch.randn(batch, hkv, ctx, d, dtype=torch.bfloat16, device=device)
        vd = torch.randn_like(kd)
        qd = q.to(torch.bfloat16).view(batch, hq, 1, d)
        ms_sdpa = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
        res.update(sdpa_bf16_ms=ms_sdpa, sdpa_gbps=2 * kd.numel() * 2 / ms_sdpa / 1e6)
    return res


def prefill_case(timer, device, batch, chunk, prefix, hq, hkv, d, fp8=True,
                 q_dtype=torch.bfloat16, window=None, sdpa=True) -> dict:
    from .triton_paged_attention import plan_paged_attention

    kp, vp, bt, ks, vs = _paged([prefix + chunk] * batch, hkv, d, 16, fp8, device)
    q = torch.randn(batch * chunk, hq, d, device=device).to(q_dtype)
    qsl = torch.arange(batch + 1, device=device) * chunk
    seq = torch.full((batch,), prefix + chunk, device=device)
    args = (q, kp, vp, bt, qsl, seq, ks, vs, d ** -0.5)
    launch = plan_paged_attention(*args, window)
    out = torch.full_like(q, float("nan"))
    launch.run(out)
    err = max(_sample_error(args, out, sorted({0, batch - 1}), 0, 16, window, None),
              _sample_error(args, out, [batch - 1], chunk, 16, window, None))
    ms = timer(lambda: launch.run(out))
    pos = torch.arange(prefix, prefix + chunk, dtype=torch.float64) + 1  # keys seen per row
    if window is not None:
        pos = pos.clamp(max=window)
    flops = 4 * batch * hq * d * float(pos.sum())
    res = dict(kernel="prefill", batch=batch, chunk=chunk, prefix=prefix, hq=hq, hkv=hkv, d=d,
               kv="fp8" if fp8 else "bf16", window=window, rel_err=err,
               bound=ATTN_BOUND[q_dtype], ok=err <= ATTN_BOUND[q_dtype], ms=ms,
               tflops=flops / ms / 1e9)
    if sdpa and prefix == 0 and window is None:
        qd = q.to(torch.bfloat16).view(batch, chunk, hq, d).transpose(1, 2)
        kd = torch.randn(batch, hkv, chunk, d, dtype=torch.bfloat16, device=device)
        vd = torch.randn_like(kd)
        ms_sdpa = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                               enable_gqa=True))
        res.update(sdpa_bf16_ms=ms_sdpa, sdpa_tflops=flops / ms_sdpa / 1e9)
    return res


def store_case(timer, device, tokens, hkv, d) -> dict:
    from .triton_kv_store import launch_store_kv, store_kv_triton

    bs = 16
    num_blocks = 2 * -(-tokens // bs)
    kp = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.uint8, device=device)
    vp = torch.zeros_like(kp)
    slots = torch.randperm(num_blocks * bs)[:tokens]  # host, as the engine builds it
    k = torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device=device) * 3
    v = torch.randn_like(k) * 3
    ks = torch.rand(hkv, device=device) * 0.01 + 0.005
    vs = torch.rand(1, device=device) * 0.01 + 0.005
    store_kv_triton(k, v, kp, vp, slots, ks, vs)
    sample = torch.randperm(tokens)[:256]  # exact bytes on a sample of tokens (host loop)
    kr = torch.zeros(tokens, 1, hkv, d, dtype=torch.uint8)
    vr = torch.zeros_like(kr)
    store_kv_reference(k[sample].cpu(), v[sample].cpu(), kr, vr, torch.arange(sample.numel()),
                       ks.cpu(), vs.cpu())
    got_k = kp.view(-1, hkv, d)[slots[sample].to(device)].cpu()
    got_v = vp.view(-1, hkv, d)[slots[sample].to(device)].cpu()
    n = sample.numel()
    ok = torch.equal(got_k, kr[:n, 0]) and torch.equal(got_v, vr[:n, 0])
    slots_d, vs_h = slots.to(device), vs.expand(hkv).contiguous()
    ms = timer(lambda: launch_store_kv(k, v, kp, vp, slots_d, ks, vs_h))
    ms_op = timer(lambda: store_kv_triton(k, v, kp, vp, slots, ks, vs))
    io_bytes = 2 * k.numel() * (2 + 1) + slots.numel() * 8
    return dict(kernel="store_kv", tokens=tokens, hkv=hkv, d=d, exact_bytes=ok, ok=ok, ms=ms,
                gbps=io_bytes / ms / 1e6, ms_with_validation=ms_op)


def gemm_case(timer, device, m, n, k, bias=False) -> dict:
    from .triton_fp8_gemm import fp8_gemm, fp8_linear_triton

    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, k, device=device)
    ws = (w.abs().amax(1, keepdim=True) / 448).float()  # [n, 1]
    wq = quantize_fp8(w, ws)
    del w
    s_in = (x.float().abs().max() / 448).view(1)
    b = torch.randn(n, dtype=torch.bfloat16, device=device) if bias else None
    y = fp8_linear_triton(x, wq, ws, s_in, b)
    rows = min(m, 8)
    ref = fp8_linear_reference(x[:rows].cpu(), wq.cpu(), ws.cpu(), s_in.cpu(),
                               None if b is None else b.cpu())
    err = (y[:rows].cpu().double() - ref).abs()
    excess = float((err - (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max())
    x_q = quantize_fp8(x, s_in.view(()))
    ms = timer(lambda: fp8_gemm(x_q, wq, ws, s_in, b, torch.bfloat16))
    ms_op = timer(lambda: fp8_linear_triton(x, wq, ws, s_in, b))
    res = dict(kernel="fp8_gemm", m=m, n=n, k=k, bound_excess=excess, ok=excess <= 0, ms=ms,
               ms_with_input_quant=ms_op, tflops=2 * m * n * k / ms / 1e9)
    try:  # cuBLASLt FP8 with row-wise scales: the same math
        sa = s_in.expand(m, 1).contiguous()
        sb = ws.view(1, n).contiguous()
        ms_ref = timer(lambda: torch._scaled_mm(x_q, wq.t(), scale_a=sa, scale_b=sb, bias=b,
                                                out_dtype=torch.bfloat16))
        res.update(scaled_mm_ms=ms_ref, vs_scaled_mm=ms_ref / ms)
    except Exception as exc:  # older GPUs / builds without row-wise scaling
        res.update(scaled_mm_error=f"{type(exc).__name__}: {exc}"[:200])
    return res


def mla_decode_case(timer, device, lens, heads, rank=512, rope=64, fp8=True,
                    q_dtype=torch.bfloat16, num_splits=None, block_size=16) -> dict:
    """MLA decode (absorbed, DeepSeek-V2/V3: kernels/mla_decode.py) over one layer's paged
    latent pool [num_blocks, block_size, 1, rank + rope] holding sequences of `lens`
    tokens (shuffled blocks). Error: the first and last sequence, all heads, vs the float64
    reference on the host. Times: the kernel launch on validated inputs, and the torch
    path (one gather + matmuls per sequence, with its host-side checks)."""
    from .mla_decode import mla_decode, mla_decode_reference
    from .triton_mla_decode import (launch_mla_decode, mla_decode_triton, mla_num_splits,
                                    split_layout)

    d, batch = rank + rope, len(lens)
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(need), device=device).to(torch.int32)
    bt = torch.zeros(batch, max(need), dtype=torch.int32, device=device)
    starts = [0]
    for b, n in enumerate(need):
        bt[b, :n] = perm[starts[b]:starts[b] + n]
        starts.append(starts[b] + n)
    x = torch.randn(sum(need), block_size, 1, d, dtype=torch.bfloat16, device=device)
    if fp8:
        scale = (torch.rand(1, device=device) * 0.004 + 0.008).float()  # ~4 sigma at 448
        pool = quantize_fp8(x, scale)
    else:
        pool, scale = x, None
    del x
    q = torch.randn(batch, heads, d, device=device).to(q_dtype)
    seq = torch.tensor(lens, dtype=torch.int64, device=device)
    softmax_scale = (128 + rope) ** -0.5  # DeepSeek-V3: qk_nope_head_dim 128 + rope 64
    args = (q, pool, scale, bt, seq, rank, softmax_scale)
    out = torch.full((batch, heads, rank), float("nan"), dtype=q_dtype, device=device)
    mla_decode_triton(*args, num_splits=num_splits, out=out)
    err = 0.0
    for b in sorted({0, batch - 1}):
        blocks = bt[b, :need[b]].long()
        sub = (q[b:b + 1].cpu(), pool[blocks].cpu(), None if scale is None else scale.cpu(),
               torch.arange(need[b], dtype=torch.int32)[None], seq[b:b + 1].cpu(), rank,
               softmax_scale)
        ref = mla_decode_reference(*sub)
        got = out[b:b + 1].cpu().double()
        err = max(err, float((got - ref).abs().max() / ref.abs().max()))
    max_len = max(lens)
    splits, _ = split_layout(max_len, num_splits or mla_num_splits(batch, heads, max_len, device))
    kv = pool.view(torch.uint8) if fp8 else pool
    v_scale = scale if fp8 else torch.ones(1, device=device)
    qk_scale = v_scale * softmax_scale
    seq32 = seq.to(torch.int32)
    ms = timer(lambda: launch_mla_decode(q, kv, qk_scale, v_scale, bt, seq32, rank, out,
                                         splits, max_len))
    ms_torch = timer(lambda: mla_decode(*args, backend="torch"))
    io_bytes = (sum(lens) * d * pool.element_size() + q.numel() * q.element_size()
                + out.numel() * out.element_size() + bt.numel() * 4)
    bound = ATTN_BOUND[q_dtype]
    return dict(kernel="mla_decode", batch=batch, max_len=max_len, tokens=sum(lens),
                heads=heads, rank=rank, rope=rope, kv="fp8" if fp8 else "bf16", splits=splits,
                rel_err=err, bound=bound, ok=err <= bound, ms=ms, gbps=io_bytes / ms / 1e6,
                torch_ms=ms_torch, vs_torch=ms_torch / ms)
