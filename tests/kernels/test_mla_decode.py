"""MLA decode (kernels/mla_decode.py, kernels/triton_mla_decode.py) against the float64
mla_decode_reference: the Triton kernel under the interpreter (tests/kernels/conftest.py
sets TRITON_INTERPRET=1 before this module imports a kernel) and the CPU torch path.

Bounds, max |out - ref| / max |ref| (the reference reads the same FP8 bytes and
dequantizes them in float64, so this measures the attention math only):
  fp32 q: 1e-5 (fp32 tiles, fp32 accumulation)
  bf16 q: 5e-3 (the output is rounded to bf16: half an ulp is up to 2**-8 = 3.9e-3
          relative)
Fresh random inputs every run (seed printed); `out` NaN-poisoned; pool slots no sequence
owns hold large finite garbage; block ids shuffled; the block table is a column-strided
view padded with -1 past what each sequence reads.
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels.fp8 import FP8_DTYPE, quantize_fp8
from qserve.kernels.mla_decode import mla_decode, mla_decode_reference
from qserve.kernels.triton_mla_decode import mla_decode_triton, mla_num_splits

BOUND = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
RANK, ROPE = 32, 8  # R, P: rows of D = 40
# one token, a non-multiple of the block size, exactly one block, several blocks
LENS = [1, 37, 16, 50, 5]


def mla_case(pool, q_dtype, heads, lens=LENS, block_size=16, rank=RANK, rope=ROPE):
    """Positional args of mla_decode. pool: "fp8" (per-layer scale), "fp8_bytes" (the same
    as a uint8 tensor) or a float dtype."""
    d = rank + rope
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    width = max(need) + 1
    perm = torch.randperm(num_blocks).to(torch.int32)
    bt = torch.full((len(lens), 2 * width), -1, dtype=torch.int32)[:, ::2]  # stride 2
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n]
        i += n
    slots = torch.tensor([int(bt[b, p // block_size]) * block_size + p % block_size
                          for b, n in enumerate(lens) for p in range(n)])
    rows = torch.randn(slots.numel(), d)  # the stored c_kv | k_pe of every context token
    if pool in ("fp8", "fp8_bytes"):
        # garbage first: 0x7E is 448, the largest finite E4M3 value
        kp = torch.full((num_blocks, block_size, 1, d), 0x7E, dtype=torch.uint8)
        scale = torch.rand(1) * 0.01 + 0.004
        kp.view(-1, d)[slots] = quantize_fp8(rows, scale).view(torch.uint8)
        if pool == "fp8":
            kp = kp.view(FP8_DTYPE)
    else:
        kp = torch.full((num_blocks, block_size, 1, d), 1e4, dtype=pool)
        kp.view(-1, d)[slots] = rows.to(pool)
        scale = None
    q = torch.randn(len(lens), heads, d).to(q_dtype)
    return q, kp, scale, bt, torch.tensor(lens, dtype=torch.int64), rank, d ** -0.5 * 2


def check(args, out, bound=None):
    ref = mla_decode_reference(*args)
    q = args[0]
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], args[5])
    assert not bool(torch.isnan(out).any())
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err <= (bound or BOUND[q.dtype]), f"relative error {err:.2e}"


@pytest.mark.parametrize("pool, q_dtype, heads", [
    ("fp8", torch.float32, 4),
    ("fp8", torch.bfloat16, 3),
    ("fp8_bytes", torch.float32, 20),  # two head blocks, the second mostly masked
    (torch.bfloat16, torch.float32, 3),
    (torch.bfloat16, torch.bfloat16, 4),
], ids=["fp8-fp32q-4h", "fp8-bf16q-3h", "fp8bytes-fp32q-20h", "bf16-fp32q-3h",
        "bf16-bf16q-4h"])
def test_triton_kernel_matches_reference(seed, pool, q_dtype, heads):
    args = mla_case(pool, q_dtype, heads)
    for splits in (1, 4):  # 4 splits of 16 tokens: short sequences leave splits empty
        out = torch.full((len(LENS), heads, RANK), float("nan"), dtype=q_dtype)
        res = mla_decode_triton(*args, num_splits=splits, out=out)
        assert res is out
        check(args, out)


def test_triton_kernel_fp32_pool_and_one_sequence(seed):
    # fp32 pool (exact-fp32 dots even with bf16 q), a single long sequence, chosen splits
    args = mla_case(torch.float32, torch.float32, 4, lens=[70])
    check(args, mla_decode(*args, backend="triton"))
    args = mla_case(torch.float32, torch.bfloat16, 4, lens=[3, 17])
    check(args, mla_decode(*args, backend="triton"))


@pytest.mark.parametrize("pool, q_dtype, heads", [
    ("fp8", torch.float32, 4),
    ("fp8_bytes", torch.bfloat16, 3),
    (torch.bfloat16, torch.float32, 3),
    (torch.bfloat16, torch.bfloat16, 4),
    (torch.float32, torch.float32, 5),
], ids=["fp8-fp32q-4h", "fp8bytes-bf16q-3h", "bf16-fp32q-3h", "bf16-bf16q-4h",
        "fp32-fp32q-5h"])
def test_torch_path_matches_reference(seed, pool, q_dtype, heads):
    args = mla_case(pool, q_dtype, heads)
    out = torch.full((len(LENS), heads, RANK), float("nan"), dtype=q_dtype)
    assert mla_decode(*args, out=out, backend="torch") is out
    check(args, out)


def test_auto_dispatch_on_cpu_is_the_torch_path(seed, monkeypatch):
    from qserve.kernels import dispatch

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    args = mla_case("fp8", torch.float32, 4)
    assert torch.equal(mla_decode(*args), mla_decode(*args, backend="torch"))


def test_split_choice():
    cpu = torch.device("cpu")  # nominal 132 SMs
    assert mla_num_splits(2, 16, 4096, cpu) == 16  # 2 programs: split, >= 256 tokens each
    assert mla_num_splits(256, 128, 4096, cpu) == 1  # 2048 programs fill the device
    assert mla_num_splits(4, 128, 300, cpu) == 2


@pytest.mark.parametrize("case, match", [
    ("q_dims", r"q must be \[batch, num_heads, 40\]"),
    ("q_width", r"q must be \[batch, num_heads, 40\]"),
    ("q_dtype", "q must be float32, bfloat16 or float16"),
    ("pool_heads", r"latent_pool must be \[num_blocks, block_size, 1"),
    ("pool_dtype", "expected float8_e4m3fn"),
    ("rank", "kv_lora_rank 41 exceeds"),
    ("scale_missing", "latent_scale is required"),
    ("scale_dtype", "latent_scale must be float32"),
    ("scale_for_bf16", "latent_scale was given for a non-FP8 pool"),
    ("bt_rows", r"block_tables must be \[5, max_blocks\]"),
    ("bt_dtype", "block_tables must be int32 or int64"),
    ("seq_shape", r"seq_lens must be \[5\]"),
    ("seq_zero", r"seq_lens must be in \[1, "),
    ("seq_long", r"seq_lens must be in \[1, "),
    ("block_id", "block_tables: the blocks the sequences read must be in"),
    ("out", r"out must be \[5, 4, 32\]"),
])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input(case, match, backend):
    q, kp, scale, bt, seq, rank, sm = mla_case(
        torch.bfloat16 if case == "scale_for_bf16" else "fp8", torch.float32, 4)
    kw = {}
    if case == "q_dims":
        q = q[0]
    elif case == "q_width":
        q = q[..., :-1]
    elif case == "q_dtype":
        q = q.double()
    elif case == "pool_heads":
        kp = kp.expand(-1, -1, 2, -1).contiguous()
    elif case == "pool_dtype":
        kp = kp.view(torch.uint8).to(torch.int32)
    elif case == "rank":
        rank = 41
    elif case == "scale_missing":
        scale = None
    elif case == "scale_dtype":
        scale = scale.double()
    elif case == "scale_for_bf16":
        scale = torch.ones(1)
    elif case == "bt_rows":
        bt = bt[:2]
    elif case == "bt_dtype":
        bt = bt.float()
    elif case == "seq_shape":
        seq = seq[:, None]
    elif case == "seq_zero":
        seq[0] = 0
    elif case == "seq_long":
        seq[1] = bt.shape[1] * kp.shape[1] + 1
    elif case == "block_id":
        bt[3, 0] = kp.shape[0]
    elif case == "out":
        kw["out"] = torch.empty(5, 4, rank, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        mla_decode(q, kp, scale, bt, seq, rank, sm, backend=backend, **kw)


@pytest.mark.parametrize("case, match", [
    ("splits", r"num_splits must be in \[1, 64\]"),
    ("q_stride", "q needs a contiguous last dim"),
])
def test_bad_input_triton_only(case, match):
    q, kp, scale, bt, seq, rank, sm = mla_case("fp8", torch.float32, 4)
    kw = {}
    if case == "splits":
        kw["num_splits"] = 0
    else:
        q = q.transpose(0, 2).contiguous().transpose(0, 2)
    with pytest.raises(ValueError, match=match):
        mla_decode_triton(q, kp, scale, bt, seq, rank, sm, **kw)
