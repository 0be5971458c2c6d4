"""paged_attention against its float64 reference on the same (dequantized) cache.

Bounds (max |out - ref| / max |ref|, so they measure only the attention math: the
reference reads the very FP8 bytes the kernel reads and dequantizes them in float64):
  fp32 q (fp8 or bf16 pools): 2e-5   (fp32 accumulation)
  bf16 q:                     2e-2   (bf16 inputs to the matmuls, bf16 output rounding)
Fresh random inputs each run; `out` is poisoned with NaN; unused pool slots hold large
finite garbage; block tables are shuffled and padded with -1 past what a sequence reads.
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels.fp8 import FP8_DTYPE
from qserve.kernels.kv_store import store_kv
from qserve.kernels.paged_attention import (NATIVE_MAX_QUERY_LEN, kernel_scales,
                                            paged_attention, paged_attention_reference)

BOUND = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (query_len, context already cached): a prefill chunk with a cached prefix, decodes at and
# across block boundaries, a one-token sequence, empty sequences, a fresh prefill.
MIXED = [(5, 20), (1, 16), (1, 0), (0, 0), (1, 31), (9, 0), (0, 7), (1, 6)]


def _case(pool_dtype, q_dtype, hkv, group, lens, block_size=4, d=16, per_head=False):
    seq_lens = [q + c for q, c in lens]
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + 5
    width = max(need) + 2
    perm = torch.randperm(num_blocks)
    bt = torch.full((len(lens), width), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    if pool_dtype == "fp8":  # garbage everywhere first: 0x7E is 448, the largest finite
        kp = torch.full((num_blocks, block_size, hkv, d), 0x7E, dtype=torch.uint8).view(FP8_DTYPE)
        n = hkv if per_head else 1
        ks, vs = torch.rand(n) * 0.01 + 0.004, torch.rand(n) * 0.01 + 0.004
    else:
        kp = torch.full((num_blocks, block_size, hkv, d), 1e4, dtype=pool_dtype)
        ks = vs = None
    vp = kp.clone()
    slots = [int(bt[b, p // block_size]) * block_size + p % block_size
             for b, s in enumerate(seq_lens) for p in range(s)]
    k = torch.randn(len(slots), hkv, d)
    v = torch.randn(len(slots), hkv, d)
    store_kv(k, v, kp, vp, torch.tensor(slots, dtype=torch.int64), ks, vs)
    qlens = torch.tensor([q for q, _ in lens])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)])
    q = torch.randn(int(qlens.sum()), hkv * group, d).to(q_dtype)
    return q, kp, vp, bt, qsl, torch.tensor(seq_lens), ks, vs, d ** -0.5


def _check(args, window=None, softcap=None, impl="eager", prefill_impl="native"):
    q = args[0]
    out = torch.full_like(q, float("nan"))
    res = paged_attention(*args, window, softcap, decode_impl=impl, prefill_impl=prefill_impl,
                          out=out)
    assert res is out
    ref = paged_attention_reference(*args, window, softcap)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= BOUND[q.dtype], f"relative error {float(err):.2e}"


IMPLS = ["native", "eager", "chunked", "fused_eager"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_matches_reference(impl, pool, q_dtype, group):
    _check(_case(pool, q_dtype, hkv=2, group=group, lens=MIXED, per_head=group == 3),
           impl=impl)


@pytest.mark.parametrize("window", [1, 4, 5, 17, 100])
@pytest.mark.parametrize("impl", IMPLS)
def test_sliding_window_edges(window, impl):
    # windows of one token, exactly a block, one past it, the longest context, beyond all
    _check(_case("fp8", torch.float32, hkv=2, group=2, lens=MIXED), window=window, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap(impl):
    args = list(_case("fp8", torch.float32, hkv=1, group=4, lens=MIXED))
    args[0] = args[0] * 8  # scores large enough for the cap to matter
    _check(tuple(args), softcap=2.0, window=6, impl=impl)


def test_chunked_decode_across_many_chunks():
    from qserve.kernels import paged_attention as pa

    args = _case("fp8", torch.float32, hkv=2, group=3, lens=[(1, 40), (1, 3), (1, 77)])
    old = pa._DEFAULT_CHUNK_BLOCKS
    try:
        pa._DEFAULT_CHUNK_BLOCKS = 2  # 8-token chunks; fully masked chunks for short ones
        for window in (None, 5):
            _check(args, window=window, impl="chunked")
    finally:
        pa._DEFAULT_CHUNK_BLOCKS = old


def test_compiled_path(monkeypatch):
    """The inductor decode path (the fallback without the native kernel) on a mixed batch;
    one small shape class."""
    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")  # a compile failure fails the test
    args = _case("fp8", torch.bfloat16, hkv=3, group=3, lens=MIXED, block_size=16, d=64)
    _check(args, impl="compiled")


def test_native_is_the_default_and_routes_long_chunks_to_the_prefill_path(monkeypatch):
    """Decodes and short chunks go through the C kernel, chunks longer than
    NATIVE_MAX_QUERY_LEN through the prefill path, in one call; both parts match the
    reference."""
    from qserve.kernels import paged_attention as pa

    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")
    assert pa.default_decode_impl(True) == "native"
    assert pa.default_decode_impl(False) == "native"
    n = pa.NATIVE_MAX_QUERY_LEN
    lens = [(n + 1, 3), (1, 40), (n, 0), (2, 17), (n + 7, 0), (1, 5)]
    for pool in ("fp8", torch.bfloat16):
        args = _case(pool, torch.bfloat16, hkv=3, group=3, lens=lens, block_size=16, d=64)
        _check(args, impl="native")
        _check(args, window=9, impl="native")
    _check(_case("fp8", torch.bfloat16, hkv=3, group=3, lens=lens, block_size=16, d=64))
    calls = []
    real = pa.PREFILL_IMPLS["native"]
    monkeypatch.setitem(pa.PREFILL_IMPLS, "native",
                        lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    _check(_case("fp8", torch.float32, hkv=2, group=2, lens=lens), impl="native")
    assert sorted(calls) == [n + 1, n + 7]  # only the long chunks left the C kernel


@pytest.mark.parametrize("prefill_impl", ["native", "sdpa"])
@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_every_prefill_path_matches_reference(prefill_impl, pool, q_dtype, window):
    """Long chunks (over a cached prefix and fresh) through each PREFILL_IMPLS entry, beside
    decodes, with and without a window."""
    n = NATIVE_MAX_QUERY_LEN
    lens = [(n + 5, 21), (1, 30), (2 * n + 3, 0), (n + 1, 3)]
    _check(_case(pool, q_dtype, hkv=2, group=3, lens=lens, block_size=8, d=32),
           window=window, impl="native", prefill_impl=prefill_impl)


def test_unknown_prefill_impl_is_refused():
    with pytest.raises(ValueError, match="prefill_impl 'flash' unknown"):
        paged_attention(*_case("fp8", torch.float32, hkv=1, group=1, lens=[(3, 0)]),
                        prefill_impl="flash")


@pytest.mark.parametrize("flags, cap, bf16_impl", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "", "sdpa"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "avx2", "native"),
    ({"avx2", "avx512f", "avx512_bf16"}, "", "native"),
    ({"avx2", "fma"}, "", "native"),
])
def test_prompt_attention_is_sdpa_for_bf16_on_amx_and_c_elsewhere(monkeypatch, flags, cap,
                                                                   bf16_impl):
    from qserve.kernels import cpu_class, paged_attention as pa

    monkeypatch.setattr(cpu_class, "detected_flags", lambda: frozenset(flags))
    monkeypatch.setenv(cpu_class.ENV_VAR, cap)
    pa._amx_class.cache_clear()
    try:
        assert pa.default_prefill_impl(torch.bfloat16) == bf16_impl
        assert pa.default_prefill_impl(torch.float32) == "native"
    finally:
        pa._amx_class.cache_clear()


def test_fp16_pools_fall_back_from_native():
    args = _case(torch.float16, torch.float32, hkv=2, group=2, lens=MIXED)
    _check(args, impl="native")  # the C kernel reads E4M3/bf16/fp32: inductor's path runs


def test_int64_tables_and_uint8_pools():
    args = list(_case("fp8", torch.float32, hkv=2, group=2, lens=MIXED))
    ref = paged_attention(*args, decode_impl="eager")
    args[1], args[2] = args[1].view(torch.uint8), args[2].view(torch.uint8)
    args[3] = args[3].to(torch.int64)
    assert torch.equal(paged_attention(*args, decode_impl="eager"), ref)


@pytest.mark.parametrize("case, match", [
    ("short_table", "needs"),
    ("bad_block", "outside"),
    ("seq_short", "include the new tokens"),
    ("qsl", "rise from 0"),
    ("heads", "multiple"),
    ("scale_missing", "required"),
    ("impl", "unknown"),
    ("window", "sliding_window"),
])
def test_bad_input(case, match):
    q, kp, vp, bt, qsl, seq, ks, vs, sc = _case("fp8", torch.float32, 2, 2, [(2, 5), (1, 3)])
    kw = dict(decode_impl="eager")
    window = None
    if case == "short_table":
        bt = bt[:, :1]
    elif case == "bad_block":
        bt[0, 0] = kp.shape[0]
    elif case == "seq_short":
        seq = torch.tensor([1, 4])
    elif case == "qsl":
        qsl = torch.tensor([0, 2, 4])
    elif case == "heads":
        q = torch.randn(3, 3, q.shape[2])
    elif case == "scale_missing":
        ks = None
    elif case == "impl":
        kw["decode_impl"] = "nope"
    elif case == "window":
        window = 0
    with pytest.raises(ValueError, match=match):
        paged_attention(q, kp, vp, bt, qsl, seq, ks, vs, sc, window, **kw)


@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_native_gather_equals_the_eager_gather(pool, out_dtype):
    """The prompt path's context gather in C: every token row, any start within a block,
    a partial last block; the same values as indexing the pool and casting."""
    from qserve.kernels.kv_store import as_fp8_view
    from qserve.kernels.native_attention import gather_context_native

    args = _case(pool, torch.float32, hkv=3, group=1, lens=[(1, 70)], block_size=8, d=16)
    k_pool = as_fp8_view(args[1]) if pool == "fp8" else args[1]
    row = args[3][0].to(torch.int64)
    full = k_pool[row[:9]].flatten(0, 1)  # 72 slots, 71 of them written
    for first, n in [(0, 71), (5, 66), (8, 1), (13, 0), (70, 1)]:
        got = gather_context_native(k_pool, row, first, n, out_dtype)
        assert got.shape == (n, 3, 16) and got.dtype == out_dtype
        assert torch.equal(got, full[first:first + n].to(out_dtype))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens", [[(1, 40)], [(3, 9), (1, 30)], MIXED])
def test_native_work_split_over_threads(threads, lens):
    """One thread walks whole sequences; with threads, few sequences are split by kv
    head (fewer than two per thread), many go whole: every split matches the reference."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(_case("fp8", torch.bfloat16, hkv=3, group=2, lens=lens), impl="native")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d, ctx, window, softcap", [(64, 200, None, None), (64, 300, 64, None),
                                                     (20, 50, None, None), (16, 33, None, 30.0),
                                                     (64, 1, None, None)])
