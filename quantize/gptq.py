"""GPTQ rounding of a weight matrix onto a weight grid (FP8 E4M3, or symmetric int8).

Round-to-nearest treats every weight alone. GPTQ rounds the input columns one at a
time and spreads each column's rounding error over the columns not yet rounded, weighted
by the inverse Hessian of the layer's inputs (H = E[x x^T] from calibration), so the
layer's *output* on calibration-like inputs moves as little as possible:
    minimize || W X - Q(W) X ||^2 over Q(W) on the grid, column by column.
Scales are fixed beforehand (per output channel or per tensor, or per output channel and
group of consecutive inputs), so the result is an ordinary FP8 (or int8) weight + scale,
loadable by any engine. The grid
(calib/grids.py) only decides how one column is rounded and what the codes are stored as.
"""

from __future__ import annotations

import torch

from ..calib.grids import GRIDS, WeightGrid


def gptq_fp8(
    weight: torch.Tensor,  # [out, in] any float dtype
    hessian: torch.Tensor,  # [in, in] float64, E[x x^T]
    scale: torch.Tensor,  # [out, 1] or [1] float32
    block_size: int = 128,
    dampening: float = 0.01,
) -> torch.Tensor:  # [out, in] float8_e4m3fn
    return gptq_fp8_shared([weight], hessian, [scale], block_size, dampening)[0]


def _inverse_factor(hessian: torch.Tensor, dampening: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of the dampened H^-1 [in, in] fp32, dead inputs [in] bool):
    row i of the factor holds the update coefficients for column i."""
    n_in = hessian.shape[0]
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: any value works
    h[dead, dead] = 1.0
    h += torch.eye(n_in, dtype=torch.float64) * (dampening * torch.diag(h).mean())
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return h_inv.to(torch.float32), dead


def gptq_fp8_shared(
    weights: list[torch.Tensor],  # each [out_j, in] any float dtype, all fed the same input
    hessian: torch.Tensor,  # [in, in] float64, E[x x^T] of that input
    scales: list[torch.Tensor],  # each [out_j, 1] or [1] float32
    block_size: int = 128,
    dampening: float = 0.01,
) -> list[torch.Tensor]:  # each [out_j, in] float8_e4m3fn
    return gptq_shared(weights, hessian, scales, GRIDS["fp8"], block_size, dampening)


def gptq_shared(
    weights: list[torch.Tensor],  # each [out_j, in] any float dtype, all fed the same input
    hessian: torch.Tensor,  # [in, in] float64, E[x x^T] of that input
    scales: list[torch.Tensor],  # each [out_j, 1] or [1] float32, or all [out_j, in / g]
    grid: WeightGrid,  # the codes' grid: its rounding and storage dtype
    block_size: int = 128,
    dampening: float = 0.01,
) -> list[torch.Tensor]:  # each [out_j, in] grid.dtype
    """GPTQ of several weights that read one input (q/k/v, gate/up) in one pass: H^-1 is
    factored once and each column step updates every weight's rows together. Rows never
    mix, so each weight gets the codes it would get alone. Scales of G columns ([out_j, G],
    G > 1, the same G for every weight) hold one scale per output channel and group of in / G
    consecutive inputs: column i is rounded with its group's, i // (in / G).

    The work runs on the transpose, W^T [in, sum out]: column i of W is row i there, so a
    column step reads and updates contiguous rows."""
    n_in = hessian.shape[0]
    h_inv, dead = _inverse_factor(hessian, dampening)
    outs = [w.shape[0] for w in weights]
    # [in, O] fp32, O = sum of out_j; per-output-channel scales as one row [1, O]
    wt = torch.cat([w.detach().to(torch.float32).t() for w in weights], dim=1).contiguous()
    wt[dead] = 0.0
    groups = scales[0].shape[-1] if scales[0].dim() == 2 and scales[0].shape[-1] > 1 else 1
    if groups > 1:  # [G, O]: row g holds every output channel's scale for group g
        if n_in % groups or any(sc.shape != (o, groups) for sc, o in zip(scales, outs)):
            raise ValueError(f"group scales must all be [out, G] with G dividing the "
                             f"{n_in} inputs; got {[tuple(sc.shape) for sc in scales]}.")
        s_groups = torch.cat([sc.to(torch.float32) for sc in scales], dim=0).t().contiguous()
    else:
        s = torch.cat([sc.to(torch.float32).reshape(-1).expand(o)
                       for sc, o in zip(scales, outs)]).reshape(1, -1)
    width = n_in // groups  # inputs per group
    codes_t = torch.empty(wt.shape, dtype=grid.dtype)  # [in, O]
    for b0 in range(0, n_in, block_size):
        b1 = min(b0 + block_size, n_in)
        wb = wt[b0:b1].clone()  # [B, O]
        err = torch.empty_like(wb)  # [B, O]
        hb = h_inv[b0:b1, b0:b1]  # [B, B]
        for i in range(b1 - b0):
            row = wb[i:i + 1]  # [1, O]: column b0 + i of every weight
            if groups > 1:
                s = s_groups[(b0 + i) // width].reshape(1, -1)  # [1, O]
            q = grid.quantize(row, s)  # [1, O] grid.dtype
            codes_t[b0 + i:b0 + i + 1] = q
            e = (row - q.to(torch.float32) * s) / hb[i, i]  # [1, O]
            wb[i:] -= hb[i, i:].reshape(-1, 1) * e  # [B - i, O]
            err[i:i + 1] = e
        # carry the block's error to later columns: the product W's layout forms, transposed
        wt[b1:] -= (err.t() @ h_inv[b0:b1, b1:]).t()
    codes = codes_t.t()  # [O, in] view
    return [c.contiguous() for c in torch.split(codes, outs, dim=0)]
