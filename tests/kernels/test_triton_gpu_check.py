"""The GPU check script on a machine without a GPU: it refuses cleanly, and its dry run
(--interpret-smoke: every kernel case on tiny shapes under the Triton interpreter,
checked against the float64 references) passes and writes its report."""

from __future__ import annotations

import json

import pytest
import torch

from qserve.runtime.benchmark import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_refuses_without_cuda(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "r")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_interpret_smoke_checks_every_kernel(tmp_path, seed):
    code = gpu_check.main(["--out", str(tmp_path), "--interpret-smoke", "--skip-e2e",
                           "--seed", str(seed)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, [r for r in report["results"] if not r.get("ok")]
    assert report["seed"] == seed
    kinds = {r["kernel"] for r in report["results"]}
    assert kinds == {"decode", "prefill", "store_kv", "fp8_gemm", "mla_decode"}
    assert report["all_correct"] and all(r["ok"] and "error" not in r for r in report["results"])
    for kind in ("decode", "mla_decode"):  # split-KV ran
        assert any(r.get("splits", 1) > 1 for r in report["results"] if r["kernel"] == kind)
    assert set(report["goals"]) == {"decode_roofline_fraction", "gemm_vs_scaled_mm"}
    assert "# Triton kernel GPU check" in (tmp_path / "gpu_check.md").read_text()


def test_vllm_part_rate_and_absence(monkeypatch):
    """vLLM's decode rate is the difference of a full and a first-token run; where vLLM
    does not import, the part says so instead of failing the check; the 16-stream goal is
    the engine's rate over vLLM's."""
    import sys

    from qserve.runtime.benchmark.gpu_check_vllm import decode_rate, run_vllm

    assert decode_rate(16, 64, seconds_full=2.0, seconds_first=0.5) == round(16 * 63 / 1.5, 1)
    assert decode_rate(1, 2, seconds_full=0.1, seconds_first=0.1) is None
    with pytest.raises(ValueError, match="tokens >= 2"):
        decode_rate(1, 1, 1.0, 0.5)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    assert run_vllm("ARTIFACT", (1, 16))["status"] == "not installed"
    e2e = {"decode": [{"streams": 16, "tokens_per_s": 900.0}]}
    vllm = {"decode": [{"streams": 16, "tokens_per_s": 1000.0}]}
    goal = gpu_check._goals([], {}, e2e, vllm)["decode_16_streams_vs_vllm"]
    assert (goal["value"], goal["goal"], goal["met"]) == (0.9, 0.8, True)
    assert "decode_16_streams_vs_vllm" not in gpu_check._goals([], {}, e2e, {"status": "x"})
