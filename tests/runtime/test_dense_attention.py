"""DenseAttention's fused path for runs of equal-length sequences against the reference
causal_attention (float64 for the values, the reference for the layout)."""

import pytest
import torch

from qserve.runtime.attention import (AttentionMetadata, AttentionSpec, DenseAttention,
                                      batched_causal_attention, causal_attention)


def _spec(window=None, softcap=None, hq=6, hkv=2, d=16):
    return AttentionSpec(layer_idx=0, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                         scale=d ** -0.5, sliding_window=window, logit_softcap=softcap)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hkv", [6, 2])
def test_batched_equals_the_reference_per_sequence_in_float64(window, hkv):
    torch.manual_seed(0)
    spec, length, b = _spec(window, hkv=hkv), 23, 3
    q = torch.randn(b * length, 6, 16, dtype=torch.float64)
    k = torch.randn(b * length, hkv, 16, dtype=torch.float64)
    v = torch.randn(b * length, hkv, 16, dtype=torch.float64)
    got = batched_causal_attention(spec, q, k, v, length)
    want = torch.cat([causal_attention(spec, q[i * length:(i + 1) * length],
                                       k[i * length:(i + 1) * length],
                                       v[i * length:(i + 1) * length]) for i in range(b)])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_dense_attention_mixes_runs_of_lengths_and_matches_the_reference(softcap):
    torch.manual_seed(1)
    spec = _spec(window=4, softcap=softcap)
    lengths = [7, 7, 3, 0, 9, 9, 9, 1]
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 16).bfloat16() for h in (6, 2, 2))
    meta = AttentionMetadata.from_lengths(lengths)
    got = DenseAttention().forward(spec, q, k, v, meta)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    s = 0
    for n in lengths:  # fp32 inside both, one bf16 rounding of the output
        if n:
            want = causal_attention(spec, q[s:s + n], k[s:s + n], v[s:s + n])
            torch.testing.assert_close(got[s:s + n].float(), want.float(), rtol=2**-7, atol=1e-3)
        s += n
