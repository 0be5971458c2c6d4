"""SmoothQuant-style smoothing: move activation range into the weights, exactly.

For a linear y = W x whose input has a few large channels, pick a factor per input
channel j and rewrite

    y = (W diag(s)) (x / s),     s_j = max|x_j|^alpha / max_i |W_ij|^(1 - alpha)

The division by s is folded into the op that *produces* x, so the model computes the same
function and the artifact stays a plain FP8 checkpoint (no extra op at run time):

    target    consumers         producer (folds 1/s)
    qkv       q, k, v_proj      input_layernorm weight
    gate_up   gate, up_proj     the norm before the MLP (pre_feedforward_layernorm in
                                Gemma 3, post_attention_layernorm in Llama)
    o         o_proj            v_proj output rows (and bias)
    down      down_proj         up_proj output rows (and bias)

o_proj's input is attention-weighted V, one slice per query head; query heads that share
a KV head (GQA) read the same V rows, so their factors are taken equal: one factor per KV
channel, computed from the max over the group, repeated for each query head.

Norm weights fold by the norm's own convention, by registry: Llama's RMSNorm scales by
w (w' = w / s), Gemma's by (1 + w) (w' = (1 + w) / s - 1); the consumers then get the
factor the stored (rounded) norm weight actually realises, so the fold stays exact.
All folding is computed in float32 and cast back to each parameter's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..runtime.layers.norm import GemmaRMSNorm, RMSNorm
from ..runtime.formats.errors import QserveError

SMOOTHING_TARGETS = ("qkv", "gate_up", "o", "down")
MIN_AMAX = 1e-5  # floor for channel maxima (a dead channel gets a finite factor)

# norm class -> (gain(w), weight_for(gain)): the per-channel multiplier a norm applies,
# and the stored weight that gives a wanted multiplier (fp32 [dim] both ways).
NORM_GAINS: dict[type[nn.Module], tuple[Callable[[torch.Tensor], torch.Tensor],
                                        Callable[[torch.Tensor], torch.Tensor]]] = {
    RMSNorm: (lambda w: w, lambda g: g),
    GemmaRMSNorm: (lambda w: 1.0 + w, lambda g: g - 1.0),
}


class SmoothingError(QserveError):
    """A block cannot be smoothed (unknown norm kind, missing module)."""


@dataclass(frozen=True)
class SmoothGroup:
    """Linears reading one input, and the module whose output that input is."""

    target: str  # one of SMOOTHING_TARGETS
    producer: str  # module name inside the block (a norm, or v_proj / up_proj)
    consumers: tuple[str, ...]  # linear names inside the block, same input


def smooth_groups(block: nn.Module, targets: tuple[str, ...] = SMOOTHING_TARGETS
                  ) -> list[SmoothGroup]:
    """The groups of a Llama-family or Gemma 3 decoder block, in `targets` order."""
    mlp_norm = ("pre_feedforward_layernorm" if hasattr(block, "pre_feedforward_layernorm")
                else "post_attention_layernorm")
    table = {
        "qkv": SmoothGroup("qkv", "input_layernorm",
                           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        "gate_up": SmoothGroup("gate_up", mlp_norm, ("mlp.gate_proj", "mlp.up_proj")),
        "o": SmoothGroup("o", "self_attn.v_proj", ("self_attn.o_proj",)),
        "down": SmoothGroup("down", "mlp.up_proj", ("mlp.down_proj",)),
    }
    return [table[t] for t in targets]


def smoothing_factors(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float
                      ) -> torch.Tensor:
    """s [in] fp32 = act_amax^alpha / weight_amax^(1 - alpha), both [in], floored."""
    a = act_amax.float().clamp(min=MIN_AMAX)
    w = weight_amax.float().clamp(min=MIN_AMAX)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=MIN_AMAX)


def _weight_amax(linears: list[nn.Linear]) -> torch.Tensor:
    """Per input channel max |W| over all consumers: [in] fp32."""
    return torch.stack([m.weight.detach().float().abs().amax(0) for m in linears]).amax(0)


def _scale_param(module: nn.Module, name: str, fn) -> None:
    p = getattr(module, name)
    new = fn(p.detach().float()).to(p.dtype)
    setattr(module, name, nn.Parameter(new, requires_grad=False))


def _fold_into_norm(norm: nn.Module, s: torch.Tensor) -> torch.Tensor:
    """Divide the norm's gain by s; returns the factor the *stored* weight realises.

    The weight is stored in its own dtype (bf16): Gemma's (1 + w) / s - 1 near -1 loses
    most of its bits there, so the consumers are scaled by gain(w) / gain(w'), which makes
    the fold exact for the weight as stored. Channels whose stored gain would vanish or
    flip sign keep s = 1."""
    if type(norm) not in NORM_GAINS:
        raise SmoothingError(f"cannot fold smoothing factors into a {type(norm).__name__}; "
                             f"known norms: {', '.join(c.__name__ for c in NORM_GAINS)}. "
                             "Turn smoothing off in the recipe (smoothing: {enabled: false}).")
    gain, weight_for = NORM_GAINS[type(norm)]
    w = norm.weight.detach()
    g = gain(w.float())  # [dim] fp32
    new_w = weight_for(g / s).to(w.dtype)
    new_g = gain(new_w.float())
    bad = (new_g == 0) | (torch.sign(new_g) != torch.sign(g))
    new_w = torch.where(bad, w, new_w)
    s_eff = torch.where(bad, torch.ones_like(s), g / torch.where(bad, g, new_g))
    norm.weight = nn.Parameter(new_w, requires_grad=False)
    return s_eff


def _fold_into_rows(linear: nn.Linear, s: torch.Tensor) -> None:
    """Divide output rows (and bias) by s [out]."""
    _scale_param(linear, "weight", lambda w: w / s[:, None])
    if linear.bias is not None:
        _scale_param(linear, "bias", lambda b: b / s)


def _scale_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    _scale_param(linear, "weight", lambda w: w * s[None, :])


def smooth_group(block: nn.Module, group: SmoothGroup, act_amax: torch.Tensor,
                 alpha: float) -> torch.Tensor:
    """Fold factors for `group` into `block` (mutates). act_amax: [in] per-channel max |x|
    of the consumers' input, measured on the block as it is now. Returns s [in] fp32."""
    consumers = [block.get_submodule(c) for c in group.consumers]
    producer = block.get_submodule(group.producer)
    w_amax = _weight_amax(consumers)  # [in]
    if group.target == "o":
        attn = block.self_attn
        g, d = attn.num_heads // attn.num_kv_heads, attn.head_dim
        # [H*D] -> [Hkv, g, D]: query heads h*g..h*g+g-1 read KV head h
        per_kv = lambda t: t.float().reshape(attn.num_kv_heads, g, d).amax(1)  # [Hkv, D]
        s_kv = smoothing_factors(per_kv(act_amax), per_kv(w_amax), alpha)  # [Hkv, D]
        _fold_into_rows(producer, s_kv.reshape(-1))
        s = s_kv[:, None, :].expand(-1, g, -1).reshape(-1)  # [H*D]
    else:
        s = smoothing_factors(act_amax, w_amax, alpha)
        if isinstance(producer, nn.Linear):
            _fold_into_rows(producer, s)
        else:
            s = _fold_into_norm(producer, s)
    for c in consumers:
        _scale_columns(c, s)
    return s


def smooth_block(block: nn.Module, run_block: Callable[[], None], alpha: float,
                 targets: tuple[str, ...] = SMOOTHING_TARGETS) -> dict[str, torch.Tensor]:
    """Measure the per-channel input maxima of each group's consumers by calling
    `run_block()` (runs calibration data through `block`) once, then fold the factors in.
    Mutates `block`; returns {target: s [in] fp32}."""
    from ..calib.hooks import ActivationRecorder
    from ..calib.observers import make_observer

    groups = smooth_groups(block, targets)
    first = {}
    for g in groups:
        try:
            first[g.target] = block.get_submodule(g.consumers[0])
            block.get_submodule(g.producer)
        except AttributeError as e:
            raise SmoothingError(f"{type(block).__name__} has no module for smoothing target "
                                 f"{g.target!r} ({e}); remove it from smoothing.targets.") from None
    with ActivationRecorder(first, lambda _: make_observer("minmax", dim=1)) as rec:
        run_block()
    amax = {t: rec.observers[t].amax() for t in first}  # [in] fp32 each
    return {g.target: smooth_group(block, g, amax[g.target], alpha) for g in groups}
