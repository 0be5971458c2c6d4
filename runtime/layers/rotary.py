"""Rotary position embedding (RoPE), with the 'linear' and 'llama3' frequency scalings.

Frequencies follow transformers' modeling_rope_utils exactly, so logits match it in fp32.
The rotation is the "rotate half" convention of HF checkpoints (not interleaved pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels import native_rotary

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


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


class RotaryEmbedding(nn.Module):
    """Maps positions to (cos, sin) tables; `apply_rotary` rotates q or k with them."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
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
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.rope}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D] -> [T, H, D]
    if native_rotary.usable(x, cos, sin):  # bf16 on CPU: one C call, the same bits
        return native_rotary.rotary_bf16(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
