"""GPTQ rounding of a weight matrix onto the FP8 E4M3 grid.

Round-to-nearest treats every weight alone. GPTQ rounds the input columns one at a
time and spreads each column's rounding error over the columns not yet rounded, weighted
by the inverse Hessian of the layer's inputs (H = E[x x^T] from calibration), so the
layer's *output* on calibration-like inputs moves as little as possible:
    minimize || W X - Q(W) X ||^2 over Q(W) on the FP8 grid, column by column.
Scales are fixed beforehand (per output channel or per tensor), so the result is an
ordinary FP8 weight + scale, loadable by any engine.
"""

from __future__ import annotations

import torch

from ..calib.fp8 import quantize_fp8


def gptq_fp8(
    weight: torch.Tensor,  # [out, in] any float dtype
    hessian: torch.Tensor,  # [in, in] float64, E[x x^T]
    scale: torch.Tensor,  # [out, 1] or [1] float32
    block_size: int = 128,
    dampening: float = 0.01,
) -> torch.Tensor:  # [out, in] float8_e4m3fn
    w = weight.detach().to(torch.float32).clone()  # [out, in]
    n_in = w.shape[1]
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: any value works
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(n_in, dtype=torch.float64) * (dampening * torch.diag(h).mean())
    # upper Cholesky factor of H^-1: row i holds the update coefficients for column i
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    h_inv = h_inv.to(torch.float32)
    s = scale.to(torch.float32).reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1).float()
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for b0 in range(0, n_in, block_size):
        b1 = min(b0 + block_size, n_in)
        wb = w[:, b0:b1].clone()  # [out, B]
        err = torch.empty_like(wb)
        hb = h_inv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = wb[:, i:i + 1]  # [out, 1]
            q = quantize_fp8(col, s)  # [out, 1] fp8
            codes[:, b0 + i:b0 + i + 1] = q
            e = (col - q.to(torch.float32) * s) / hb[i, i]
            wb[:, i:] -= e * hb[i:i + 1, i:]
            err[:, i:i + 1] = e
        w[:, b1:] -= err @ h_inv[b0:b1, b1:]  # carry the block's error to later columns
    return codes
