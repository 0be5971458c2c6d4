"""--device and the engine's one backend decision (runtime/device.py,
runtime/execution_backend.py), with CUDA faked where this machine has none: resolution and
its errors, the decision per device and capability, the KV pool from free device memory,
the FP8 GEMM through torch._scaled_mm, the device path of the grammar mask, and the
command line's one-line refusals."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from qserve.kernels.fp8 import FP8_DTYPE
from qserve.kernels.fp8_gemm import fp8_linear_reference, fp8_linear_scaled_mm
from qserve.runtime import device as device_mod
from qserve.runtime import execution_backend as eb
from qserve.runtime.device import DeviceError, kv_pool_bytes, resolve_device
from qserve.runtime.execution_backend import ExecutionBackend

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two CUDA devices of compute capability `fake_cuda["cc"]` as far as qserve asks."""
    state = {"cc": (9, 0), "free": 60 * 2**30, "total": 80 * 2**30}
    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: state["cc"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda d=None: (state["free"], state["total"]))
    return state


def test_resolve_on_this_machine():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_device(None) == torch.device("cpu")
        with pytest.raises(DeviceError, match="--device cuda:.*use --device cpu"):
            resolve_device("cuda")
    with pytest.raises(DeviceError, match="'tpu' is not a device.*auto \\| cpu"):
        resolve_device("tpu")


def test_resolve_with_two_gpus(fake_cuda):
    assert resolve_device("auto") == CUDA0
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="2 CUDA device\\(s\\), cuda:0..cuda:1"):
        resolve_device("cuda:2")
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("cuda:-1")


def test_decision_on_cpu(monkeypatch):
    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    b = ExecutionBackend.choose(torch.device("cpu"))
    assert (b.kernels, b.fp8_gemm, b.cpu_native) == ("torch", "cpu", True)
    assert "device cpu, torch kernels" in b.line()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="TRITON_INTERPRET=1"):
        ExecutionBackend.choose(torch.device("cpu"), kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b = ExecutionBackend.choose(torch.device("cpu"), kernels="triton")
    assert (b.kernels, b.fp8_gemm, b.cpu_native) == ("triton", "triton", False)
    b = ExecutionBackend.choose(torch.device("cpu"), "triton", fp8_gemm="scaled_mm")
    assert b.fp8_gemm == "scaled_mm"
    with pytest.raises(DeviceError, match="fp8_gemm 'cpu'"):
        ExecutionBackend.choose(torch.device("cpu"), "triton", fp8_gemm="cpu")
    monkeypatch.setenv("QSERVE_KERNELS", "fast")
    with pytest.raises(DeviceError, match="kernels 'fast'.*QSERVE_KERNELS"):
        ExecutionBackend.choose(torch.device("cpu"))


def test_decision_on_cuda_by_capability(fake_cuda, monkeypatch):
    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    b = ExecutionBackend.choose(CUDA0)
    assert (b.kernels, b.fp8_gemm, b.cpu_native, b.notes) == ("triton", "scaled_mm", False, ())
    assert "Fake GPU, compute capability 9.0" in b.line()
    assert ExecutionBackend.choose(CUDA0, fp8_gemm="triton").fp8_gemm == "triton"
    fake_cuda["cc"] = (8, 0)  # an A100: no FP8 tensor cores
    b = ExecutionBackend.choose(CUDA0)
    assert b.fp8_gemm == "bf16"
    assert "compute capability 8.0" in b.notes[0] and "8.9" in b.notes[0]
    assert "bf16 matmuls" in b.line()
    with pytest.raises(DeviceError, match="kernels 'torch' on cuda:0"):
        ExecutionBackend.choose(CUDA0, kernels="torch")
    with pytest.raises(DeviceError, match="cpu or cuda devices"):
        ExecutionBackend.choose(torch.device("meta"))
    assert eb.FP8_GEMMS == ("cpu", "scaled_mm", "triton", "bf16")


def test_decode_graphs_decision(fake_cuda, monkeypatch):
    """CUDA graphs are CUDA's default, off with --enforce-eager; the CPU never captures,
    its C backend never takes the fixed-buffer path; a bad mode is named."""
    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    b = ExecutionBackend.choose(CUDA0)
    assert b.decode_graphs == "captured" and "decode as CUDA graphs" in b.line()
    assert ExecutionBackend.choose(CUDA0, decode_graphs="off").decode_graphs == "off"
    assert ExecutionBackend.choose(torch.device("cpu")).decode_graphs == "off"
    with pytest.raises(DeviceError, match="CUDA graphs need a CUDA device, not cpu"):
        ExecutionBackend.choose(torch.device("cpu"), decode_graphs="captured")
    with pytest.raises(DeviceError, match="CPU torch backend runs its own C decode step"):
        ExecutionBackend.choose(torch.device("cpu"), decode_graphs="padded")
    with pytest.raises(DeviceError, match="decode_graphs 'always'"):
        ExecutionBackend.choose(CUDA0, decode_graphs="always")


def test_capture_sizes():
    from qserve.runtime.decode_graphs import capture_sizes

    assert capture_sizes(1) == (1,)
    assert capture_sizes(4) == (1, 2, 4)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


def test_step_buffers_stage_rows_and_padding_in_one_copy(monkeypatch):
    """A step's rows land in the fixed device views (slots from the tables, context =
    position + 1), padding rows skip the store (-1) and read one token of block 0, and
    the host-to-device transfer is one copy of the used prefix."""
    from qserve.runtime.step_buffers import DecodeRow, StepBuffers

    buf = StepBuffers(capacity=4, table_width=3, num_groups=2, block_size=4,
                      device=torch.device("cpu"))
    rows = [DecodeRow(7, 5, ([10, 11], [20, 21])), DecodeRow(9, 0, ([12], [22]))]
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_",
                        lambda self, src, non_blocking=False: copies.append(src.numel())
                        or real_copy(self, src, non_blocking))
    buf.stage(rows, padded=4)
    assert copies == [(2 + 2 * 2) * 4 + (4 + 4) * 3]  # vectors, group 0's rows, 4 of group 1
    assert buf.ids.tolist() == [7, 9, 0, 0] and buf.positions.tolist() == [5, 0, 0, 0]
    assert buf.slots[0].tolist() == [11 * 4 + 1, 12 * 4, -1, -1]
    assert buf.slots[1].tolist() == [21 * 4 + 1, 22 * 4, -1, -1]
    assert buf.seq_lens[0].tolist() == [6, 1, 1, 1] == buf.seq_lens[1].tolist()
    assert buf.tables[1].tolist() == [[20, 21, 0], [22, 0, 0], [0, 0, 0], [0, 0, 0]]
    meta = buf.metadata(2)
    assert meta.query_start_loc.tolist() == [0, 1, 2] and meta.decode_seqs.tolist() == [0, 1]
    assert meta.for_group(1).block_tables.data_ptr() == buf.tables[1].data_ptr()
    assert meta.max_context == 12
    buf.stage(rows[1:], padded=1)  # a smaller step rewrites what it reads
    assert buf.ids[:1].tolist() == [9] and buf.tables[0, 0].tolist() == [12, 0, 0]
    assert not buf.fits([DecodeRow(1, 12, ([1, 2, 3, 4], [1]))])  # 4 blocks > width 3
    with pytest.raises(ValueError, match="does not fit buffers of 4 x 3 blocks"):
        buf.stage(rows, padded=8)


