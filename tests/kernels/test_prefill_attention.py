"""The C prefill attention kernel against a float64 reference.

Shapes cross its tile edges: 32 queries per work item, key blocks of 32 (AVX-512) or 16
(AVX2 and portable builds) keys, row tiles of 6/4 (q.k) and 4/3 (p.v) rows, 64 (32)
columns per p.v tile, so head sizes of 80 and 192 leave a tail. CI runs this file again as
an AVX2 machine (QSERVE_CPU_CLASS=avx2), which builds the 8-lane variant.
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels import paged_attention as pa
from qserve.kernels.native_prefill_attention import native_prefill_attention


@pytest.fixture(autouse=True)
def _require_compile(monkeypatch):
    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")  # a failed build fails, not skips


def _reference(q, k, v, v_scale, window):  # float64 [Tq, Hq, D]
    tq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    qi = torch.arange(lk - tq, lk)[:, None]
    kj = torch.arange(lk)[None]
    visible = kj <= qi
    if window is not None:
        visible &= qi - kj < window
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1))
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    out = torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, 1))
    return out * v_scale.double().repeat_interleave(g)[None, :, None]


# (queries, keys, q heads, kv heads, head size, window)
CASES = [
    (1, 1, 9, 3, 64, None),      # one token
    (5, 5, 9, 3, 64, None),      # a fresh short prompt
    (31, 33, 9, 3, 64, None),    # a chunk after a 2-token prefix, just under a tile
    (33, 97, 9, 3, 64, None),    # just over a tile, keys ending mid-block
    (64, 64, 4, 1, 256, None),   # Gemma-like: one kv head of 256
    (70, 300, 14, 2, 64, None),  # groups of 7 (Qwen2.5-0.5B's 14 over 2)
    (40, 77, 8, 2, 80, None),    # a head size with a tail past the p.v tiles
    (50, 120, 4, 4, 192, None),  # MHA with a latent-sized head
    (100, 150, 9, 3, 64, 16),    # a window shorter than a key block
    (65, 200, 6, 2, 64, 33),     # a window across tiles and blocks
    (20, 20, 6, 2, 64, 1),       # each query sees only itself
]


@pytest.mark.parametrize("tq,lk,hq,hkv,d,window", CASES)
def test_matches_float64_reference(tq, lk, hq, hkv, d, window):
    torch.manual_seed(tq * 1000 + lk)
    q = torch.randn(tq, hq, d) * 0.5
    k, v = torch.randn(lk, hkv, d), torch.randn(lk, hkv, d)
    v_scale = torch.rand(hkv) + 0.5
    out = native_prefill_attention(q, k, v, v_scale, window)
    ref = _reference(q, k, v, v_scale, window)
    assert out.dtype == torch.float32 and out.shape == (tq, hq, d)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-5, f"relative error {float(err):.2e}"


def test_large_scores_do_not_overflow():
    """Scores in the hundreds (the online softmax rescales as the max grows; a plain exp
    would overflow), with the largest scores on the last keys."""
    torch.manual_seed(1)
    q = torch.randn(48, 4, 64) * 4
    k = torch.randn(96, 2, 64) * torch.linspace(0.5, 6, 96)[:, None, None]
    v = torch.randn(96, 2, 64)
    out = native_prefill_attention(q, k, v, torch.ones(2), None)
    ref = _reference(q, k, v, torch.ones(2), None)
    assert torch.isfinite(out).all()
    # scores reach ~700: their own fp32 rounding (~700 * 2^-24 per term) moves the weights
    assert (out.double() - ref).abs().max() / ref.abs().max() <= 5e-5


def test_same_bits_on_any_thread_count():
    """Work items (kv head, tile of queries) are independent: threads change no bit."""
    torch.manual_seed(2)
    q, k, v = torch.randn(200, 9, 64), torch.randn(260, 3, 64), torch.randn(260, 3, 64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_prefill_attention(q, k, v, torch.ones(3), 40)
        torch.set_num_threads(2)
        two = native_prefill_attention(q, k, v, torch.ones(3), 40)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@pytest.mark.parametrize("q_shape,k_shape,v_shape,window,match", [
    ((4, 9, 64), (8, 2, 64), (8, 2, 64), None, "multiple of Hkv"),
    ((9, 9, 64), (8, 3, 64), (8, 3, 64), None, "1 <= Tq <= Lk"),
    ((4, 9, 64), (8, 3, 32), (8, 3, 32), None, "k = v"),
    ((4, 9, 64), (8, 3, 64), (9, 3, 64), None, "k = v"),
    ((4, 9, 64), (8, 3, 64), (8, 3, 64), 0, "window must be >= 1"),
])
def test_bad_shapes_are_refused(q_shape, k_shape, v_shape, window, match):
    with pytest.raises(ValueError, match=match):
        native_prefill_attention(torch.randn(q_shape), torch.randn(k_shape),
                                 torch.randn(v_shape), torch.ones(k_shape[1]), window)


def test_paged_prefill_chunks_use_it_and_softcap_keeps_sdpa(monkeypatch):
    """The default prefill path (the paged path's long chunks) calls the kernel on the
    gathered context; with a logit softcap it takes the SDPA path, which the kernel has no
    cap for."""
    calls = []
    real = pa.native_prefill_attention
    monkeypatch.setattr(pa, "native_prefill_attention",
                        lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    bs, hkv, d, n = 16, 2, 64, 40
    kp = (torch.randn(4, bs, hkv, d) * 0.1).to(torch.float8_e4m3fn)
    vp = (torch.randn(4, bs, hkv, d) * 0.1).to(torch.float8_e4m3fn)
    q = torch.randn(n, 6, d)
    args = (q, kp, vp, torch.tensor([[2, 0, 3, 1]]), torch.tensor([0, n]), torch.tensor([50]),
            torch.tensor([0.5]), torch.tensor([0.25]), d ** -0.5)
    ref = pa.paged_attention_reference(*args)
    out = pa.paged_attention(*args)
    assert calls == [n]
    assert (out.double() - ref).abs().max() / ref.abs().max() <= 2e-5
    calls.clear()
    capped = pa.paged_attention(*args, None, 30.0)
    assert calls == []
    ref = pa.paged_attention_reference(*args, None, 30.0)
    assert (capped.double() - ref).abs().max() / ref.abs().max() <= 2e-5