def test_native_one_decode_is_the_same_on_any_thread_count(pool, d, ctx, window, softcap):
    """One sequence decoding one token: one thread walks every kv head itself, more threads
    take one kv head each; the arithmetic per head is the same, so the output is the same
    to the last bit whatever the thread count (a split of the work that changed the order
    of a sum would show here first)."""
    torch.manual_seed(d * 1000 + ctx)
    args = _case(pool, torch.bfloat16, hkv=3, group=3, lens=[(1, ctx)], block_size=16, d=d)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(paged_attention(*args, window, softcap, decode_impl="native"))
    finally:
        torch.set_num_threads(old)
    _check(args, window, softcap, impl="native")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16])
@pytest.mark.parametrize("d", [12, 20, 64])
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_key_blocks_of_any_width(pool, d, block_size):
    """The C kernel reads a block of 16 keys into a transposed buffer: on AVX2 by 8 x 8
    register transposes where a kv-head slice is a multiple of 8 wide, else element by
    element. Both pool kinds it transposes that way, widths both ways, full and partial
    key blocks, keys spread over shuffled pool blocks: each matches the reference."""
    lens = [(1, 47), (1, 15), (2, 16), (1, 0), (4, 33)]
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _check(_case(pool, torch.float32, hkv=3, group=2, lens=lens,
                         block_size=block_size, d=d), impl="native")
        finally:
            torch.set_num_threads(old)