def test_kv_pool_from_free_memory(fake_cuda):
    # 80 GiB card, 20 GiB in use (weights, others): 0.9 allows 72, so the pool gets 52
    assert kv_pool_bytes(CUDA0, 0.9) == int(80 * 2**30 * 0.9) - 20 * 2**30
    fake_cuda["free"] = 5 * 2**30  # 75 GiB in use
    with pytest.raises(DeviceError, match="no room for a KV cache on cuda:0.*75.00 GiB"):
        kv_pool_bytes(CUDA0, 0.9)
    with pytest.raises(DeviceError, match="must be in \\(0, 1\\]"):
        kv_pool_bytes(CUDA0, 1.5)
    with pytest.raises(DeviceError, match="CUDA device"):
        kv_pool_bytes(torch.device("cpu"), 0.9)


@pytest.mark.parametrize("per_channel", [True, False])
def test_scaled_mm_gemm_matches_float64(per_channel):
    torch.manual_seed(per_channel)
    x = torch.randn(5, 64, dtype=torch.float32)
    w = (torch.randn(48, 64) * 0.5).to(FP8_DTYPE)
    w_scale = (torch.rand(48, 1) + 0.5) * 0.01 if per_channel else torch.tensor([0.02])
    s_in = torch.tensor([0.01])
    bias = torch.randn(48)
    got = fp8_linear_scaled_mm(x, w, w_scale, s_in, bias)
    want = fp8_linear_reference(x, w, w_scale, s_in, bias)
    assert got.dtype == torch.float32 and got.shape == (5, 48)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert float(err) < 1e-5, float(err)
    got16 = fp8_linear_scaled_mm(x.bfloat16(), w, w_scale, s_in)
    assert got16.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_scaled_mm(x, w.float(), w_scale, s_in)


def test_grammar_mask_on_device_path_equals_the_cpu_kernel():
    torch.manual_seed(0)
    from qserve.runtime.structured.grammar_state import (apply_bitmask,
                                                         apply_bitmask_on_device,
                                                         new_bitmask)

    vocab = 77
    mask = new_bitmask(4, vocab)
    mask[1] = torch.randint(-2**31, 2**31 - 1, (mask.shape[1],), dtype=torch.int32)
    mask[3] = 0
    mask[3, 0] = 1 << 5
    logits = torch.randn(4, vocab)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, mask, [1, 3])  # the C kernel (CPU)
    apply_bitmask_on_device(b, mask, [1, 3])  # the torch ops other devices run
    assert torch.equal(a, b)
    assert torch.isinf(b[3]).sum() == vocab - 1 and b[3, 5] == logits[3, 5]
    assert torch.equal(b[0], logits[0]) and torch.equal(b[2], logits[2])


def test_cli_refuses_a_device_in_one_line(monkeypatch):
    from qserve.runtime.cli import main

    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: 0)
    for command in ("serve", "generate", "eval"):
        r = CliRunner().invoke(main, [command, "x", "--device", "cuda:1"])
        assert r.exit_code == 2, r.output
        assert "Invalid value for '--device': --device cuda:1:" in r.output
        assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["serve", "x", "--gpu-memory-utilization", "1.5"])
    assert r.exit_code == 2 and "--gpu-memory-utilization" in r.output
