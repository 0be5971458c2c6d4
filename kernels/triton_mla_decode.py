"""MLA decode over a paged latent cache, in Triton (the contract: kernels/mla_decode.py).

One program per (sequence, block of BLOCK_H heads, split of the context). All heads of a
sequence read the same latent rows, so each tile of BLOCK_N cached tokens is loaded once
(c_kv as [BLOCK_N, R], k_pe as [BLOCK_N, P]), converted to fp32 in registers (FP8 bytes
via float8e4nv, as kernels/triton_numerics.load_f32 does) and used by the whole block of
heads twice: for the scores q_nope @ c^T + q_pe @ k_pe^T and, as the values, for p @ c.
Online softmax in fp32. The FP8 scale is applied as in triton_decode_attention.py: times
the softmax scale on the scores, and once on the output (exact math; q stays exact in
tf32). BLOCK_H, BLOCK_N, BLOCK_R and BLOCK_P are >= 16 (tl.dot's minimum); padded heads
and dims are masked.

Split-K (Flash-Decoding): with NUM_SPLITS > 1 each program covers split_len tokens and
writes an unnormalised partial (acc, max, sum); `_mla_reduce_kernel` merges them per
(sequence, head). The split count follows kernels/triton_paged_attention.choose_num_splits,
with the head blocks in place of the kv heads: few sequences leave most SMs idle.

Matmuls: fp32 tiles; precisions from triton_numerics.dot_precisions (fp32 q: "ieee";
bf16/fp16 q: tf32 for the scores, exact since q and every E4M3/bf16 value fit tf32, and
"tf32x2" for p @ c). An fp32 pool always takes "ieee" (its values are not exact in tf32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla_decode import _check_out, check_mla_shapes, check_mla_values
from .triton_numerics import (check_kernel_device, dot_precisions, dot_pv, load_f32,
                              out_bits_view, store_out)
from .triton_paged_attention import MAX_SPLITS, _num_sms, choose_num_splits

BLOCK_H = 16  # heads per program (tl.dot needs M >= 16; H < 16 is masked)
BLOCK_N = 16  # cached tokens per tile (one 16-token block of the pool)


@triton.jit
def _mla_decode_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, H, D], stride(2) == 1
    kv_ptr,  # latent pool [num_blocks, BS, 1, D] contiguous (uint8 bytes when FP8)
    bt_ptr, stride_bt, stride_bc,  # block tables [B, W] int32/int64, any strides
    seq_ptr,  # [B] int32 context lengths (>= 1)
    qk_scale_ptr, v_scale_ptr,  # [1] fp32: pool scale * softmax scale, pool scale (1)
    out_ptr, stride_ob, stride_oh,  # out [B, H, R] (int16 bits when OUT_BF16)
    part_ptr, ml_ptr,  # [B, H, NUM_SPLITS, R] fp32, [B, H, NUM_SPLITS, 2] fp32 (max, sum)
    split_len,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, NUM_SPLITS: tl.constexpr,
    OUT_BF16: tl.constexpr, QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_ptr + b)
    lo = split * split_len
    hi = tl.minimum(seq_len, lo + split_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    hmask = heads < H
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    pe = tl.arange(0, BLOCK_P)
    pemask = pe < P
    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh  # [BLOCK_H, 1]
    q_nope = tl.load(q_row + r[None, :], mask=hmask[:, None] & rmask[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_row + R + pe[None, :], mask=hmask[:, None] & pemask[None, :],
                   other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_P]
    qk_scale = tl.load(qk_scale_ptr)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):  # every tile holds >= 1 context token (n0 < hi)
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical positions
        nmask = pos < hi
        blk = tl.load(bt_ptr + b * stride_bt + (pos // BS) * stride_bc, mask=nmask, other=0)
        row = (blk.to(tl.int64) * BS + pos % BS) * (R + P)  # [BLOCK_N] offset of each row
        # the tile, loaded once for all BLOCK_H heads: latent [N, R] and rope key [N, P]
        c = load_f32(kv_ptr + row[:, None] + r[None, :], nmask[:, None] & rmask[None, :], FP8)
        k_pe = load_f32(kv_ptr + row[:, None] + R + pe[None, :],
                        nmask[:, None] & pemask[None, :], FP8)
        s = (tl.dot(q_nope, tl.trans(c), input_precision=QK_PRECISION)
             + tl.dot(q_pe, tl.trans(k_pe), input_precision=QK_PRECISION)) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + dot_pv(p, c, PV_PRECISION)  # values: the same c tile
        den = den * alpha + tl.sum(p, 1)
        m = m_new

    omask = hmask[:, None] & rmask[None, :]
    if NUM_SPLITS == 1:
        res = acc / den[:, None] * tl.load(v_scale_ptr)
        o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + r[None, :]
        store_out(out_ptr + o_off, res, omask, OUT_BF16)
    else:
        part = (b.to(tl.int64) * H + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_ptr + part[:, None] * R + r[None, :], acc, mask=omask)
        tl.store(ml_ptr + part * 2, m, mask=hmask)
        tl.store(ml_ptr + part * 2 + 1, den, mask=hmask)


@triton.jit
def _mla_reduce_kernel(
    part_ptr, ml_ptr,  # [B, H, NUM_SPLITS, R] fp32, [B, H, NUM_SPLITS, 2] fp32 (max, sum)
    v_scale_ptr,  # [1] fp32
    out_ptr, stride_ob, stride_oh,  # out [B, H, R]
    H: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, OUT_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b.to(tl.int64) * H + h) * NUM_SPLITS  # first partial of (b, h)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < NUM_SPLITS
    m = tl.load(ml_ptr + (base + sp) * 2, mask=smask, other=float("-inf"))  # [BLOCK_S]
    m_all = tl.max(m, 0)  # finite: the first split holds token 0 of every sequence
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    w = tl.exp(m - m_all)  # [BLOCK_S]; empty (max -inf) and padded splits weigh 0
    den = tl.sum(tl.load(ml_ptr + (base + sp) * 2 + 1, mask=smask, other=0.0) * w, 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s in range(NUM_SPLITS):  # one [R] row at a time (R = 512: no [S, R] tile)
        w_s = tl.exp(tl.load(ml_ptr + (base + s) * 2) - m_all)
        acc += tl.load(part_ptr + (base + s) * R + r, mask=rmask, other=0.0) * w_s
    res = acc / den * tl.load(v_scale_ptr)
    store_out(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + r, res, rmask, OUT_BF16)


def mla_num_splits(batch: int, heads: int, max_len: int, device: torch.device) -> int:
    """Context splits for a launch: ~2 programs per SM, splits >= MIN_SPLIT_TOKENS."""
    return choose_num_splits(batch, triton.cdiv(heads, BLOCK_H), max_len, _num_sms(device))


def split_layout(max_len: int, num_splits: int) -> tuple[int, int]:
    """(splits launched, tokens per split): splits of whole BLOCK_N tiles; a requested
    count that would leave trailing splits empty for every sequence is reduced."""
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), BLOCK_N) * BLOCK_N
    return triton.cdiv(max(max_len, 1), split_len), split_len


def launch_mla_decode(
    q: torch.Tensor,  # [B, H, D] fp32/bf16/fp16, stride(2) == 1
    pool: torch.Tensor,  # [num_blocks, BS, 1, D] uint8 (FP8 bytes) or bf16/fp16/fp32
    qk_scale: torch.Tensor,  # [1] fp32 on q's device: pool scale (1 if float) * softmax scale
    v_scale: torch.Tensor,  # [1] fp32: pool scale (1 if float)
    block_tables: torch.Tensor,  # [B, W] int32/int64, any strides
    seq_lens: torch.Tensor,  # [B] int32 on q's device, each in [1, W * BS]
    kv_lora_rank: int,
    out: torch.Tensor,  # [B, H, R] dtype of q, stride(2) == 1
    num_splits: int,
    max_len: int,  # max(seq_lens): sizes the splits
) -> torch.Tensor:
    """Launch on already validated inputs (mla_decode_triton checks them); returns out."""
    b, h, d = q.shape
    if b == 0 or h == 0:
        return out
    bs = pool.shape[1]
    r, p = kv_lora_rank, d - kv_lora_rank
    fp8 = pool.dtype == torch.uint8
    num_splits, split_len = split_layout(max_len, num_splits)
    out_k, out_bf16 = out_bits_view(out)
    qk_prec, pv_prec = ("ieee", "ieee") if pool.dtype == torch.float32 else \
        dot_precisions(q.dtype)
    block_r = max(16, triton.next_power_of_2(r))
    if num_splits > 1:
        part = torch.empty(b, h, num_splits, r, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, h, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = qk_scale  # unused
    _mla_decode_kernel[(b, triton.cdiv(h, BLOCK_H), num_splits)](
        q, q.stride(0), q.stride(1), pool,
        block_tables, block_tables.stride(0), block_tables.stride(1), seq_lens,
        qk_scale, v_scale, out_k, out.stride(0), out.stride(1), part, ml, split_len,
        H=h, R=r, P=p, BS=bs, BLOCK_H=BLOCK_H, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_N=BLOCK_N, FP8=fp8,
        NUM_SPLITS=num_splits, OUT_BF16=out_bf16, QK_PRECISION=qk_prec,
        PV_PRECISION=pv_prec, num_warps=4)
    if num_splits > 1:
        _mla_reduce_kernel[(b, h)](
            part, ml, v_scale, out_k, out.stride(0), out.stride(1), H=h, R=r,
            BLOCK_R=block_r, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), OUT_BF16=out_bf16, num_warps=4)
    return out


def mla_decode_triton(
    q: torch.Tensor,  # [B, H, R + P] fp32 / bf16 / fp16
    latent_pool: torch.Tensor,  # [num_blocks, block_size, 1, R + P] fp8 (or uint8) / float
    latent_scale: torch.Tensor | None,  # fp32 [1] for an FP8 pool, None otherwise
    block_tables: torch.Tensor,  # [B, W] int32/int64
    seq_lens: torch.Tensor,  # [B] context incl. the current token
    kv_lora_rank: int,
    softmax_scale: float,
    *,
    num_splits: int | None = None,  # None: mla_num_splits
    out: torch.Tensor | None = None,  # [B, H, R] dtype of q
) -> torch.Tensor:  # [B, H, R], dtype of q
    """kernels/mla_decode.mla_decode's contract on the Triton kernels: validate (reads the
    small metadata on the host), then launch_mla_decode."""
    fp8, scale = check_mla_shapes(q, latent_pool, latent_scale, block_tables, seq_lens,
                                  kv_lora_rank, softmax_scale)
    device = check_kernel_device("mla_decode", q, latent_pool, block_tables, seq_lens)
    if q.stride(2) != 1:
        raise ValueError(f"q needs a contiguous last dim (strides {q.stride()}); pass "
                         f"q.contiguous().")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}] or None, got {num_splits}.")
    out = _check_out(out, q, kv_lora_rank)
    seq = check_mla_values(block_tables, seq_lens, latent_pool.shape[0], latent_pool.shape[1])
    max_len = int(seq.max()) if seq.numel() else 0
    if fp8:
        pool = latent_pool.view(torch.uint8)
        v_scale = scale.to(device)
        qk_scale = v_scale * float(softmax_scale)  # [1] fp32
    else:
        pool = latent_pool
        v_scale = torch.ones(1, dtype=torch.float32, device=device)
        qk_scale = torch.full((1,), float(softmax_scale), dtype=torch.float32, device=device)
    splits = num_splits or mla_num_splits(q.shape[0], q.shape[1], max_len, device)
    return launch_mla_decode(q, pool, qk_scale, v_scale, block_tables,
                             seq.to(device=device, dtype=torch.int32), kv_lora_rank, out,
                             splits, max_len)


__all__ = ["mla_decode_triton", "launch_mla_decode", "mla_num_splits", "split_layout",
           "BLOCK_H", "BLOCK_N"]
