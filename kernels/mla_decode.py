"""MLA decode (multi-head latent attention, DeepSeek-V2/V3) over a paged latent KV cache.

With the up-projections absorbed, MLA decode is multi-query attention over the latent:
every head of a sequence attends to the same cached vectors, and the values are the first
kv_lora_rank dims of those same vectors (there is no separate V pool).

Shapes and dtypes (R = kv_lora_rank, P = qk_rope_head_dim, D = R + P):
  q             [B, H, D]  float32 / bfloat16 / float16, one decode token per sequence,
                already absorbed: q[..., :R] = q_nope @ W_UK, q[..., R:] = roped q_pe.
  latent_pool   [num_blocks, block_size, 1, D] one layer's cache; per token the latent
                c_kv (R values) then the roped key k_pe (P values). float8_e4m3fn (or
                uint8 holding its bytes) with latent_scale, or bfloat16/float16/float32.
  latent_scale  float32 [1] per-layer scale of an FP8 pool (real = fp8 * scale); None
                for a float pool.
  block_tables  [B, W] int32/int64: sequence b's physical blocks in logical order; entries
                past ceil(seq_lens[b] / block_size) are never read (may be -1).
  seq_lens      [B] integer: context tokens including the current one (already stored);
                1 <= seq_lens[b] <= W * block_size.
  result        [B, H, R] in q's dtype (the float64 reference returns float64):
      out[b, h] = softmax_j(softmax_scale * q[b, h] . K[b, j]) @ K[b, j, :R],  j < seq_lens[b]
  with K[b, j] the dequantized pool row of token j of sequence b.

`mla_decode` dispatches (kernels/dispatch.backend_for: the `backend` argument, else
QSERVE_KERNELS, else Triton for CUDA tensors and torch elsewhere) to the Triton kernel
(kernels/triton_mla_decode.py) or to the torch path here: per sequence, gather its rows,
convert to fp32, one [H, D] x [D, L] matmul for all heads, softmax, [H, L] x [L, R].
As in kernels/paged_attention.py the FP8 scale is applied to the scores (with the
softmax scale) and to the output rather than to every cached value, which is the same
math. `mla_decode_reference` is the float64 oracle (token-by-token gather, dense softmax).
"""

from __future__ import annotations

import math

import torch

from .kv_store import FLOAT_POOL_DTYPES, as_fp8_view, check_scale, is_fp8_pool
from .paged_attention import gather_context

Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- checks


def check_mla_shapes(q, latent_pool, latent_scale, block_tables, seq_lens, kv_lora_rank,
                     softmax_scale) -> tuple[bool, torch.Tensor | None]:
    """Shape/dtype checks (no tensor values read). Returns (fp8 pool, scale as fp32 [1])."""
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or kv_lora_rank < 1:
        raise ValueError(f"kv_lora_rank must be a positive int, got {kv_lora_rank!r}.")
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale!r}.")
    if latent_pool.dim() != 4 or latent_pool.shape[2] != 1:
        raise ValueError(f"latent_pool must be [num_blocks, block_size, 1, kv_lora_rank + "
                         f"rope_dim], got shape {list(latent_pool.shape)}.")
    fp8 = is_fp8_pool(latent_pool)
    if not (fp8 or latent_pool.dtype in FLOAT_POOL_DTYPES):
        raise ValueError(f"latent_pool has dtype {latent_pool.dtype}; expected float8_e4m3fn "
                         f"(or uint8 holding FP8 bytes), bfloat16, float16 or float32.")
    if not latent_pool.is_contiguous():
        raise ValueError("latent_pool must be contiguous (a preallocated cache pool).")
    d = latent_pool.shape[3]
    if kv_lora_rank > d:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} exceeds the pool's row width {d} "
                         f"(kv_lora_rank + rope_dim).")
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [batch, num_heads, {d}] (the pool's row width), got "
                         f"{list(q.shape)}.")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}.")
    b = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [{b}, max_blocks] (one row per sequence of q), "
                         f"got {list(block_tables.shape)}.")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}.")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != b:
        raise ValueError(f"seq_lens must be [{b}] (one length per sequence of q), got "
                         f"{list(seq_lens.shape)}.")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}.")
    scale = check_scale("latent_scale", latent_scale, fp8, 1)  # fp32 [1] or None
    return fp8, scale


def check_mla_values(block_tables, seq_lens, num_blocks: int, block_size: int) -> torch.Tensor:
    """Lengths and the block ids they read, on host copies. Returns seq_lens [B] int64 (host)."""
    seq = seq_lens.cpu().to(torch.int64)
    width = block_tables.shape[1]
    if seq.numel() and (int(seq.min()) < 1 or int(seq.max()) > width * block_size):
        raise ValueError(f"seq_lens must be in [1, {width * block_size}] (they include the "
                         f"current token; block_tables has {width} blocks of {block_size}), "
                         f"got {seq.tolist()}.")
    need = (seq + block_size - 1) // block_size  # [B] blocks read per sequence
    used = torch.arange(width)[None, :] < need[:, None]  # [B, W]
    ids = block_tables.cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables: the blocks the sequences read must be in "
                         f"[0, {num_blocks}), got ids from {int(ids.min())} to "
                         f"{int(ids.max())}.")
    return seq


