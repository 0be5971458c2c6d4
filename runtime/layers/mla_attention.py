"""Multi-head latent attention (MLA, DeepSeek-V2/V3): one cached vector per token and layer.

Per token the layer caches c_kv (R = kv_lora_rank values, after kv_a_layernorm) and the
RoPE key k_pe (P values, shared by all heads): R + P values instead of 2 x heads x dims.
The per-head keys and values are up-projections of c_kv by kv_b_proj = [W_UK; W_UV]:

    k_h = [W_UK,h c_kv ; k_pe]       v_h = W_UV,h c_kv

Two equal ways to compute attention (both checked against transformers in tests):
- expanded (whole sequences, no KV history: calibration, reference): build k_h, v_h per
  head and run ordinary attention;
- absorbed (any backend that keeps history, i.e. the engine): fold W_UK into the query,
  q~_h = [W_UK,h^T q_nope,h ; q_pe,h], so scores are q~_h . [c_kv ; k_pe]: multi-query
  attention over the cached vector, whose first R values are also the "value"; W_UV is
  applied to the R-wide result. The backend sees one kv head of width R + P and is given
  the same tensor as key and value; the layer keeps the first R outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata, AttentionSpec, DenseAttention
from .norm import RMSNorm
from .rotary import apply_rotary, apply_rotary_interleaved


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear's weight [out, in] as real values (an FP8 linear's bytes times its scale)."""
    scale = getattr(linear, "weight_scale", None)
    w = linear.weight
    return w if scale is None else (w.float() * scale.float()).to(w.dtype)


class MLAAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        m = cfg.mla
        self.num_heads = h = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank = m.kv_lora_rank
        self.rope_heads = m.rope_heads  # the RoPE key as this many keys of one table
        self.rotate = apply_rotary_interleaved if m.rope_interleave else apply_rotary
        bias = cfg.qkv_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, h * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, m.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, cfg.hidden_size, bias=cfg.o_bias)
        # The engine's view: multi-query attention over the cached vector.
        self.spec = AttentionSpec(layer_idx=layer_idx, num_heads=h, num_kv_heads=1,
                                  head_dim=m.cache_dim, scale=m.softmax_scale)
        width = max(m.qk_head_dim, m.v_head_dim)  # expanded heads, padded to one width
        self.expanded_spec = AttentionSpec(layer_idx=layer_idx, num_heads=h, num_kv_heads=h,
                                           head_dim=width, scale=m.softmax_scale)
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        # Set by calibration: the absorbed path never runs kv_b_proj as a linear, but the
        # artifact needs its input scale (an engine that expands prefill runs it), so it
        # is run on c_kv for its hooks to observe, the product unused.
        self.calibrating = False

    def prepare(self) -> None:
        """Compute the absorbed up-projections now (before the linears are packed)."""
        self.absorbed()

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV^T [H, R, v]) in the weight's dtype, computed once."""
        if self._absorbed is None:
            w = dense_weight(self.kv_b_proj).view(self.num_heads, self.nope + self.v_dim,
                                                  self.rank)
            self._absorbed = (w[:, :self.nope].contiguous(),
                              w[:, self.nope:].transpose(1, 2).contiguous())
        return self._absorbed

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        # hidden [T, hidden]; rope: cos, sin [T, P] -> [T, hidden]
        t, h = hidden.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, h, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]  # [T, H, N], [T, H, P]
        kv = self.kv_a_proj_with_mqa(hidden)  # [T, R + P]
        c_kv = self.kv_a_layernorm(kv[:, :self.rank])  # [T, R]
        cos, sin = rope  # [T, P / rope_heads]
        rh = self.rope_heads
        q_pe = self.rotate(q_pe.reshape(t, h * rh, -1), cos, sin).view(t, h, self.rope_dim)
        k_pe = self.rotate(kv[:, self.rank:].reshape(t, rh, -1), cos, sin)
        k_pe = k_pe.reshape(t, 1, self.rope_dim)  # [T, 1, P]
        if self.calibrating:
            self.kv_b_proj(c_kv)
        if type(attn) is DenseAttention:
            out = self._expanded(q_nope, q_pe, c_kv, k_pe, meta, attn)  # [T, H, V]
        else:
            out = self._absorbed_attention(q_nope, q_pe, c_kv, k_pe, meta, attn)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _absorbed_attention(self, q_nope, q_pe, c_kv, k_pe, meta, attn) -> torch.Tensor:
        w_uk, w_uv_t = self.absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype))  # [H, T, R]
        q_full = torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1)  # [T, H, R + P]
        latent = torch.cat((c_kv, k_pe[:, 0]), dim=-1).unsqueeze(1)  # [T, 1, R + P]
        ctx = attn.forward(self.spec, q_full, latent, latent, meta)[..., :self.rank]  # [T,H,R]
        return torch.bmm(ctx.transpose(0, 1), w_uv_t.to(ctx.dtype)).transpose(0, 1)  # [T,H,V]

    def _expanded(self, q_nope, q_pe, c_kv, k_pe, meta, attn) -> torch.Tensor:
        t, h = c_kv.shape[0], self.num_heads
        kv = self.kv_b_proj(c_kv).view(t, h, self.nope + self.v_dim)
        k = torch.cat((kv[..., :self.nope], k_pe.expand(t, h, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, N + P]
        v = kv[..., self.nope:]  # [T, H, V]
        width = self.expanded_spec.head_dim  # zero padding changes no dot product

        def pad(x: torch.Tensor) -> torch.Tensor:
            return nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x

        return attn.forward(self.expanded_spec, pad(q), pad(k), pad(v), meta)[..., :self.v_dim]
