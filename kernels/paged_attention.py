"""Paged attention over an FP8 (or bf16) KV cache, torch path, with a float64 reference.

Each sequence b of a flat batch brings query_len new tokens (rows
query_start_loc[b]:query_start_loc[b+1] of q) whose K/V are already stored; its whole
context of seq_lens[b] tokens is read through block_tables[b] (logical block i -> physical
block). The new tokens are the last query_len positions: causal, optionally sliding-window
(key j visible to query i iff i - j < window) and tanh soft-capped. GQA: q head h reads kv
head h // (Hq // Hkv).

FP8 pools are dequantized as `fp8 * scale`; the scale is folded into q (k_scale) and into
the output (v_scale), which is exact math, so the hot loop only converts E4M3 -> float.

Execution on CPU (numbers: runtime/benchmark/attention.py):
- "native" (the default where a C compiler is available): one call of a C kernel
  (kernels/native_attention.py, csrc/paged_attention_cpu.c) for every sequence with at
  most NATIVE_MAX_QUERY_LEN new tokens (decodes and speculative verify chunks): each K/V
  row is converted from E4M3 (or bf16) once per kv head and used by all query rows and
  heads of the GQA group; fp32 scores, exact softmax. Longer prompt chunks go to the
  prefill path below. `python -m qserve.runtime.benchmark.attention` times it against
  the other implementations.
- Other decode implementations (`DECODE_IMPLS`) run the decode rows (query_len == 1) of
  the whole batch together in one call:
  * "compiled": the gather, the E4M3 -> fp32 conversion, q·k, the masked softmax and p·v
    written as elementwise math + reductions and compiled by inductor (torch.compile,
    dynamic batch and context), which fuses the dequant into the attention loops: the
    dequantized context is never materialised. The fallback when the native kernel cannot
    be built; needs a C++ compiler the first time a shape class is seen (compiled code is
    cached on disk by inductor).
  * "eager": gather, dequantize to bf16/fp32, scaled_dot_product_attention. The fallback
    when compile fails (logged once; QSERVE_REQUIRE_COMPILE=1 makes it an error).
  * "chunked": eager, blocks in chunks with an online softmax; bounds memory to a chunk.
- prefill chunks (query_len > 1; with "native", longer than NATIVE_MAX_QUERY_LEN) run per
  sequence (`PREFILL_IMPLS`, chosen by `default_prefill_impl`): the blocks in reach gathered
  and converted to fp32 in one C pass, then the C prefill kernel
  (kernels/native_prefill_attention.py: fp32 tiles, online softmax, causal and window
  masks); on AMX CPUs for bf16 queries, with a logit softcap, or where the kernel cannot be
  built, SDPA with an explicit causal/window mask in eager torch, in bf16 for bf16 queries.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .cpu_class import ENV_VAR as CPU_CLASS_ENV
from .cpu_class import cpu_class, cpu_flags
from .inductor import CompiledOrEager
from .kv_store import as_fp8_view, check_pools, check_scale, is_fp8_pool
from .native_attention import (POOL_KINDS, gather_context_native, native_attention,
                               native_available)
from .native_prefill_attention import native_prefill_attention, native_prefill_available
from .paged_plan import PagedStepPlan

_DEFAULT_CHUNK_BLOCKS = 16
# Sequences with at most this many new tokens take the native kernel (per key it does
# query_len * group dot products without a matmul kernel; SDPA wins on long chunks).
NATIVE_MAX_QUERY_LEN = 16


# ----------------------------------------------------------------------------- checks


def _check_tensors(q, k_pool, v_pool, k_scale, v_scale):
    """Per-call checks of q, the pools and the scales (no tensor values are read)."""
    num_blocks, block_size, hkv, d = check_pools(k_pool, v_pool)
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv != 0:
        raise ValueError(f"q must be [num_tokens, num_heads, {d}] with num_heads a multiple of "
                         f"the pools' {hkv} kv heads, got {list(q.shape)}.")
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point, got {q.dtype}.")
    fp8 = is_fp8_pool(k_pool)
    k_scale = check_scale("k_scale", k_scale, fp8, hkv)
    v_scale = check_scale("v_scale", v_scale, fp8, hkv)
    return num_blocks, block_size, k_scale, v_scale


# ------------------------------------------------------------------- decode implementations


def _decode_eager(q, k_pool, v_pool, bt, seq_lens, qk_scale, v_scale, window, softcap):
    """q [B, Hq, D]; bt [B, nb] valid ids; qk_scale/v_scale fp32 [Hkv]. -> [B, Hq, D] fp32.

    Gathers and dequantizes the whole padded context [B, nb*bs, Hkv, D], then SDPA.
    Masked slots get probability 0, so they must hold finite values (a KVCache does: its
    pools start zeroed and store_kv saturates); zeroing them here would cost a full pass.
    """
    b, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    g = hq // hkv
    compute = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    k = k_pool[bt].to(compute).flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_pool[bt].to(compute).flatten(1, 2).transpose(1, 2)
    length = k.shape[2]
    pos = torch.arange(length)
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    if window is not None:
        valid &= pos[None, :] > seq_lens[:, None] - 1 - window
    qs = (q.float().view(b, hkv, g, d) * qk_scale.view(1, hkv, 1, 1)).to(compute)
    if softcap is None:
        out = F.scaled_dot_product_attention(qs, k, v, attn_mask=valid[:, None, None, :],
                                             scale=1.0)  # [B, Hkv, G, D]
        out = out.float()
    else:
        s = torch.matmul(qs, k.transpose(-1, -2)).float()  # [B, Hkv, G, L]
        s = torch.tanh(s / softcap) * softcap
        p = torch.softmax(s.masked_fill(~valid[:, None, None, :], float("-inf")), -1)
        out = torch.matmul(p.to(compute), v).float()
    return (out * v_scale.view(1, hkv, 1, 1)).reshape(b, hq, d)


def _decode_chunked(q, k_pool, v_pool, bt, seq_lens, qk_scale, v_scale, window, softcap,
                    chunk_blocks: int = _DEFAULT_CHUNK_BLOCKS):
    """Like _decode_eager, but chunk_blocks blocks at a time with an online softmax."""
    b, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    g = hq // hkv
    compute = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    qs = (q.float().view(b, hkv, g, d) * qk_scale.view(1, hkv, 1, 1)).to(compute)
    m = torch.full((b, hkv, g, 1), float("-inf"))
    den = torch.zeros(b, hkv, g, 1)
    acc = torch.zeros(b, hkv, g, d)
    for c0 in range(0, bt.shape[1], chunk_blocks):
        cbt = bt[:, c0:c0 + chunk_blocks]
        k = k_pool[cbt].to(compute).flatten(1, 2).permute(0, 2, 3, 1)  # [B, Hkv, D, Lc]
        v = v_pool[cbt].to(compute).flatten(1, 2).transpose(1, 2)  # [B, Hkv, Lc, D]
        pos = c0 * bs + torch.arange(k.shape[-1])
        valid = pos[None, :] < seq_lens[:, None]  # [B, Lc]
        if window is not None:
            valid &= pos[None, :] > seq_lens[:, None] - 1 - window
        s = torch.matmul(qs, k).float()  # [B, Hkv, G, Lc]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # chunk with nothing visible
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        acc = acc * alpha + torch.matmul(p.to(compute), v).float()
        den = den * alpha + p.sum(-1, keepdim=True)
        m = m_new
    out = acc / den * v_scale.view(1, hkv, 1, 1)
    return out.reshape(b, hq, d)


def _decode_fused(q, k_pool, v_pool, bt, seq_lens, qk_scale, v_scale, window, softcap):
    """The decode math as elementwise ops + reductions, for inductor to fuse into loops
    that read each block's bytes, convert E4M3 -> fp32 in registers and accumulate.
    Same contract as _decode_eager."""
    b, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    g = hq // hkv
    nb = bt.shape[1]
    length = nb * bs
    k = k_pool[bt].view(b, length, hkv, 1, d).to(torch.float32)  # fused gather + convert
    v = v_pool[bt].view(b, length, hkv, 1, d).to(torch.float32)
    qs = q.to(torch.float32).view(b, 1, hkv, g, d) * qk_scale.view(1, 1, hkv, 1, 1)
    s = (qs * k).sum(-1)  # [B, L, Hkv, G]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(length)
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    if window is not None:
        valid = valid & (pos[None, :] > seq_lens[:, None] - 1 - window)
    valid = valid[:, :, None, None]
    s = torch.where(valid, s, float("-inf"))
    mx = s.amax(1, keepdim=True)  # [B, 1, Hkv, G]
    p = torch.exp(s - mx)
    den = p.sum(1)  # [B, Hkv, G]
    pv = torch.where(valid[..., None], p[..., None] * v, 0.0)  # padding may hold NaN bytes
    out = pv.sum(1) / den[..., None] * v_scale.view(1, hkv, 1, 1)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d)


# Batch, context and pool sizes vary step to step: one graph for all of them (sizes of 1 are
# specialised by dynamo, so a batch of one is a second graph). Without a compiler: eager.
_decode_compiled = CompiledOrEager(
    _decode_fused, "paged attention (decode)", dynamic=False,
    mark_dynamic=((0, 0), (3, 0), (3, 1), (4, 0), (1, 0), (2, 0)), fallback=_decode_eager)


def _decode_native(q, k_pool, v_pool, bt, seq_lens, qk_scale, v_scale, window, softcap):
    """The decode contract through the native kernel (one query row per sequence)."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int64)
    return native_attention(q, k_pool, v_pool, bt, qsl, seq_lens, qk_scale, v_scale, window,
                            softcap)


