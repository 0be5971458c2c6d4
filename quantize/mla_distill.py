"""Distillation of converted latent attention (quantize/mla_convert.py), in two stages.

Layer-local (`distill_attention`): each converted attention layer is trained, on its own,
to give the source layer's output for the source layer's input (both recorded from the
source model on calibration text):

    loss_i = |MLA_i(x_i) - Attn_i(x_i)|^2 / |Attn_i(x_i)|^2     (x_i from the source model)

with Adam on q_proj, kv_a_proj_with_mqa (its constant row stays) and kv_b_proj, o_proj.
The norm weights and the constant's bias stay, so the latent norm stays linear. Layers
are independent (no error carried from one to the next), which keeps memory at one
layer's activations and needs no backward pass through the model.

Whole-model (`distill_model`): then all converted attention projections together, towards
the source model's next-token distribution on calibration rows:

    loss = mean over positions of KL(p_source || p_converted)

so that an error one layer leaves is corrected where it matters, in the logits, by the
layers after it. One row per step, Adam with a linear warm-up over the first tenth of the
steps and a cosine decay after; the constant's row, the norms, the MLPs, the embeddings
and the LM head stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..runtime.attention import AttentionMetadata, DenseAttention


KL_ROWS = 8  # training rows whose KL distill_model reports before and after


@dataclass(frozen=True)
class ModelFit:
    kl_before: float  # mean next-token KL(source || converted), nats, on the first
    kl_after: float   # KL_ROWS training rows
    steps: int
    rows: int


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


def _trainable(attn: nn.Module) -> tuple[list[torch.Tensor], int]:
    """(the projections both distillations train in one converted attention layer, the
    row of kv_a_proj_with_mqa that makes the latent's constant: its gradient is zeroed, so
    the latent norm stays linear). A q bias's path (q_a -> norm -> q_b, Qwen 2) trains
    q_b only: q_a and its norm stay linear the same way."""
    q = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
    return ([q.weight, attn.kv_a_proj_with_mqa.weight, attn.kv_b_proj.weight,
             attn.o_proj.weight], attn.kv_a_layernorm.weight.shape[0] - 1)


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
    ropes = converted.backbone.ropes(torch.arange(seq_len), torch.float32)
    fits = []
    for i, layer in enumerate(converted.backbone.layers):
        progress(f"mla distill {i + 1}/{len(converted.backbone.layers)}")
        x, y = _record(source, rows, i)  # [N*L, hidden] each
        x, y = x.view(n, seq_len, -1), y.view(n, seq_len, -1)
        attn = layer.self_attn
        params, constant = _trainable(attn)
        cos, sin = ropes[layer.rope_kind]  # [L, P] each

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


def log_probs(model: nn.Module, row: torch.Tensor, attention=None) -> torch.Tensor:
    """[L, vocab] fp32 next-token log-probabilities of `row` [L] (one sequence), through
    `attention` (default: a fresh DenseAttention)."""
    meta = AttentionMetadata.from_lengths([row.numel()])
    logits = model.compute_logits(model(row, torch.arange(row.numel()), meta,
                                        attention or DenseAttention()))
    return torch.log_softmax(logits.float(), dim=-1)


def _kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), both [L, vocab] log-probabilities."""
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def mean_kl(source: nn.Module, converted: nn.Module, rows: torch.Tensor) -> float:
    """Mean next-token KL(source || converted) over rows [N, L]."""
    with torch.no_grad():
        return float(sum(_kl(log_probs(source, r), log_probs(converted, r)) for r in rows)
                     / rows.shape[0])


def distill_model(source: nn.Module, converted: nn.Module, rows: torch.Tensor, steps: int,
                  lr: float, progress: Callable[[str], None] = lambda m: None) -> ModelFit:
    """Train every converted attention projection at once towards the source's next-token
    distribution (mutates `converted`). rows: [N, L] int64 calibration tokens, one per
    step in turn."""
    if steps <= 0:
        raise ValueError(f"distill_model needs steps >= 1, got {steps}")
    before = mean_kl(source, converted, rows[:KL_ROWS])
    attns = [layer.self_attn for layer in converted.backbone.layers]
    per_layer = [_trainable(attn) for attn in attns]
    params = [p for layer_params, _ in per_layer for p in layer_params]
    trained = {id(p) for p in params}
    for p in converted.parameters():
        p.requires_grad_(id(p) in trained)
    warm = max(1, steps // 10)
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    try:
        for step in range(steps):
            progress(f"mla model distill {step + 1}/{steps}")
            row = rows[step % rows.shape[0]]
            with torch.no_grad():
                teacher = log_probs(source, row)
            with torch.enable_grad():
                loss = _kl(teacher, log_probs(converted, row))
                opt.zero_grad(set_to_none=False)
                loss.backward()
            for attn, (_, constant) in zip(attns, per_layer):
                attn.kv_a_proj_with_mqa.weight.grad[constant] = 0.0
            opt.step()
            sched.step()
    finally:
        for p in params:
            p.requires_grad_(False)
        for attn in attns:
            attn._absorbed = None  # derived from kv_b_proj, which changed
    return ModelFit(before, mean_kl(source, converted, rows[:KL_ROWS]), steps, int(rows.shape[0]))
