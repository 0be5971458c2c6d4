"""Prefill / extend attention over the paged KV cache, in Triton.

A sequence brings query_len new tokens (already stored in the cache) at positions
seq_len - query_len .. seq_len - 1; each attends causally to the cached prefix (earlier
chunks of a chunked prefill, or blocks shared through a prefix-cache hit) and to the new
tokens before it, optionally within a sliding window and with a tanh soft-cap. One
program per (BLOCK_M new tokens, sequence, query head) walks only the keys some row of
its tile can see, BLOCK_N at a time through the block table, with an online softmax: the
[query_len, seq_len] score matrix never exists.

Rows of a tile may see no key of a given key tile (window edges): their running max is
guarded so exp() never sees -inf - -inf. Every real row sees at least itself, so its
final denominator is positive. Matmul precision as in triton_decode_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_numerics import dot_precisions, dot_pv, load_f32, out_bits_view, soft_cap, store_out


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, Hq, D]
    k_ptr, v_ptr,  # pools [num_blocks, BS, HKV, D] contiguous (uint8 bytes when FP8)
    bt_ptr, stride_bt, stride_bc,  # block tables [B, max_blocks] int32, any strides
    seq_ptr, qsl_ptr,  # [B] int32, [B + 1] int32
    qk_scale_ptr, v_scale_ptr,  # [HKV] fp32
    out_ptr, stride_ot, stride_oh,  # [T, Hq, D] (int16 bits when OUT_BF16)
    window, cap, min_query_len,
    G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    OUT_BF16: tl.constexpr, QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // G
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_ptr + b)
    first = mb * BLOCK_M  # first new token of this tile
    if (q_len >= min_query_len) & (first < q_len):
        r = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
        rmask = r < q_len
        q_pos = seq_len - q_len + r  # absolute positions
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        qmask = rmask[:, None] & dmask[None, :]
        q_off = (q_start + r)[:, None] * stride_qt + hq * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=qmask, other=0.0).to(tl.float32)
        qk_scale = tl.load(qk_scale_ptr + h)  # applied to the scores: q stays exact in tf32

        last_pos = seq_len - q_len + tl.minimum(first + BLOCK_M, q_len) - 1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(seq_len - q_len + first - window + 1, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, last_pos + 1, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            kmask = k_pos <= last_pos
            blk = tl.load(bt_ptr + b * stride_bt + (k_pos // BS) * stride_bc, mask=kmask,
                          other=0)
            base = (blk.to(tl.int64) * BS + k_pos % BS) * (HKV * D) + h * D
            kv_off = base[:, None] + d[None, :]
            kv_mask = kmask[:, None] & dmask[None, :]
            k = load_f32(k_ptr + kv_off, kv_mask, FP8)  # [BLOCK_N, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * qk_scale  # [M, N]
            if HAS_CAP:
                s = soft_cap(s, cap)
            visible = (k_pos[None, :] <= q_pos[:, None]) & kmask[None, :]
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # row sees nothing yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = load_f32(v_ptr + kv_off, kv_mask, FP8)
            acc = acc * alpha[:, None] + dot_pv(p, v, PV_PRECISION)
            den = den * alpha + tl.sum(p, 1)
            m = m_new

        den = tl.where(den > 0, den, 1.0)  # padding rows past q_len may see nothing
        res = acc / den[:, None] * tl.load(v_scale_ptr + h)
        o_off = (q_start + r)[:, None] * stride_ot + hq * stride_oh + d[None, :]
        store_out(out_ptr + o_off, res, qmask, OUT_BF16)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], stride(2) == 1
    k_pool: torch.Tensor,  # [num_blocks, BS, Hkv, D] uint8 (FP8 bytes) or bf16/fp16/fp32
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, any strides
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    qk_scale: torch.Tensor,  # [Hkv] fp32
    v_scale: torch.Tensor,  # [Hkv] fp32
    window: int | None,
    softcap: float | None,
    out: torch.Tensor,  # [T, Hq, D] dtype of q
    max_query_len: int,
    min_query_len: int = 1,  # sequences with fewer new tokens are left to another kernel
) -> None:
    """Launch on already validated inputs (kernels/triton_paged_attention.py checks them)."""
    _, bs, hkv, d = k_pool.shape
    hq = q.shape[1]
    b = seq_lens.shape[0]
    if max_query_len == 0 or b == 0:
        return
    # fp32 q and acc tiles of [64, D] live in registers: more warps for wider heads
    block_m, block_n, warps = (64, 64, 4) if d <= 64 else (64, 64, 8) if d <= 128 else (64, 32, 8)
    out_k, out_bf16 = out_bits_view(out)
    qk_precision, pv_precision = dot_precisions(q.dtype)
    grid = (triton.cdiv(max_query_len, block_m), b, hq)
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1), k_pool, v_pool,
        block_tables, block_tables.stride(0), block_tables.stride(1),
        seq_lens, query_start_loc, qk_scale, v_scale, out_k, out.stride(0), out.stride(1),
        window or 0, float(softcap or 1.0), min_query_len,
        G=hq // hkv, HKV=hkv, D=d, BS=bs, BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n,
        FP8=k_pool.dtype == torch.uint8, HAS_WINDOW=window is not None,
        HAS_CAP=softcap is not None, OUT_BF16=out_bf16,
        QK_PRECISION=qk_precision, PV_PRECISION=pv_precision, num_warps=warps)
