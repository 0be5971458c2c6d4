"""Second-moment statistics of a linear layer's input, for GPTQ-style weight rounding.

    H = (1 / n) * sum_t x_t x_t^T        x_t: one input row [in_features]

Each batch's product is computed in float32 and added to a float64 running sum, so
many batches of bf16 activations sum without drift.
Behaves like an observer (`observe(x)`), so `ActivationRecorder` can feed it.
"""

from __future__ import annotations

import torch

from .errors import NotObservedError


GRAM_BLOCK = 384  # columns per block of gram(): 1536 inputs take 10 of 16 block products


def gram(x: torch.Tensor) -> torch.Tensor:
    """x^T x [n, n] for x [T, n] (fp32), exactly symmetric: only the blocks on and above
    the diagonal are multiplied (x_a^T x_b, one matmul each; ~5/8 of the full product's
    work for n = 1536) and the entries below the diagonal are copies of those above. Each
    entry is a sum over T as the full matmul forms it."""
    n = x.shape[1]
    out = torch.empty(n, n, dtype=x.dtype)
    edges = [*range(0, n, GRAM_BLOCK), n]
    for a0, a1 in zip(edges, edges[1:]):
        xa_t = x[:, a0:a1].t()
        for b0, b1 in zip(edges, edges[1:]):
            if b0 >= a0:
                out[a0:a1, b0:b1] = xa_t @ x[:, b0:b1]  # [a1 - a0, b1 - b0]
    return torch.triu(out) + torch.triu(out, 1).t()  # below the diagonal: the copies


class HessianAccumulator:
    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)  # [in, in]
        self.count = 0  # rows seen

    def observe(self, x: torch.Tensor) -> None:
        """Mutates: add x [..., in_features] (any float dtype) to the running sum."""
        x = x.reshape(-1, self.in_features).to(torch.float32)  # [T, in]
        # one batch in fp32 (fast matmul), the running sum in fp64 (no drift over batches)
        self.sum += gram(x).to(torch.float64)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """Read-only: the mean outer product [in, in] float64."""
        if self.count == 0:
            raise NotObservedError("no inputs were observed for this layer's Hessian.")
        return self.sum / self.count


class Tee:
    """Feeds one input to several observers (e.g. a range observer and a Hessian)."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def observe(self, x: torch.Tensor) -> None:
        for obs in self.observers:
            obs.observe(x)


class SharedInput:
    """One accumulator fed by `n` modules that see the same input tensor (q/k/v, gate/up).

    The modules run in a fixed order within each forward, so every n-th call is a new
    input; the others are the same tensor again and are skipped.
    """

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0

    def observe(self, x: torch.Tensor) -> None:
        if self.calls % self.n == 0:
            self.inner.observe(x)
        self.calls += 1
