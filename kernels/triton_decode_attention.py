"""Decode attention (one new token per sequence) over the paged KV cache, in Triton.

One program per (decode sequence, kv head, split): it holds the G = Hq / Hkv query heads
of that kv head as one [BLOCK_G, D] tile (GQA/MQA read each K/V byte once), walks its
range of the context BLOCK_N tokens at a time (each token's physical block looked up in
the block table), dequantizes FP8 bytes in registers (the k scale times the softmax
scale multiplies the scores, the v scale the output) and keeps an online softmax in fp32.

Split-KV (Flash-Decoding): with NUM_SPLITS > 1 each program covers split_len tokens of
the visible context and writes an unnormalised partial (acc, max, sum);
`_reduce_splits_kernel` merges the splits per query head. The caller picks the number
of splits (kernels/triton_paged_attention.py: when batch x kv heads is too small to fill
the device).

Matmuls: fp32 tiles. fp32 q: exact-fp32 dots ("ieee"). bf16/fp16 q: tf32 tensor-core
dots, exact for q @ k (q and every E4M3/bf16 K value are exact in tf32, so the scale is
applied to the scores, not to q) and, by default, split in two for p @ v (`dot_pv`,
"tf32x2"), so the result has fp32 accuracy up to the rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_numerics import dot_precisions, dot_pv, load_f32, out_bits_view, soft_cap, store_out


@triton.jit
def _decode_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, Hq, D]
    k_ptr, v_ptr,  # pools [num_blocks, BS, HKV, D] contiguous (uint8 bytes when FP8)
    bt_ptr, stride_bt, stride_bc,  # block tables [B, max_blocks] int32, any strides
    seq_ptr, qsl_ptr,  # [B] int32 context lengths, [B + 1] int32 query start rows
    dec_ptr,  # [num_decode] int32: sequence index of each program row
    qk_scale_ptr, v_scale_ptr,  # [HKV] fp32
    out_ptr, stride_ot, stride_oh,  # [T, Hq, D] (int16 bits when OUT_BF16)
    part_ptr, ml_ptr,  # [num_decode, Hq, NUM_SPLITS, D] fp32, [num_decode, Hq, NUM_SPLITS, 2]
    window, cap, split_len,
    G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr, OUT_BF16: tl.constexpr,
    QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(dec_ptr + i)
    row = tl.load(qsl_ptr + b)
    seq_len = tl.load(seq_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    lo = start + split * split_len
    hi = tl.minimum(seq_len, lo + split_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = (g < G)[:, None] & dmask[None, :]
    q_off = row * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=qmask, other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    qk_scale = tl.load(qk_scale_ptr + h)  # applied to the scores: q stays exact in tf32

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):  # every tile holds >= 1 visible key (n0 < hi)
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        blk = tl.load(bt_ptr + b * stride_bt + (pos // BS) * stride_bc, mask=pmask, other=0)
        base = (blk.to(tl.int64) * BS + pos % BS) * (HKV * D) + h * D  # [BLOCK_N]
        kv_off = base[:, None] + d[None, :]
        kv_mask = pmask[:, None] & dmask[None, :]
        k = load_f32(k_ptr + kv_off, kv_mask, FP8)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * qk_scale  # [G, N]
        if HAS_CAP:
            s = soft_cap(s, cap)
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = load_f32(v_ptr + kv_off, kv_mask, FP8)
        acc = acc * alpha[:, None] + dot_pv(p, v, PV_PRECISION)
        den = den * alpha + tl.sum(p, 1)
        m = m_new

    heads = h * G + g
    if NUM_SPLITS == 1:
        res = acc / den[:, None] * tl.load(v_scale_ptr + h)
        o_off = row * stride_ot + heads[:, None] * stride_oh + d[None, :]
        store_out(out_ptr + o_off, res, qmask, OUT_BF16)
    else:
        part = (i * (HKV * G) + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=qmask)
        gmask = g < G
        tl.store(ml_ptr + part * 2, m, mask=gmask)
        tl.store(ml_ptr + part * 2 + 1, den, mask=gmask)


@triton.jit
def _reduce_splits_kernel(
    part_ptr, ml_ptr,  # [num_decode, Hq, NUM_SPLITS, D] fp32, [..., 2] fp32 (max, sum)
    dec_ptr, qsl_ptr, v_scale_ptr,
    out_ptr, stride_ot, stride_oh,
    G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, OUT_BF16: tl.constexpr,
):
    i = tl.program_id(0)
    hq = tl.program_id(1)
    row = tl.load(qsl_ptr + tl.load(dec_ptr + i))
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    part = (i * HQ + hq) * NUM_SPLITS + sp  # [BLOCK_S]
    m = tl.load(ml_ptr + part * 2, mask=smask, other=float("-inf"))
    den = tl.load(ml_ptr + part * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, 0)  # finite: the first split always holds the newest token
    w = tl.exp(m - m_all)  # empty splits (max -inf) weigh 0
    acc = tl.load(part_ptr + part[:, None] * D + d[None, :],
                  mask=smask[:, None] & (d < D)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    res = tl.sum(acc * w[:, None], 0) / tl.sum(den * w, 0) * tl.load(v_scale_ptr + hq // G)
    store_out(out_ptr + row * stride_ot + hq * stride_oh + d, res, d < D, OUT_BF16)


def decode_attention(
    q: torch.Tensor,  # [T, Hq, D], stride(2) == 1
    k_pool: torch.Tensor,  # [num_blocks, BS, Hkv, D] uint8 (FP8 bytes) or bf16/fp16/fp32
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32 on q's device, any strides
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    decode_seqs: torch.Tensor,  # [num_decode] int32: sequences with exactly one new token
    qk_scale: torch.Tensor,  # [Hkv] fp32: k scale (1 for float pools) * softmax scale
    v_scale: torch.Tensor,  # [Hkv] fp32
    window: int | None,
    softcap: float | None,
    out: torch.Tensor,  # [T, Hq, D] dtype of q; rows of decode_seqs are written
    num_splits: int,
    split_len: int,
) -> None:
    """Launch on already validated inputs (kernels/triton_paged_attention.py checks them)."""
    num_dec = decode_seqs.shape[0]
    _, bs, hkv, d = k_pool.shape
    hq = q.shape[1]
    g = hq // hkv
    fp8 = k_pool.dtype == torch.uint8
    block_n = 64 if d <= 128 else 32
    if split_len % block_n:
        raise ValueError(f"split_len {split_len} must be a multiple of {block_n}.")
    out_k, out_bf16 = out_bits_view(out)
    qk_precision, pv_precision = dot_precisions(q.dtype)
    if num_splits > 1:
        part = torch.empty(num_dec, hq, num_splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_dec, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = qk_scale  # unused
    _decode_kernel[(num_dec, hkv, num_splits)](
        q, q.stride(0), q.stride(1), k_pool, v_pool,
        block_tables, block_tables.stride(0), block_tables.stride(1),
        seq_lens, query_start_loc, decode_seqs, qk_scale, v_scale,
        out_k, out.stride(0), out.stride(1), part, ml,
        window or 0, float(softcap or 1.0), split_len,
        G=g, HKV=hkv, D=d, BS=bs, BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, FP8=fp8,
        HAS_WINDOW=window is not None, HAS_CAP=softcap is not None, NUM_SPLITS=num_splits,
        OUT_BF16=out_bf16, QK_PRECISION=qk_precision, PV_PRECISION=pv_precision,
        num_warps=4)
    if num_splits > 1:
        _reduce_splits_kernel[(num_dec, hq)](
            part, ml, decode_seqs, query_start_loc, v_scale, out_k, out.stride(0),
            out.stride(1), G=g, HQ=hq, D=d, BLOCK_D=triton.next_power_of_2(d),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            OUT_BF16=out_bf16, num_warps=4)
