"""An attention backend wrapper that stores K/V as FP8 would: quantize-dequantize.

Wraps a backend without a paged cache (dense, contiguous) so that every K and V it sees
has been through FP8 with the artifact's static per-layer (or per-head) scales: exactly
the values a paged FP8 KV cache returns. Used for quality measurement of FP8 KV before
and beside the paged engine.
"""

from __future__ import annotations

import torch

from ..kernels.fp8 import quantize_fp8


def _qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [T, Hkv, D]; scale: [1] (per layer) or [Hkv] (per head), fp32."""
    s = scale.reshape(1, -1, 1) if scale.numel() > 1 else scale.reshape(1, 1, 1)
    return (quantize_fp8(x, s).to(torch.float32) * s).to(x.dtype)


class Fp8KVAttention:
    def __init__(self, inner, kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.inner = inner
        self.kv_scales = kv_scales

    def forward(self, spec, q, k, v, meta):
        scales = self.kv_scales.get(spec.layer_idx)
        if scales is not None:
            k, v = _qdq(k, scales[0]), _qdq(v, scales[1])
        return self.inner.forward(spec, q, k, v, meta)

    def __getattr__(self, name):
        return getattr(self.inner, name)
