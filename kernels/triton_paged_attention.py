"""Paged attention on the Triton kernels: the same call and contract as
kernels/paged_attention.paged_attention, tested against its paged_attention_reference.

Sequences with one new token go to the decode kernel (triton_decode_attention.py), the
others to the prefill/extend kernel (triton_prefill_attention.py); a mixed batch is two
launches that write disjoint rows of `out`. The decode kernel splits the context
(Flash-Decoding) when decode sequences x kv heads would leave most of the device's SMs
idle: `choose_num_splits`.

`plan_paged_attention` validates (reusing the torch path's checks, on host copies of the
small metadata, which the launch decisions need anyway) and returns an `AttentionLaunch`
whose `run(out)` only launches kernels; benchmarks time `run`. The metadata part (checks,
device copies, split choice) is kept for the next call with equal metadata, i.e. for
the other layers of the same engine step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .kv_store import as_fp8_view, check_pools, check_scale, is_fp8_pool
from .paged_attention import _check_tensors
from .paged_plan import PagedStepPlan
from .triton_decode_attention import decode_attention
from .triton_numerics import check_kernel_device
from .triton_prefill_attention import prefill_attention

MIN_SPLIT_TOKENS = 256  # shorter splits mostly add reduction work (a guess, not GPU-tuned)
MAX_SPLITS = 64
NOMINAL_SMS = 132  # H100/H200; used where there is no CUDA device (the interpreter)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SMS


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_visible: int, num_sms: int) -> int:
    """Splits per sequence: enough programs for ~2 per SM, each split >= MIN_SPLIT_TOKENS."""
    programs = num_seqs * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, triton.cdiv(max_visible, MIN_SPLIT_TOKENS), MAX_SPLITS))


@dataclass
class AttentionLaunch:
    """Everything the kernels need, on the device, after validation and split choice."""

    q: torch.Tensor  # [T, Hq, D]
    k_pool: torch.Tensor  # [num_blocks, block_size, Hkv, D] uint8 (FP8 bytes) or float
    v_pool: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    qk_scale: torch.Tensor  # [Hkv] fp32, k scale * softmax scale
    v_scale: torch.Tensor  # [Hkv] fp32
    window: int | None
    softcap: float | None
    decode_seqs: torch.Tensor | None  # [num_decode] int32, sequences with one new token
    num_splits: int
    split_len: int
    max_prefill_len: int  # longest query among sequences with > 1 new token (0: none)

    def run(self, out: torch.Tensor) -> torch.Tensor:
        """Launch the kernels into out [T, Hq, D] (dtype of q)."""
        if self.decode_seqs is not None:
            decode_attention(self.q, self.k_pool, self.v_pool, self.block_tables, self.seq_lens,
                             self.query_start_loc, self.decode_seqs, self.qk_scale, self.v_scale,
                             self.window, self.softcap, out, self.num_splits, self.split_len)
        if self.max_prefill_len:
            prefill_attention(self.q, self.k_pool, self.v_pool, self.block_tables, self.seq_lens,
                              self.query_start_loc, self.qk_scale, self.v_scale, self.window,
                              self.softcap, out, self.max_prefill_len, min_query_len=2)
        return out


@dataclass(frozen=True)
class _Layout:
    """The layer-independent part of a launch: metadata on the device, decode rows, splits."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    decode_seqs: torch.Tensor | None
    num_splits: int
    split_len: int
    max_prefill_len: int


class _LayoutCache:
    """The last layout, kept with a copy of the host metadata it was made from and the
    rest of what the checks read. The engine hands the same metadata to every layer of a
    step, so only the first layer validates; a hit needs equal contents (a few small
    host compares), so in-place changes and inference tensors (which have no version
    counter) are handled alike."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, tuple, _Layout] | None = None

    def get(self, host_meta: tuple, key: tuple) -> _Layout | None:
        if self._entry is None:
            return None
        held, held_key, layout = self._entry
        if held_key != key or not all(map(torch.equal, held, host_meta)):
            return None
        return layout

    def put(self, host_meta: tuple, key: tuple, layout: _Layout) -> None:
        self._entry = (tuple(t.clone() for t in host_meta), key, layout)


_layouts = _LayoutCache()


def _check_step(q, k_pool, v_pool, host_meta, k_scale, v_scale) -> PagedStepPlan:
    """The torch path's checks of this call, on the host copies of the metadata."""
    num_blocks, block_size, _, _ = _check_tensors(q, k_pool, v_pool, k_scale, v_scale)
    return PagedStepPlan.build(q.shape[0], num_blocks, block_size, None, *host_meta)


