"""Self-attention of a decoder layer: projections, optional q/k norm, RoPE, backend call.

The attention math itself belongs to the backend (runtime/attention.py, kernels/); this
module only prepares q, k, v for it on a flat batch and projects the result back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata, AttentionSpec
from .norm import RMSNorm
from .rotary import apply_rotary


class SelfAttention(nn.Module):
    """q_proj/k_proj/v_proj/o_proj are separate nn.Linear modules with HF names, so a
    quantization pass can swap each for an FP8 linear; `spec` is built once here."""

    def __init__(self, cfg, layer_idx: int, norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.spec = AttentionSpec(
            layer_idx=layer_idx,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            scale=cfg.attn_scale,
            sliding_window=cfg.sliding_windows[layer_idx],
            logit_softcap=cfg.attn_logit_softcap,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj: nn.Module | None = None  # q|k|v in one linear (runtime/layers/fusion.py)
        self.qkv_sizes = (q_size, kv_size, kv_size)
        if cfg.qk_norm:  # one norm over head_dim, shared by all heads (Qwen 3, Gemma 3)
            self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden] model dtype
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, head_dim] model dtype
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        t = hidden.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(self.spec, q, k, v, meta)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