@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16])
@pytest.mark.parametrize("lens", [[(150, 0)], [(130, 20), (1, 30), (65, 5), (0, 3)],
                                  [(64, 0), (129, 0)]])
@pytest.mark.parametrize("window", [None, 40])
def test_native_long_prompts_split_into_query_chunks(pool, lens, window):
    """A prompt of more than the kernel's query chunk (64) is split into chunks of its
    queries, each over the keys it sees (work items for the threads; one after another on
    one thread): the same bits on any thread count, the same bits as each query row asked
    alone (one query over its own context), and the reference's values. (The C decode path
    sends whole prompts here; the module path sends them to the prefill kernel.)"""
    from qserve.kernels.native_attention import native_attention

    torch.manual_seed(len(lens) * 100 + (window or 0))
    q, kp, vp, bt, qsl, seq_lens, ks, vs, scale = _case(
        pool, torch.bfloat16, hkv=3, group=3, lens=lens, block_size=16, d=64)
    qk_scale, v_scale = kernel_scales(ks, vs, scale, 3)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native_attention(q, kp, vp, bt, qsl, seq_lens, qk_scale, v_scale,
                                         window, None))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for b in range(len(lens)):  # rows at the ends of the prompt and of its first chunk
        first, n = int(qsl[b]), int(qsl[b + 1] - qsl[b])
        for i in sorted({0, min(63, n - 1), min(64, n - 1), n - 1}):
            if n == 0:
                continue
            alone = native_attention(q[first + i:first + i + 1], kp, vp, bt[b:b + 1],
                                     torch.tensor([0, 1]), seq_lens[b:b + 1] - (n - 1 - i),
                                     qk_scale, v_scale, window, None)
            assert torch.equal(alone[0], outs[0][first + i])
    ref = paged_attention_reference(q, kp, vp, bt, qsl, seq_lens, ks, vs, scale, window, None)
    err = (outs[0].double() - ref).abs().max() / ref.abs().max()
    assert err <= BOUND[torch.bfloat16], f"relative error {float(err):.2e}"


@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16])
@pytest.mark.parametrize("d, value_dim", [(40, 32), (192, 128)])
def test_native_value_dim_accumulates_the_first_columns_only(pool, d, value_dim):
    """A latent cache's vector is the key, and its first value_dim columns (c_kv) the value
    (the RoPE key after them is none): those columns equal the whole-width result's, bit
    for bit, and the others are 0. Decode rows and a prompt, one kv head."""
    from qserve.kernels.native_attention import native_attention

    torch.manual_seed(d)
    q, kp, vp, bt, qsl, seq_lens, ks, vs, scale = _case(
        pool, torch.bfloat16, hkv=1, group=4, lens=[(1, 30), (9, 4), (1, 70)], d=d)
    qk_scale, v_scale = kernel_scales(ks, vs, scale, 1)
    args = (q, kp, kp, bt, qsl, seq_lens, qk_scale, v_scale, None, None)
    whole = native_attention(*args)
    part = native_attention(*args, value_dim=value_dim)
    assert torch.equal(part[..., :value_dim], whole[..., :value_dim])
    assert not part[..., value_dim:].any() and whole[..., value_dim:].abs().sum() > 0
    with pytest.raises(ValueError, match="value_dim must be in"):
        native_attention(*args, value_dim=d + 1)