def _layout(q, k_pool, v_pool, host_meta, k_scale, v_scale, sliding_window, num_splits,
            device) -> _Layout:
    bt_host, qsl_host, seq_host = host_meta
    step = _check_step(q, k_pool, v_pool, host_meta, k_scale, v_scale)
    qlens, seq = step.query_lens, step.seq_lens
    decode = (qlens == 1).nonzero().flatten()  # host [num_decode]
    splits, split_len, decode_seqs = 1, 0, None
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    if decode.numel():
        visible = seq[decode]
        if sliding_window is not None:
            visible = visible.clamp(max=sliding_window)
        max_visible = int(visible.max())
        splits = num_splits or choose_num_splits(decode.numel(), hkv, max_visible,
                                                 _num_sms(device))
        block_n = 64 if d <= 128 else 32  # the decode kernel's tile
        split_len = triton.cdiv(triton.cdiv(max_visible, splits), block_n) * block_n
        decode_seqs = decode.to(device=device, dtype=torch.int32)
    prefill = qlens[qlens > 1]
    # copies (copy=True): the kept layout must not alias the caller's tensors
    return _Layout(bt_host.to(device=device, dtype=torch.int32, copy=True),
                   seq_host.to(device=device, dtype=torch.int32, copy=True),
                   qsl_host.to(device=device, dtype=torch.int32, copy=True), decode_seqs,
                   splits, split_len, int(prefill.max()) if prefill.numel() else 0)


def plan_paged_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens, k_scale,
                         v_scale, scale, sliding_window=None, logit_softcap=None,
                         num_splits=None) -> AttentionLaunch:
    """Validate the inputs of paged_attention_triton and prepare its launches."""
    device = check_kernel_device("paged_attention", q, k_pool, v_pool)
    _, _, hkv, d = check_pools(k_pool, v_pool)
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv != 0:
        raise ValueError(f"q must be [num_tokens, num_heads, {d}] with num_heads a multiple of "
                         f"the pools' {hkv} kv heads, got {list(q.shape)}.")
    if q.dtype not in _OUT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}.")
    if q.stride(2) != 1:
        raise ValueError(f"q needs a contiguous head dim (strides {q.stride()}); pass "
                         f"q.contiguous().")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}.")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}] or None, got {num_splits}.")
    fp8 = is_fp8_pool(k_pool)
    k_scale = check_scale("k_scale", k_scale, fp8, hkv)
    v_scale = check_scale("v_scale", v_scale, fp8, hkv)

    host_meta = tuple(t.cpu() for t in (block_tables, query_start_loc, seq_lens))
    key = (q.shape[0], q.shape[1], tuple(k_pool.shape), fp8, device, sliding_window,
           num_splits, tuple((t.dtype, t.shape) for t in host_meta))
    layout = _layouts.get(host_meta, key)
    if layout is None:
        layout = _layout(q, k_pool, v_pool, host_meta, k_scale, v_scale, sliding_window,
                         num_splits, device)
        _layouts.put(host_meta, key, layout)
    if fp8:
        kp, vp = as_fp8_view(k_pool).view(torch.uint8), as_fp8_view(v_pool).view(torch.uint8)
        qk_scale = (k_scale.to(device) * scale).expand(hkv).contiguous()  # [Hkv] fp32
        vs = v_scale.to(device).expand(hkv).contiguous()
    else:
        kp, vp = k_pool, v_pool
        qk_scale = torch.full((hkv,), float(scale), dtype=torch.float32, device=device)
        vs = torch.ones(hkv, dtype=torch.float32, device=device)
    return AttentionLaunch(q, kp, vp, layout.block_tables, layout.seq_lens,
                           layout.query_start_loc, qk_scale, vs, sliding_window, logit_softcap,
                           layout.decode_seqs, layout.num_splits, layout.split_len,
                           layout.max_prefill_len)


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D] fp32 / bf16 / fp16, stride(2) == 1
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp8 (or uint8 bytes) / bf16
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64 (any strides)
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B] context incl. the new tokens (already stored)
    k_scale: torch.Tensor | None,  # fp32 [1] or [Hkv] for FP8 pools, None otherwise
    v_scale: torch.Tensor | None,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    num_splits: int | None = None,  # decode splits; None: choose_num_splits
    out: torch.Tensor | None = None,  # [T, Hq, D] dtype of q
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    """Causal attention of every sequence's new tokens over its paged context. Pure."""
    launch = plan_paged_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens,
                                  k_scale, v_scale, scale, sliding_window, logit_softcap,
                                  num_splits)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {list(q.shape)} {q.dtype} on {q.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}.")
    elif out.stride(2) != 1:
        raise ValueError(f"out needs a contiguous head dim (strides {out.stride()}).")
    return launch.run(out)


