"""Paged attention for short queries (decodes, speculative verify chunks) in C, on CPU.

    out = native_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens,
                           qk_scale, v_scale, window, softcap, skip=None)   # fp32 [T, Hq, D]
    k = gather_context_native(k_pool, block_table_row, first, n, torch.bfloat16)  # [n, Hkv, D]

The kernel (csrc/paged_attention_cpu.c, built by native_build.py) reads each context
token's K/V rows (all kv heads together) once, converts them to fp32 and uses each for
every query row and query head of its GQA group; scores are fp32 and the softmax is exact. It
suits sequences with few new tokens: per key it does nq * g dot products without a matmul
kernel, so long prompt chunks stay with SDPA (kernels/paged_attention.py routes them).

Arguments are the torch path's after its checks: q [T, Hq, D] (any float dtype), FP8
pools viewed as float8_e4m3fn, or bf16 / fp32 pools [num_blocks, bs, Hkv, D], block_tables
[B, W] int64 of valid block ids, query_start_loc [B + 1] / seq_lens [B] int64,
qk_scale / v_scale fp32 [Hkv] (the FP8 scales folded with the q.k scale; ones and the
plain scale for bf16 pools), skip [B] bool: sequences whose rows are not computed (their
rows of the result are left unwritten: the caller fills them). Every row of q belongs to a
sequence.
"""

from __future__ import annotations

import ctypes

import torch

from .native_build import cached_library
from .native_call import keyword_calls

_LIB_NAME = "paged_attention_cpu"
POOL_KINDS = {torch.float8_e4m3fn: 0, torch.bfloat16: 1, torch.float32: 2}  # the C `kind`
Q_KINDS = {torch.bfloat16: 1, torch.float32: 2}  # q's C `q_kind` (same codes); else fp32
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the C `out_kind` of the gather

# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library(_LIB_NAME)


def _require_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native attention kernel is not available on this machine; "
                           "use another decode implementation.")
    return lib


@keyword_calls(_LIB_NAME)
def gather_context_native(pool: torch.Tensor, table: torch.Tensor, first: int, n: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """Tokens [first, first + n) of one sequence: pool [num_blocks, bs, Hkv, D] (E4M3 view,
    bf16 or fp32), table [>= blocks needed] int64 -> [n, Hkv, D] `dtype` (fp32 or bf16)."""
    lib = _require_library()
    _, bs, hkv, d = pool.shape
    if pool.dtype not in POOL_KINDS or dtype not in OUT_KINDS or not pool.is_contiguous():
        raise ValueError(f"gather_context_native reads contiguous {list(POOL_KINDS)} pools "
                         f"into {list(OUT_KINDS)}; got {pool.dtype} -> {dtype}.")
    table = table.to(torch.int64).contiguous()
    out = torch.empty(n, hkv, d, dtype=dtype)
    lib.qserve_gather_context(pool=pool.data_ptr(), kind=POOL_KINDS[pool.dtype], bs=bs,
                              hkv=hkv, d=d, table=table.data_ptr(), first=first, n=n,
                              out_kind=OUT_KINDS[dtype], out=out.data_ptr())
    return out


def native_available() -> bool:
    """True when the C kernel is built and loaded (builds it on first call)."""
    return _library() is not None


@keyword_calls(_LIB_NAME)
def native_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, qk_scale: torch.Tensor, v_scale: torch.Tensor,
                     window: int | None, softcap: float | None,
                     skip: torch.Tensor | None = None,
                     value_dim: int | None = None) -> torch.Tensor:
    """value_dim: accumulate only the values' first value_dim columns (a latent cache's
    c_kv, not its RoPE key); the output's other columns are 0. Default: all d."""
    lib = _require_library()
    t, hq, d = q.shape
    value_dim = d if value_dim is None else value_dim
    if not 1 <= value_dim <= d:
        raise ValueError(f"value_dim must be in [1, {d}] (the head size), got {value_dim}.")
    _, bs, hkv, _ = k_pool.shape
    if k_pool.dtype not in POOL_KINDS:
        raise ValueError(f"native attention reads {', '.join(map(str, POOL_KINDS))} pools, "
                         f"got {k_pool.dtype}.")
    kind = POOL_KINDS[k_pool.dtype]
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("native attention needs contiguous K/V pools.")
    b = seq_lens.shape[0]
    if q.dtype not in Q_KINDS:
        q = q.to(torch.float32)
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    qsl = query_start_loc.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    qks = qk_scale.to(torch.float32).contiguous()
    vs = v_scale.to(torch.float32).contiguous()
    skip_u8 = skip.to(torch.uint8).contiguous() if skip is not None else None
    out = torch.empty(t, hq, d, dtype=torch.float32)  # every row not skipped is written
    rc = lib.qserve_paged_attention_cpu(
        q=q.data_ptr(), q_kind=Q_KINDS[q.dtype], qk_scale=qks.data_ptr(), hq=hq, d=d,
        k_pool=k_pool.data_ptr(), v_pool=v_pool.data_ptr(), kind=kind, bs=bs, hkv=hkv,
        tables=tables.data_ptr(), table_stride=tables.shape[1], q_start=qsl.data_ptr(),
        seq_lens=lens.data_ptr(), skip=skip_u8.data_ptr() if skip_u8 is not None else None,
        num_seqs=b, window=int(window) if window is not None else 0,
        softcap=float(softcap) if softcap is not None else 0.0, v_scale=vs.data_ptr(),
        out=out.data_ptr(), num_threads=torch.get_num_threads(), dv=value_dim)
    if rc != 0:
        raise MemoryError("native attention could not allocate its score buffers.")
    return out


__all__ = ["POOL_KINDS", "gather_context_native", "native_attention", "native_available"]
