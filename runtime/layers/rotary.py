"""Rotary position embedding (RoPE), with the 'linear', 'llama3' and 'yarn' frequency scalings.

Frequencies follow transformers' modeling_rope_utils exactly, so logits match it in fp32.
The rotation is the "rotate half" convention of HF checkpoints; DeepSeek's checkpoints
rotate interleaved pairs (x0, x1), (x2, x3), ... instead (`apply_rotary_interleaved`).
YaRN also scales cos/sin by an attention factor (`rope_attention_factor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels import native_rotary

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated bands
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: attention factor = mscale(factor, mscale) /
    mscale_all_dim: float | None = None  # mscale(factor, mscale_all_dim) (DeepSeek)
    attention_factor: float | None = None  # yarn: given outright
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions


def rope_inv_freq(head_dim: int, rope: RopeConfig, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # [D/2] fp32
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.type == "yarn":
        return _yarn_scale(inv_freq, head_dim, rope)
    raise ValueError(f"rope type {rope.type!r} is not supported ({', '.join(ROPE_TYPES)})")


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the middle band interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos/sin are multiplied by: 1 except for YaRN."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_scale(inv_freq: torch.Tensor, dim: int, rope: RopeConfig) -> torch.Tensor:
    # Dimensions that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times kept,
    # a linear ramp between.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """Maps positions to (cos, sin) tables; `apply_rotary` rotates q or k with them."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.attention_factor = rope_attention_factor(rope)
        # Derived from the config, never read from a checkpoint (not in the state dict).
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def reset_buffers(self, device=None) -> None:
        """Recompute inv_freq in fp32, e.g. after the model was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope, device=device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, D] in `dtype` (computed in fp32, then cast)
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # [T, D/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D] fp32
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.rope}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D] -> [T, H, D]
    if native_rotary.usable(x, cos, sin):  # bf16 on CPU: one C call, the same bits
        return native_rotary.rotary_bf16(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                             ) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), output in
    the halves layout [rotated evens | rotated odds], as transformers returns it; q and k
    both go through it, so their dot products are those of the interleaved rotation.
    x: [T, H, D]; cos, sin: [T, D] (the halves tables of RotaryEmbedding) -> [T, H, D]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