def static_splits(num_seqs: int, num_kv_heads: int, head_dim: int, max_context: int,
                  sliding_window: int | None, num_sms: int) -> tuple[int, int]:
    """(splits, split_len) of a decode launch decided from fixed capacities alone: the
    batch's padded size and the longest context its block tables can hold (or the
    window), never from this step's lengths, so one captured launch serves every step.
    Splits past a sequence's context are empty and weigh 0 in the reduction."""
    visible = max_context if sliding_window is None else min(max_context, sliding_window)
    splits = choose_num_splits(num_seqs, num_kv_heads, visible, num_sms)
    block_n = 64 if head_dim <= 128 else 32  # the decode kernel's tile
    return splits, triton.cdiv(triton.cdiv(visible, splits), block_n) * block_n


def decode_attention_static(
    q: torch.Tensor,  # [B, Hq, D] fp32 / bf16 / fp16: one new token per sequence
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp8 (or uint8 bytes) / float
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32 on q's device, W * block_size >= max_context
    seq_lens: torch.Tensor,  # [B] int32 on q's device, each in [1, max_context]
    query_start_loc: torch.Tensor,  # [B + 1] int32 on q's device: 0, 1, ..., B
    decode_seqs: torch.Tensor,  # [B] int32 on q's device: 0, 1, ..., B - 1
    k_scale: torch.Tensor | None,  # fp32 [1] or [Hkv] on the device for FP8 pools
    v_scale: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    max_context: int,
) -> torch.Tensor:  # [B, Hq, D] dtype of q
    """Decode attention whose metadata is never read on the host: for steps replayed from
    fixed device buffers (runtime/decode_graphs.py). The host built and checked that
    metadata; here only shapes, dtypes and devices are checked, and the split count comes
    from `static_splits`. Same result as paged_attention_triton on the same step."""
    device = check_kernel_device("decode_attention_static", q, k_pool, v_pool, block_tables,
                                 seq_lens, query_start_loc, decode_seqs)
    _, block_size, hkv, d = check_pools(k_pool, v_pool)
    b = q.shape[0]
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv or q.stride(2) != 1:
        raise ValueError(f"q must be [num_seqs, num_heads, {d}] with a contiguous head dim and "
                         f"num_heads a multiple of {hkv}, got {list(q.shape)}.")
    if q.dtype not in _OUT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}.")
    for name, t, shape in (("block_tables", block_tables, (b, block_tables.shape[-1])),
                           ("seq_lens", seq_lens, (b,)), ("query_start_loc", query_start_loc,
                                                          (b + 1,)),
                           ("decode_seqs", decode_seqs, (b,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be int32 {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}.")
    if block_tables.shape[1] * block_size < max_context:
        raise ValueError(f"block_tables hold {block_tables.shape[1]} blocks of {block_size}, "
                         f"fewer than max_context {max_context} tokens.")
    fp8 = is_fp8_pool(k_pool)
    k_scale = check_scale("k_scale", k_scale, fp8, hkv)
    v_scale = check_scale("v_scale", v_scale, fp8, hkv)
    if fp8:
        kp, vp = as_fp8_view(k_pool).view(torch.uint8), as_fp8_view(v_pool).view(torch.uint8)
        qk_scale = (k_scale * scale).expand(hkv).contiguous()  # [Hkv] fp32
        vs = v_scale.expand(hkv).contiguous()
    else:
        kp, vp = k_pool, v_pool
        qk_scale = torch.full((hkv,), float(scale), dtype=torch.float32, device=device)
        vs = torch.ones(hkv, dtype=torch.float32, device=device)
    splits, split_len = static_splits(b, hkv, d, max_context, sliding_window, _num_sms(device))
    out = torch.empty_like(q)
    decode_attention(q, kp, vp, block_tables, seq_lens, query_start_loc, decode_seqs, qk_scale,
                     vs, sliding_window, logit_softcap, out, splits, split_len)
    return out
