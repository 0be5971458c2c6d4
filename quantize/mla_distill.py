"""Layer-local distillation of converted latent attention (quantize/mla_convert.py).

Each converted attention layer is trained, on its own, to give the source layer's output
for the source layer's input (both recorded from the source model on calibration text):

    loss_i = |MLA_i(x_i) - Attn_i(x_i)|^2 / |Attn_i(x_i)|^2     (x_i from the source model)

with Adam on q_proj, kv_a_proj_with_mqa (its constant row stays) and kv_b_proj, o_proj.
The norm weights and the constant's bias stay, so the latent norm stays linear. Layers
are independent (no error carried from one to the next), which keeps memory at one
layer's activations and needs no backward pass through the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..runtime.attention import AttentionMetadata, DenseAttention


@dataclass(frozen=True)
class LayerFit:
    before: float  # relative squared error of the layer's attention output, all rows
    after: float


def _record(model: nn.Module, rows: torch.Tensor, layer: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input [N*L, hidden], output [N*L, hidden]) of layer `layer`'s attention, fp32."""
    attn = model.backbone.layers[layer].self_attn
    xs, ys = [], []
    pre = attn.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().float()))
    post = attn.register_forward_hook(lambda m, a, out: ys.append(out.detach().float()))
    try:
        n, seq_len = rows.shape
        with torch.no_grad():
            for r in rows.split(2):
                meta = AttentionMetadata.from_lengths([seq_len] * r.shape[0])
                _run_until(model, r.reshape(-1), torch.arange(seq_len).repeat(r.shape[0]),
                           meta, layer)
    finally:
        pre.remove()
        post.remove()
    return torch.cat(xs), torch.cat(ys)


class _Stop(Exception):
    pass


def _run_until(model, ids, positions, meta, layer: int) -> None:
    """Run the model up to layer `layer`'s attention (its hooks fire), then stop."""
    attn = model.backbone.layers[layer].self_attn

    def stop(module, args, out):
        raise _Stop
    handle = attn.register_forward_hook(stop)
    try:
        model(ids, positions, meta, DenseAttention())
    except _Stop:
        pass
    finally:
        handle.remove()


def distill_attention(source: nn.Module, converted: nn.Module, rows: torch.Tensor, steps: int,
                      lr: float, progress: Callable[[str], None] = lambda m: None,
                      rows_per_step: int = 2) -> list[LayerFit]:
    """Train every converted attention layer towards the source's (mutates `converted`).
    rows: [N, L] int64 calibration tokens."""
    n, seq_len = rows.shape
    cos, sin = converted.backbone.rotary_emb(torch.arange(seq_len), torch.float32)
    fits = []
    for i, layer in enumerate(converted.backbone.layers):
        progress(f"mla distill {i + 1}/{len(converted.backbone.layers)}")
        x, y = _record(source, rows, i)  # [N*L, hidden] each
        x, y = x.view(n, seq_len, -1), y.view(n, seq_len, -1)
        attn = layer.self_attn
        constant = attn.kv_a_layernorm.weight.shape[0] - 1  # the latent's constant row
        params = [attn.q_proj.weight, attn.kv_a_proj_with_mqa.weight, attn.kv_b_proj.weight,
                  attn.o_proj.weight]

        def loss_of(idx: list[int]) -> torch.Tensor:
            k = len(idx)
            meta = AttentionMetadata.from_lengths([seq_len] * k)
            out = attn(x[idx].reshape(k * seq_len, -1), (cos.repeat(k, 1), sin.repeat(k, 1)),
                       meta, DenseAttention())
            target = y[idx].reshape(k * seq_len, -1)
            return ((out - target) ** 2).sum() / (target ** 2).sum()

        with torch.no_grad():
            before = float(sum(loss_of([j]) for j in range(n)) / n)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=lr)
        with torch.enable_grad():
            for step in range(steps):
                idx = [(step * rows_per_step + j) % n for j in range(rows_per_step)]
                loss = loss_of(idx)
                opt.zero_grad(set_to_none=False)
                loss.backward()
                attn.kv_a_proj_with_mqa.weight.grad[constant] = 0.0
                opt.step()
        for p in params:
            p.requires_grad_(False)
        attn._absorbed = None  # derived from kv_b_proj, which changed
        with torch.no_grad():
            after = float(sum(loss_of([j]) for j in range(n)) / n)
        fits.append(LayerFit(before, after))
    return fits