# ----------------------------------------------------------------------------- torch path


def _mla_decode_torch(q, pool, scale, block_tables, seq, kv_lora_rank, softmax_scale,
                      out) -> torch.Tensor:
    """fp32 math on q's device. pool [N, bs, 1, D] (fp8 view or float); scale fp32 [1] or
    None; seq [B] int64 host. Writes and returns out [B, H, R] (q's dtype)."""
    bs, d = pool.shape[1], pool.shape[3]
    rows = pool.view(-1, d)  # [num_blocks * bs, D]: slot = block * bs + offset
    s_val = scale.to(q.device) if scale is not None else None  # [1] fp32
    qk_scale = softmax_scale * (s_val if s_val is not None else 1.0)
    offsets = torch.arange(bs, device=q.device)
    bt = block_tables.to(q.device, torch.int64)
    for b, length in enumerate(seq.tolist()):
        nblk = -(-length // bs)
        slots = (bt[b, :nblk, None] * bs + offsets).flatten()[:length]  # [L]
        k = rows[slots].to(torch.float32)  # [L, D] fp8 values (or pool values)
        scores = (q[b].to(torch.float32) @ k.t()) * qk_scale  # [H, L]
        probs = torch.softmax(scores, dim=-1)
        res = probs @ k[:, :kv_lora_rank]  # [H, R]
        if s_val is not None:
            res = res * s_val
        out[b] = res.to(out.dtype)
    return out


def mla_decode(
    q: torch.Tensor,  # [B, H, R + P] fp32 / bf16 / fp16
    latent_pool: torch.Tensor,  # [num_blocks, block_size, 1, R + P] fp8 (or uint8) / float
    latent_scale: torch.Tensor | None,  # fp32 [1] for an FP8 pool, None otherwise
    block_tables: torch.Tensor,  # [B, W] int32/int64
    seq_lens: torch.Tensor,  # [B] context incl. the current token (already stored)
    kv_lora_rank: int,  # R
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, H, R] dtype of q, written in place if given
    num_splits: int | None = None,  # Triton path: context splits (None: chosen)
    backend: str | None = None,  # "torch" / "triton" / "auto" (kernels/dispatch.py)
) -> torch.Tensor:  # [B, H, R], dtype of q
    """Absorbed MLA decode: softmax(scale * q K^T) K[:, :R] per sequence and head. Pure."""
    from .dispatch import backend_for

    if backend_for(q.device, backend) == "triton":
        from .triton_mla_decode import mla_decode_triton

        return mla_decode_triton(q, latent_pool, latent_scale, block_tables, seq_lens,
                                 kv_lora_rank, softmax_scale, num_splits=num_splits, out=out)
    fp8, scale = check_mla_shapes(q, latent_pool, latent_scale, block_tables, seq_lens,
                                  kv_lora_rank, softmax_scale)
    if not (q.device == latent_pool.device == block_tables.device):
        raise ValueError(f"q ({q.device}), latent_pool ({latent_pool.device}) and block_tables "
                         f"({block_tables.device}) must be on one device.")
    out = _check_out(out, q, kv_lora_rank)
    seq = check_mla_values(block_tables, seq_lens, latent_pool.shape[0], latent_pool.shape[1])
    pool = as_fp8_view(latent_pool) if fp8 else latent_pool
    return _mla_decode_torch(q, pool, scale, block_tables, seq, kv_lora_rank,
                             float(softmax_scale), out)


def _check_out(out, q, kv_lora_rank) -> torch.Tensor:
    """out [B, H, R] of q's dtype and device (allocated when None)."""
    shape = (q.shape[0], q.shape[1], kv_lora_rank)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {list(shape)} {q.dtype} on {q.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}.")
    if out.stride(2) != 1:
        raise ValueError(f"out needs a contiguous last dim (strides {out.stride()}).")
    return out


# ----------------------------------------------------------------------------- reference


def mla_decode_reference(q, latent_pool, latent_scale, block_tables, seq_lens, kv_lora_rank,
                         softmax_scale) -> torch.Tensor:
    """float64 [B, H, R] on the host: each context gathered token by token and dequantized
    (kernels/paged_attention.gather_context), dense softmax, values = the first R dims."""
    check_mla_shapes(q, latent_pool, latent_scale, block_tables, seq_lens, kv_lora_rank,
                     softmax_scale)
    b, h, _ = q.shape
    out = torch.empty(b, h, kv_lora_rank, dtype=torch.float64)
    scale = None if latent_scale is None else latent_scale.cpu()
    pool, bt = latent_pool.cpu(), block_tables.cpu()
    for i, length in enumerate(seq_lens.cpu().tolist()):
        k = gather_context(pool, bt[i], length, scale)[:, 0]  # [L, D] float64
        scores = q[i].cpu().to(torch.float64) @ k.t() * softmax_scale  # [H, L]
        out[i] = torch.softmax(scores, dim=-1) @ k[:, :kv_lora_rank]
    return out


__all__ = ["mla_decode", "mla_decode_reference", "check_mla_shapes", "check_mla_values"]