DECODE_IMPLS = {
    "native": _decode_native,
    "eager": _decode_eager,
    "chunked": _decode_chunked,
    "compiled": _decode_compiled,
    "fused_eager": _decode_fused,  # the compiled function run eagerly (for tests/bench)
}


def kernel_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, scale: float,
                  hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-kv-head fp32 [Hkv] factors the kernels apply: q·k times k_scale * scale and
    p·v times v_scale for an FP8 pool (checked scales, [1] or [Hkv]); scale and 1 for a
    pool without scales (k_scale None)."""
    if k_scale is not None:
        return (k_scale * scale).expand(hkv).contiguous(), v_scale.expand(hkv).contiguous()
    return (torch.full((hkv,), float(scale), dtype=torch.float32),
            torch.ones(hkv, dtype=torch.float32))


def default_decode_impl(fp8: bool) -> str:
    """Chosen from runtime/benchmark/attention.py measurements (see the module doc): the
    native kernel where it builds, else inductor's path (which falls back to eager)."""
    return "native" if native_available() else "compiled"


# ------------------------------------------------------------------------------- prefill


def _first_block(seq_len: int, tq: int, window: int | None, bs: int) -> int:
    """The first block a chunk of tq queries ending at seq_len can see (0 without window)."""
    return 0 if window is None else max(0, seq_len - tq - window + 1) // bs


