"""Triton paged attention (decode, split-KV decode, prefill/extend) against the float64
paged_attention_reference, under the Triton interpreter (tests/kernels/conftest.py).

Bounds, max |out - ref| / max |ref| (the reference reads the same FP8 bytes and
dequantizes them in float64, so this measures the attention math only):
  fp32 q:        1e-5  (fp32 tiles, exact-fp32 dots)
  bf16 q:        5e-3  (half a bf16 ulp of the output is up to 2**-8 = 3.9e-3 relative)
Fresh random inputs every run (seed printed); `out` NaN-poisoned; pools full of large
finite garbage outside the stored tokens; block tables shuffled, strided, -1 padded.
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels import dispatch
from qserve.kernels.fp8 import FP8_DTYPE
from qserve.kernels.kv_store import store_kv
from qserve.kernels.paged_attention import paged_attention_reference
from qserve.kernels.triton_paged_attention import choose_num_splits, paged_attention_triton

BOUND = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
# (query_len, cached_len): prefill chunk over a cached prefix, decodes at / across block
# boundaries, a one-token sequence, empty sequences, a fresh prefill, a decode of 2.
MIXED = [(5, 20), (1, 16), (1, 0), (0, 0), (1, 31), (9, 0), (0, 7), (1, 6)]


def paged_case(pool, q_dtype, hkv, group, lens, block_size=4, d=16, per_head=False):
    """Positional args of paged_attention up to `scale`. Pools start as garbage
    (0x7E = 448 for FP8, 1e4 for float pools), block ids are shuffled, the table is a
    column-strided view padded with -1."""
    seq_lens = [q + c for q, c in lens]
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + 3
    width = max(need + [1]) + 1
    perm = torch.randperm(num_blocks)
    bt = torch.full((len(lens), 2 * width), -1, dtype=torch.int32)[:, ::2]  # stride 2
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    if pool == "fp8":
        kp = torch.full((num_blocks, block_size, hkv, d), 0x7E, dtype=torch.uint8).view(FP8_DTYPE)
        n = hkv if per_head else 1
        ks, vs = torch.rand(n) * 0.01 + 0.004, torch.rand(n) * 0.01 + 0.004
    else:
        kp = torch.full((num_blocks, block_size, hkv, d), 1e4, dtype=pool)
        ks = vs = None
    vp = kp.clone()
    slots = [int(bt[b, p // block_size]) * block_size + p % block_size
             for b, s in enumerate(seq_lens) for p in range(s)]
    store_kv(torch.randn(len(slots), hkv, d), torch.randn(len(slots), hkv, d), kp, vp,
             torch.tensor(slots, dtype=torch.int64), ks, vs)
    qlens = torch.tensor([q for q, _ in lens], dtype=torch.int64)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)])
    q = torch.randn(int(qlens.sum()), hkv * group, d).to(q_dtype)
    return q, kp, vp, bt, qsl, torch.tensor(seq_lens), ks, vs, d ** -0.5


def check(args, window=None, softcap=None, num_splits=None):
    q = args[0]
    out = torch.full_like(q, float("nan"))
    res = paged_attention_triton(*args, window, softcap, num_splits=num_splits, out=out)
    assert res is out
    ref = paged_attention_reference(*args, window, softcap)
    rows = ~torch.isnan(ref)  # rows of every sequence with new tokens: all of them
    assert bool(rows.all()) and not bool(torch.isnan(out).any())
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err <= BOUND[q.dtype], f"relative error {err:.2e} (splits={num_splits})"


@pytest.mark.parametrize("pool, q_dtype, hkv, group, per_head", [
    ("fp8", torch.float32, 2, 1, False),  # MHA
    ("fp8", torch.bfloat16, 2, 2, True),  # GQA 2, per-head scales
    ("fp8", torch.float32, 2, 3, True),  # GQA 3
    ("fp8", torch.bfloat16, 1, 5, False),  # MQA
    (torch.bfloat16, torch.float32, 2, 3, False),
    (torch.bfloat16, torch.bfloat16, 1, 4, False),
])
def test_mixed_batch_split_off_and_on(seed, pool, q_dtype, hkv, group, per_head):
    args = paged_case(pool, q_dtype, hkv, group, MIXED, per_head=per_head)
    check(args, num_splits=1)
    check(args, num_splits=3)  # some sequences shorter than a split: empty splits


@pytest.mark.parametrize("window", [1, 4, 5, 17, 100])
def test_sliding_window_edges(seed, window):
    # one token, exactly a block, one past a block, the longest context, beyond all
    args = paged_case("fp8", torch.float32, 2, 2, MIXED, per_head=True)
    check(args, window=window, num_splits=2)


def test_softcap_with_window(seed):
    args = list(paged_case("fp8", torch.float32, 1, 4, MIXED))
    args[0] = args[0] * 8  # scores large enough for the cap to matter
    check(tuple(args), softcap=2.0, window=6, num_splits=1)
    check(tuple(args), softcap=2.0, num_splits=4)


def test_long_chunk_over_prefix_and_long_decode(seed):
    # a chunk of 70 new tokens (two 64-row tiles) after a 45-token prefix hit, a decode
    # over 200 tokens split 4 ways (64-token tiles per split), head dim 24 (masked lanes)
    lens = [(70, 45), (1, 199), (1, 1), (2, 0)]
    args = paged_case("fp8", torch.bfloat16, 2, 2, lens, block_size=16, d=24, per_head=True)
    check(args, num_splits=4)
    check(args, window=33, num_splits=None)


def test_metadata_checked_once_per_step_and_again_after_a_change(seed, monkeypatch):
    from qserve.kernels import triton_paged_attention as tpa

    calls = []
    real = tpa._check_step
    monkeypatch.setattr(tpa, "_check_step", lambda *a: calls.append(1) or real(*a))
    args = paged_case("fp8", torch.float32, 2, 2, MIXED, per_head=True)
    check(args)
    check(args)  # the next layer of the same step: same metadata tensors
    assert len(calls) == 1
    args[5][1] -= 1  # in place: sequence 1 now decodes over 16 tokens, not 17
    check(args)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="include the new tokens"):
        args[5][2] -= 1  # a one-token sequence with no context is invalid
        check(args)


def test_split_choice():
    assert choose_num_splits(64, 8, 4096, 132) == 1  # 512 programs fill 132 SMs
    assert choose_num_splits(1, 8, 32768, 132) == 33  # ~2 programs per SM
    assert choose_num_splits(1, 8, 300, 132) == 2  # splits of >= 256 tokens
    assert choose_num_splits(1, 1, 10**6, 132) == 64  # capped


def test_dispatch_routes_and_matches(seed, monkeypatch):
    args = paged_case("fp8", torch.float32, 2, 2, [(3, 5), (1, 9)])
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.backend_for(torch.device("cpu")) == "torch"
    assert dispatch.backend_for(torch.device("cuda")) == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.kernel("paged_attention", torch.device("cpu")) is paged_attention_triton
    via = dispatch.paged_attention(*args, decode_impl="eager")  # decode_impl: torch only
    ref = paged_attention_reference(*args)
    assert float((via.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="QSERVE_KERNELS"):
        dispatch.paged_attention(*args)
    with pytest.raises(ValueError, match="unknown kernel"):
        dispatch.kernel("nope", torch.device("cpu"), "torch")


@pytest.mark.parametrize("case, match", [
    ("short_table", "needs"), ("qsl", "rise from 0"), ("heads", "multiple"),
    ("scale_missing", "required"), ("window", "sliding_window"), ("splits", "num_splits"),
    ("q_stride", "contiguous head dim"), ("out", "out must be"), ("q_dtype", "float32"),
])
def test_bad_input(case, match):
    q, kp, vp, bt, qsl, seq, ks, vs, sc = paged_case("fp8", torch.float32, 2, 2, [(2, 5), (1, 3)])
    kw = dict(num_splits=None, out=None)
    window = None
    if case == "short_table":
        bt = bt[:, :1]
    elif case == "qsl":
        qsl = torch.tensor([0, 2, 4])
    elif case == "heads":
        q = torch.randn(3, 3, q.shape[2])
    elif case == "scale_missing":
        ks = None
    elif case == "window":
        window = 0
    elif case == "splits":
        kw["num_splits"] = 0
    elif case == "q_stride":
        q = torch.randn(q.shape[2], q.shape[1], q.shape[0]).permute(2, 1, 0)
    elif case == "out":
        kw["out"] = torch.empty(q.shape, dtype=torch.bfloat16)
    elif case == "q_dtype":
        q = q.double()
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(q, kp, vp, bt, qsl, seq, ks, vs, sc, window, **kw)


def test_static_decode_equals_the_checked_path_and_refuses_bad_metadata(seed):
    """decode_attention_static (a CUDA graph's attention: the metadata read on the device
    only, splits fixed by the tables' capacity) gives paged_attention_triton's output on a
    decode batch; metadata of the wrong dtype or a table narrower than max_context is
    refused by name."""
    from qserve.kernels.triton_paged_attention import (decode_attention_static,
                                                       paged_attention_triton)

    g = torch.Generator().manual_seed(seed)
    bs, hkv, d, lens = 4, 2, 16, [9, 3, 14]
    k_pool = torch.randn(16, bs, hkv, d, generator=g)
    v_pool = torch.randn(16, bs, hkv, d, generator=g)
    q = torch.randn(len(lens), 4, d, generator=g)
    tables = torch.arange(16, dtype=torch.int32).reshape(len(lens) + 1, 4)[:len(lens)]
    seq = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    rows = torch.arange(len(lens), dtype=torch.int32)
    want = paged_attention_triton(q, k_pool, v_pool, tables, qsl, seq, None, None, 0.25)
    got = decode_attention_static(q, k_pool, v_pool, tables, seq, qsl, rows, None, None, 0.25,
                                  None, None, max_context=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # tables of 256 blocks: capacity 1,024 tokens, 4 splits of 256, all but the first empty
    from qserve.kernels.triton_paged_attention import NOMINAL_SMS, static_splits

    assert static_splits(len(lens), hkv, d, 1024, None, NOMINAL_SMS) == (4, 256)
    wide = torch.zeros(len(lens), 256, dtype=torch.int32)
    wide[:, :4] = tables
    got = decode_attention_static(q, k_pool, v_pool, wide, seq, qsl, rows, None, None, 0.25,
                                  None, None, max_context=1024)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        decode_attention_static(q, k_pool, v_pool, tables, seq.long(), qsl, rows, None, None,
                                0.25, None, None, max_context=16)
    with pytest.raises(ValueError, match="fewer than max_context 32 tokens"):
        decode_attention_static(q, k_pool, v_pool, tables, seq, qsl, rows, None, None, 0.25,
                                None, None, max_context=32)
