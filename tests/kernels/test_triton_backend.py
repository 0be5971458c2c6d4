"""The engine's PagedAttentionBackend on the Triton kernels (forced through
kernels/dispatch.py, interpreted on CPU) against the same backend on the torch path.

Steps: a chunked prefill of two sequences, the rest of one prompt beside a decode, then
decodes, over an FP8 cache with per-head scales and a sliding window, in inference mode
(as the model runner runs: inference tensors, no version counters). After every step
the pools must hold the same bytes and the outputs agree within 1e-5 of max |out|
(fp32: both paths compute the same attention over the same bytes).
"""

from __future__ import annotations

import torch

from qserve.kernels import dispatch
from qserve.runtime.attention import AttentionSpec
from qserve.runtime.kv_cache import KVCache, KVCacheSpec
from qserve.runtime.paged_attention_backend import PagedAttentionBackend, PagedAttentionMetadata

HKV, HQ, D, BS = 2, 6, 16, 4


def _cache():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=BS)
    scales = {0: (torch.rand(HKV) * 0.02 + 0.01, torch.rand(HKV) * 0.02 + 0.01)}
    return KVCache(spec, 16, scales)


def test_backend_steps_match_torch_path(seed, monkeypatch):
    spec = AttentionSpec(0, HQ, HKV, D, D ** -0.5, sliding_window=7)
    caches = {"torch": _cache(), "triton": _cache()}
    scales = caches["torch"].layer(0)
    caches["triton"].layers[0] = caches["triton"].layer(0)._replace(
        k_scale=scales.k_scale, v_scale=scales.v_scale)
    tables = [[5, 2, 9, 0], [11, 3, 7]]
    # (query_lens, context_lens) per step
    steps = [([6, 3], [0, 0]), ([4, 1], [6, 3]), ([1, 1], [10, 4]), ([1, 1], [11, 5])]
    for qlens, ctx in steps:
        with torch.inference_mode():  # as the model runner builds and calls it
            meta = PagedAttentionMetadata.build(qlens, ctx, tables, BS)
            t = sum(qlens)
            q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
            outs = {}
            for name, cache in caches.items():
                monkeypatch.setenv(dispatch.ENV_VAR, name)
                outs[name] = PagedAttentionBackend(cache, decode_impl="eager").forward(
                    spec, q, k, v, meta)
        a, b = caches["torch"].layer(0), caches["triton"].layer(0)
        assert torch.equal(a.k_pool.view(torch.uint8), b.k_pool.view(torch.uint8))
        assert torch.equal(a.v_pool.view(torch.uint8), b.v_pool.view(torch.uint8))
        err = (outs["triton"] - outs["torch"]).abs().max() / outs["torch"].abs().max()
        assert float(err) <= 1e-5, f"step {qlens}/{ctx}: relative difference {float(err):.2e}"