def _prefill_native(q, k_pool, v_pool, row, seq_len, qk_scale, v_scale, window, softcap):
    """One sequence's chunk through the C prefill kernel (fp32 tiles, online softmax) over
    its context gathered to fp32 in one C pass: q [Tq, Hq, D] -> [Tq, Hq, D] fp32. A
    softcap, a pool kind the gather cannot read or no C build: the SDPA path."""
    tq, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    if softcap is not None or k_pool.dtype not in POOL_KINDS or not native_prefill_available():
        return _prefill_sdpa(q, k_pool, v_pool, row, seq_len, qk_scale, v_scale, window,
                             softcap)
    first = _first_block(seq_len, tq, window, bs) * bs
    k = gather_context_native(k_pool, row, first, seq_len - first, torch.float32)
    v = gather_context_native(v_pool, row, first, seq_len - first, torch.float32)
    qs = q.float().view(tq, hkv, hq // hkv, d) * qk_scale.view(1, hkv, 1, 1)
    return native_prefill_attention(qs.view(tq, hq, d), k, v, v_scale, window)


def _prefill_sdpa(q, k_pool, v_pool, row, seq_len, qk_scale, v_scale, window, softcap):
    """One sequence's chunk through torch's SDPA (or matmuls and a softmax with a
    softcap): q [Tq, Hq, D], row [n] valid block ids -> [Tq, Hq, D] fp32."""
    tq, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    g = hq // hkv
    first = _first_block(seq_len, tq, window, bs)  # keys before it are never visible
    blocks = row[first:(seq_len + bs - 1) // bs]
    # SDPA in bf16 for bf16 queries (fp32 accumulation inside; E4M3 and bf16 pool values
    # are exact in bf16); fp32 otherwise and for the softcap path
    cdt = torch.bfloat16 if q.dtype == torch.bfloat16 and softcap is None else torch.float32
    # one C pass instead of torch's gather and cast
    if k_pool.dtype in POOL_KINDS and native_available():
        k = gather_context_native(k_pool, row, first * bs, seq_len - first * bs, cdt)
        v = gather_context_native(v_pool, row, first * bs, seq_len - first * bs, cdt)
    else:
        k = k_pool[blocks].flatten(0, 1)[: seq_len - first * bs].to(cdt)  # [Lk, Hkv, D]
        v = v_pool[blocks].flatten(0, 1)[: seq_len - first * bs].to(cdt)
    causal = softcap is None and window is None and k.shape[0] == tq  # SDPA's own mask
    visible = None
    if not causal:
        k_pos = first * bs + torch.arange(k.shape[0])
        q_pos = torch.arange(seq_len - tq, seq_len)
        visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Lk]
        if window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < window
    qs = (q.float().view(tq, hkv, g, d) * qk_scale.view(1, hkv, 1, 1)).to(cdt)
    qs = qs.permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
    kt = k.transpose(0, 1)[:, None]  # [Hkv, 1, Lk, D]
    vt = v.transpose(0, 1)[:, None]
    if softcap is None:
        # [1, H, L, D] with enable_gqa reaches the fused CPU kernel; the broadcast
        # [Hkv, G, ...] layout falls back to the slower math path
        out = F.scaled_dot_product_attention(
            qs.reshape(1, hq, tq, d), kt.reshape(1, hkv, -1, d), vt.reshape(1, hkv, -1, d),
            attn_mask=None if causal else visible, is_causal=causal, scale=1.0,
            enable_gqa=True).view(hkv, g, tq, d)
    else:
        s = torch.matmul(qs, kt.transpose(-1, -2))
        s = torch.tanh(s / softcap) * softcap
        out = torch.matmul(torch.softmax(s.masked_fill(~visible, float("-inf")), -1), vt)
    out = out.float() * v_scale.view(hkv, 1, 1, 1)  # [Hkv, G, Tq, D] fp32
    return out.permute(2, 0, 1, 3).reshape(tq, hq, d)


# name -> one sequence's prompt chunk: (q, k_pool, v_pool, row, seq_len, qk_scale, v_scale,
# window, softcap) -> [Tq, Hq, D] fp32. default_prefill_impl picks one ("native" hands what
# it cannot run to "sdpa"); runtime/benchmark/attention.py times both.
PREFILL_IMPLS = {"native": _prefill_native, "sdpa": _prefill_sdpa}


@functools.lru_cache(maxsize=None)
def _amx_class(cap: str | None) -> bool:  # cap: QSERVE_CPU_CLASS, part of the cache key
    return cpu_class(cpu_flags()) == "amx"


def default_prefill_impl(q_dtype: torch.dtype) -> str:
    """Measured with runtime/benchmark/attention.py --prefill-chunk (docs/kernels.md): on
    AMX CPUs torch's SDPA runs bf16 queries on AMX tiles, 1.4-2.5x faster than the C kernel's
    fp32 tiles from 512 to 2,048 tokens, so "sdpa"; for fp32 queries there, and on every
    other class, the C kernel ("native": 1.3-1.9x SDPA on an AVX-512-BF16 EPYC)."""
    if q_dtype == torch.bfloat16 and _amx_class(os.environ.get(CPU_CLASS_ENV)):
        return "sdpa"
    return "native"


# --------------------------------------------------------------------------------- entry


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp8 (or uint8 bytes) / bf16
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B] context incl. the new tokens (already stored)
    k_scale: torch.Tensor | None,  # fp32 [1] or [Hkv] for FP8 pools, None otherwise
    v_scale: torch.Tensor | None,
    scale: float,  # multiplies q·k
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    decode_impl: str | None = None,  # a DECODE_IMPLS key; None = default_decode_impl
    prefill_impl: str | None = None,  # a PREFILL_IMPLS key; None = default_prefill_impl
    out: torch.Tensor | None = None,  # [T, Hq, D] dtype of q, written in place if given
    plan: PagedStepPlan | None = None,  # the step's checked layout (built here if None)
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    """Causal attention of every sequence's new tokens over its paged context.

    Pure: reads the pools, writes only `out`. Pool slots a sequence does not own are never
    part of its result but must hold finite values (a KVCache's always do). A `plan` built
    for this step's block_tables/query_start_loc/seq_lens stands in for them.
    """
    num_blocks, block_size, k_scale, v_scale = _check_tensors(q, k_pool, v_pool, k_scale,
                                                              v_scale)
    if plan is None:
        plan = PagedStepPlan.build(q.shape[0], num_blocks, block_size, None, block_tables,
                                   query_start_loc, seq_lens)
    else:
        plan.check_for(q.shape[0], num_blocks, block_size)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
    fp8 = is_fp8_pool(k_pool)
    impl = decode_impl or default_decode_impl(fp8)
    if impl not in DECODE_IMPLS:
        raise ValueError(f"decode_impl {impl!r} unknown; choose one of {sorted(DECODE_IMPLS)}.")
    prefill_impl = prefill_impl or default_prefill_impl(q.dtype)
    if prefill_impl not in PREFILL_IMPLS:
        raise ValueError(f"prefill_impl {prefill_impl!r} unknown; choose one of "
                         f"{sorted(PREFILL_IMPLS)}.")
    prefill = PREFILL_IMPLS[prefill_impl]
    if fp8:
        k_pool, v_pool = as_fp8_view(k_pool), as_fp8_view(v_pool)
    qk_scale, v_scale = kernel_scales(k_scale, v_scale, scale, k_pool.shape[2])

    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {list(q.shape)} {q.dtype}, got {list(out.shape)} "
                         f"{out.dtype}.")
    if impl == "native" and k_pool.dtype not in POOL_KINDS:
        impl = "compiled"  # fp16 pools: the C kernel reads E4M3, bf16 and fp32
    if impl == "native":
        return _native_step(q, k_pool, v_pool, plan, qk_scale, v_scale, sliding_window,
                            logit_softcap, out, prefill)
    if plan.decode_rows.numel():
        dq = q if plan.all_decode else q[plan.decode_rows]
        res = DECODE_IMPLS[impl](dq, k_pool, v_pool, plan.decode_block_tables,
                                 plan.decode_seq_lens, qk_scale, v_scale, sliding_window,
                                 logit_softcap).to(q.dtype)
        if plan.all_decode and out is None:
            return res
        if out is None:
            out = torch.empty_like(q)
        out[plan.decode_rows] = res
    elif out is None:
        out = torch.empty_like(q)
    _prefills(q, k_pool, v_pool, plan, plan.prefills, qk_scale, v_scale, sliding_window,
              logit_softcap, out, prefill)
    return out


