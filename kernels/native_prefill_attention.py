"""Causal attention of a long prompt chunk over its context in C, on CPU, in fp32.

    out = native_prefill_attention(q, k, v, v_scale, window)   # fp32 [Tq, Hq, D], or None

q [Tq, Hq, D] (any float dtype; already times the q.k scale of its kv head), k / v
[Lk, Hkv, D] (the context, the chunk's own tokens last; any float dtype), v_scale fp32
[Hkv] (multiplies the output), window: a sliding window or None. The kernel
(csrc/prefill_attention_cpu.c, built by native_build.py) tiles queries and keys with the
online softmax; kernels/paged_attention.py sends it the chunks too long for the paged decode
kernel, where torch's SDPA ran them (runtime/benchmark/attention.py `--prefill-chunk`
times both).
Returns None where the library cannot be built (the caller keeps its torch path).
"""

from __future__ import annotations

import torch

from .native_build import cached_library
from .native_call import keyword_calls

_library = cached_library("prefill_attention_cpu")


def native_prefill_available() -> bool:
    return _library() is not None


@keyword_calls("prefill_attention_cpu")
def native_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             v_scale: torch.Tensor, window: int | None
                             ) -> torch.Tensor | None:
    lib = _library()
    if lib is None:
        return None
    tq, hq, d = q.shape
    lk, hkv, dk = k.shape
    if v.shape != k.shape or dk != d or hq % hkv or not 1 <= tq <= lk:
        raise ValueError(f"prefill attention needs q [Tq, Hq, D] and k = v [Lk, Hkv, D] with "
                         f"Hq a multiple of Hkv and 1 <= Tq <= Lk; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}.")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}.")
    q = q.to(torch.float32).contiguous()
    k = k.to(torch.float32).contiguous()
    v = v.to(torch.float32).contiguous()
    vs = v_scale.to(torch.float32).reshape(-1).expand(hkv).contiguous()
    out = torch.empty(tq, hq, d, dtype=torch.float32)
    rc = lib.qserve_prefill_attention_cpu(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), nq=tq, lk=lk, hq=hq, hkv=hkv, d=d,
        window=int(window) if window is not None else 0, v_scale=vs.data_ptr(),
        out=out.data_ptr(), num_threads=torch.get_num_threads())
    if rc != 0:
        raise MemoryError("prefill attention could not allocate its scratch buffers.")
    return out


__all__ = ["native_prefill_attention", "native_prefill_available"]
