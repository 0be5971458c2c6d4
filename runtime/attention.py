"""The attention call a model makes, and the metadata that describes a flat batch.

Models run on a *flat batch*: the new tokens of every sequence concatenated into one
`[num_tokens]` vector, with `positions` giving each token's absolute position. A model
never sees padding and never knows whether a token is a prompt token or a decode token;
`AttentionMetadata` says where each sequence's new tokens start and how much context each
sequence already has. The attention backend owns the KV history: the dense backend here
keeps nothing (every call sees whole sequences), the contiguous-cache backend keeps one
growing buffer per sequence, and the engine's paged backend (kernels/) stores K/V in
fixed-size blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention layer."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # multiplies q·k
    sliding_window: int | None = None  # key j visible to query i iff i - j < window
    logit_softcap: float | None = None  # tanh soft-capping of scores (Gemma 2 style)


@dataclass
class AttentionMetadata:
    """Layout of a flat batch of B sequences and T new tokens.

    query_start_loc: [B + 1] int64, sequence b's new tokens are rows
                     query_start_loc[b] : query_start_loc[b + 1] of q/k/v.
    context_lens:    [B] int64, tokens of sequence b already held by the backend
                     (0 when the backend keeps no history).
    seq_ids:         per-sequence keys a caching backend uses to find its history.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    seq_ids: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.query_start_loc.numel() - 1)

    @classmethod
    def single(cls, num_tokens: int, context_len: int = 0, seq_id: int = 0) -> "AttentionMetadata":
        return cls(
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int64),
            context_lens=torch.tensor([context_len], dtype=torch.int64),
            seq_ids=(seq_id,),
        )

    @classmethod
    def from_lengths(
        cls, query_lens: list[int], context_lens: list[int] | None = None,
        seq_ids: tuple[int, ...] = (),
    ) -> "AttentionMetadata":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        ctx = context_lens if context_lens is not None else [0] * len(query_lens)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int64),
            context_lens=torch.tensor(ctx, dtype=torch.int64),
            seq_ids=seq_ids or tuple(range(len(query_lens))),
        )


class AttentionBackend(Protocol):
    """What a model calls once per attention layer per forward pass."""

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], after k-norm and RoPE
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of q
        ...


def causal_attention(
    spec: AttentionSpec,
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D] whole context, Tk >= Tq; q are the last Tq positions
    v: torch.Tensor,  # [Tk, Hkv, D]
) -> torch.Tensor:  # [Tq, Hq, D]
    """Attention of the last Tq positions of one sequence over its Tk-token context.

    Computed in fp32 (or the input dtype if wider) with an explicit mask; it is the
    reference that paged kernels are checked against.
    """
    tq, tk = q.shape[0], k.shape[0]
    group = spec.num_heads // spec.num_kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(compute).transpose(0, 1)  # [Hq, Tq, D]
    kf = k.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * spec.scale  # [Hq, Tq, Tk]
    if spec.logit_softcap is not None:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    q_pos = torch.arange(tk - tq, tk).unsqueeze(1)  # [Tq, 1]
    k_pos = torch.arange(tk).unsqueeze(0)  # [1, Tk]
    visible = k_pos <= q_pos
    if spec.sliding_window is not None:
        visible = visible & (q_pos - k_pos < spec.sliding_window)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = F.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)  # [Hq, Tq, D]
    return out.transpose(0, 1).to(q.dtype)


def batched_causal_attention(
    spec: AttentionSpec,
    q: torch.Tensor,  # [B * L, Hq, D]: B whole sequences of L tokens, one after another
    k: torch.Tensor,  # [B * L, Hkv, D]
    v: torch.Tensor,  # [B * L, Hkv, D]
    length: int,
) -> torch.Tensor:  # [B * L, Hq, D], dtype of q
    """causal_attention of B sequences of one length in one fused call (torch's
    scaled_dot_product_attention, fp32 or wider like the reference, no [L, L] score tensor
    per head in memory); the same values up to fp32 rounding order. No soft-cap: callers
    use causal_attention for that."""
    b = q.shape[0] // length
    compute = torch.promote_types(q.dtype, torch.float32)

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B * L, H, D] -> [B, H, L, D]
        return x.to(compute).reshape(b, length, x.shape[1], x.shape[2]).transpose(1, 2)

    mask = None
    if spec.sliding_window is not None:
        pos = torch.arange(length)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)  # [L, L]: query - key position
        mask = (diff >= 0) & (diff < spec.sliding_window)
    out = F.scaled_dot_product_attention(
        heads(q), heads(k), heads(v), attn_mask=mask, is_causal=mask is None,
        scale=spec.scale, enable_gqa=spec.num_heads != spec.num_kv_heads)  # [B, Hq, L, D]
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype)


class DenseAttention:
    """No KV history: every sequence in the batch is given whole (context_lens == 0).
    Runs of sequences of one length (calibration batches) go through one fused call."""

    def forward(self, spec, q, k, v, meta):
        if int(meta.context_lens.sum()) != 0:
            raise ValueError("DenseAttention keeps no KV history; context_lens must be 0.")
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        b = 0
        while b < meta.num_seqs:
            s, e = starts[b], starts[b + 1]
            n = e - s
            last = b + 1  # the run of sequences of this length from b
            while last < meta.num_seqs and starts[last + 1] - starts[last] == n:
                last += 1
            if n > 0 and spec.logit_softcap is None:
                end = starts[last]
                out[s:end] = batched_causal_attention(spec, q[s:end], k[s:end], v[s:end], n)
            elif n > 0:
                for i in range(b, last):
                    s, e = starts[i], starts[i + 1]
                    out[s:e] = causal_attention(spec, q[s:e], k[s:e], v[s:e])
            b = last
        return out


class ContiguousCacheAttention:
    """Keeps each sequence's K/V in one growing tensor per layer, keyed by seq id.

    A simple cache for generation before the paged engine: appending is a `torch.cat`,
    so it is meant for short runs (tests, the reference generate loop), not serving.
    """

    def __init__(self) -> None:
        # (seq_id, layer_idx) -> (k [L, Hkv, D], v [L, Hkv, D])
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def free(self, seq_id: int) -> None:
        for key in [key for key in self._kv if key[0] == seq_id]:
            del self._kv[key]

    def cached_len(self, seq_id: int, layer_idx: int = 0) -> int:
        kv = self._kv.get((seq_id, layer_idx))
        return 0 if kv is None else kv[0].shape[0]

    def forward(self, spec, q, k, v, meta):
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        ctx = meta.context_lens.tolist()
        for b, seq_id in enumerate(meta.seq_ids):
            s, e = starts[b], starts[b + 1]
            key = (seq_id, spec.layer_idx)
            old = self._kv.get(key)
            have = 0 if old is None else old[0].shape[0]
            if have != ctx[b]:
                raise ValueError(
                    f"sequence {seq_id}: backend holds {have} tokens, metadata says {ctx[b]}."
                )
            if old is None:
                kk, vv = k[s:e].clone(), v[s:e].clone()
            else:
                kk, vv = torch.cat([old[0], k[s:e]]), torch.cat([old[1], v[s:e]])
            self._kv[key] = (kk, vv)
            if e > s:
                out[s:e] = causal_attention(spec, q[s:e], kk, vv)
        return out