def _native_step(q, k_pool, v_pool, plan, qk_scale, v_scale, window, softcap, out, prefill):
    """Every sequence with <= NATIVE_MAX_QUERY_LEN new tokens in one native call; longer
    prompt chunks through `prefill` (a PREFILL_IMPLS value)."""
    long = tuple(p for p in plan.prefills if p[2] > NATIVE_MAX_QUERY_LEN)
    skip = None
    if long:
        skip = torch.zeros(plan.seq_lens.shape[0], dtype=torch.bool)
        skip[[p[0] for p in long]] = True
    res = native_attention(q, k_pool, v_pool, plan.block_tables, plan.query_start_loc,
                           plan.seq_lens, qk_scale, v_scale, window, softcap, skip)
    if out is None:
        out = res.to(q.dtype)
    else:
        out.copy_(res)
    _prefills(q, k_pool, v_pool, plan, long, qk_scale, v_scale, window, softcap, out,
              prefill)
    return out


def _prefills(q, k_pool, v_pool, plan, chunks, qk_scale, v_scale, window, softcap, out,
              prefill):
    """Each (sequence, first row, rows, seq_len) chunk through `prefill` into out."""
    for b_idx, s, n, seq_len in chunks:
        out[s:s + n] = prefill(q[s:s + n], k_pool, v_pool, plan.block_tables[b_idx], seq_len,
                               qk_scale, v_scale, window, softcap).to(q.dtype)


# ----------------------------------------------------------------------------- reference


def gather_context(pool, block_table_row, seq_len, scale=None) -> torch.Tensor:
    """One sequence's first seq_len cached tokens, token by token, as float64.

    pool [num_blocks, bs, Hkv, D]; returns [seq_len, Hkv, D], dequantized (fp8 * scale).
    """
    bs, hkv = pool.shape[1], pool.shape[2]
    idx = [(int(block_table_row[p // bs]), p % bs) for p in range(seq_len)]
    rows = [pool[blk, off] for blk, off in idx]
    x = (torch.stack(rows) if rows else pool.new_empty(0, hkv, pool.shape[3]))
    x = as_fp8_view(x).to(torch.float64) if is_fp8_pool(pool) else x.to(torch.float64)
    if is_fp8_pool(pool):
        s = torch.as_tensor(scale, dtype=torch.float32).to(torch.float64).reshape(-1)
        x = x * s.view(1, -1, 1)
    return x


def paged_attention_reference(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens,
                              k_scale, v_scale, scale, sliding_window=None,
                              logit_softcap=None) -> torch.Tensor:
    """float64 [T, Hq, D]: gather each context token by token, dense masked softmax."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    hq, hkv = q.shape[1], k_pool.shape[2]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = gather_context(k_pool, block_tables[b], seq_len, k_scale)  # [L, Hkv, D]
        v = gather_context(v_pool, block_tables[b], seq_len, v_scale)
        k = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qf = q[s:e].to(torch.float64).transpose(0, 1)  # [Hq, Tq, D]
        scores = torch.matmul(qf, k.transpose(1, 2)) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        q_pos = torch.arange(seq_len - (e - s), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out[s:e] = torch.matmul(probs, v).transpose(0, 1)
    return out


__all__ = ["paged_attention", "paged_attention_reference", "gather_context", "DECODE_IMPLS",
           "PREFILL_IMPLS", "default_decode_impl", "default_prefill_impl"]
