"""The step benchmark's argument checks and its timers (which must undo themselves)."""

import pytest

from qserve.kernels import dispatch
from qserve.runtime.benchmark.step import main, timed


@pytest.mark.parametrize("argv", [["--batch", "1,x"], ["--tokens", "1"], ["--batch", "0"],
                                  ["--prefill", "-1"], ["--prompt-len", "-1"]])
def test_bad_arguments_are_refused_before_loading(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert "--batch" in err or "--tokens" in err


def test_timers_wrap_and_restore():
    real = dispatch.store_kv
    totals = {}
    with timed(totals):
        assert dispatch.store_kv is not real
    assert dispatch.store_kv is real


def test_prefill_needs_text_for_distinct_prompts():
    """Each timed prefill (and the warm-up) gets its own slice of the held-out text, so no
    prefix-cache hit can shorten one; too little text is refused before anything runs."""
    from types import SimpleNamespace

    from qserve.evals.golden_text import load_heldout_text
    from qserve.runtime.benchmark import step as bench_step

    calls = []
    text_tokens = len("\n\n".join(load_heldout_text()).split())
    fake = SimpleNamespace(
        lm=SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda s: s.split())),
        generate=lambda prompts, params: calls.append(prompts))
    with pytest.raises(SystemExit, match="lower --prefill or --reps"):
        bench_step._bench_prefill(fake, text_tokens // 3, 3)
    assert not calls
    bench_step._bench_prefill(fake, 100, 3)
    assert len(calls) == 4 and all(len(p[0]) == 100 for p in calls)
    assert len({tuple(p[0]) for p in calls}) == 4  # four different prompts


def test_per_kernel_times_steps_of_the_batch_call_by_call_and_restores():
    """--per-kernel: a step program's calls run one by one for steps of the batch's rows
    (the results as one call gives), timed by kernel; other steps run whole; afterwards
    the program runs as before."""
    from types import SimpleNamespace

    import torch

    from qserve.kernels import native_step_program as sp
    from qserve.runtime.benchmark.step import per_kernel

    if sp._runner() is None:
        pytest.skip("no C compiler")
    x, y = torch.ones(4, 8).bfloat16(), torch.ones(4, 8).bfloat16()
    program = sp.StepProgram.build([sp.Call("add", (sp.V("x"), sp.V("y"), sp.V("t", 8))),
                                    sp.Call("round", (sp.V("f"), sp.V("t", 8), sp.V("y")))])
    f = torch.full((4, 8), 0.5)
    values = {"x": x.data_ptr(), "y": y.data_ptr(), "f": f.data_ptr()}
    totals = {}
    with per_kernel(SimpleNamespace(program=program), 4, totals):
        program.run({**values, "t": 4})  # timed: x = 1 + 1, then y = 0.5
        program.run({**values, "t": 2})  # another row count: whole, not timed
    assert totals[""] == 1 and set(totals) == {"", "add", "round"}
    want = torch.full((4, 8), 2.0)
    want[:2] += 0.5  # the second step: 2 rows of x += y (0.5 by then)
    assert torch.equal(x, want.bfloat16()) and bool((y == 0.5).all())
    assert "run" not in vars(program)


def test_per_kernel_says_when_no_step_of_the_batch_ran(capsys):
    from qserve.runtime.benchmark.step import _print_kernels

    _print_kernels({}, 16)
    assert "no C step of exactly 16 rows ran" in capsys.readouterr().out
    _print_kernels({"": 2, "attention": 0.01, "fp8_gemv": 0.03}, 4)
    out = capsys.readouterr().out.splitlines()
    assert "(2 steps" in out[0] and out[1].split() == ["fp8_gemv", "15.0"]
    assert out[2].split() == ["attention", "5.0"]
    assert len(out) == 3  # no linears' rate without their multiply-adds


def test_per_kernel_rates_the_linears_kernels_at_the_steps_shapes(capsys):
    from qserve.runtime.benchmark.machine_rates import MachineRates
    from qserve.runtime.benchmark.step import _body_macs, _print_kernels

    rates = MachineRates(10.0, {"float32": 100.0})
    # 2 steps of 4 rows; 0.02 s per step in the linears (fp8_gemv, int8_gemv_wonly), not
    # in attention: 2 * 1e8 MACs * 4 rows / 0.02 s = 40 GFLOP/s
    _print_kernels({"": 2, "attention": 0.5, "fp8_gemv": 0.03, "int8_gemv_wonly": 0.01}, 4,
                   body_macs=100_000_000, rates=rates)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.strip() == ("the decoder's linears at the step's shapes: 40 GFLOP/s, "
                            "0.40 of the best GEMM rate")
    from torch import nn
    model = nn.Module()
    model.lm_head = nn.Linear(8, 50, bias=False)
    assert _body_macs(model, 1000) == 600



def test_a_path_that_is_no_artifact_is_named_without_a_traceback(tmp_path):
    from qserve.runtime.benchmark.step import main

    with pytest.raises(SystemExit, match="step benchmark: .*nothing-here.*not a built-in"):
        main([str(tmp_path / "nothing-here"), "--batch", "1"])


def test_the_floor_is_the_larger_of_bytes_at_the_copy_rate_and_flops_at_the_gemm_rate():
    from qserve.runtime.benchmark.machine_rates import MachineRates

    rates = MachineRates(copy_gb_s=10.0, gemm_gflop_s={"float32": 100.0, "bfloat16": 400.0})
    one = rates.floor(weight_bytes=500_000_000, macs_per_row=400_000_000, rows=1)
    assert one.memory_ms == pytest.approx(50.0)  # 0.5 GB at 10 GB/s
    assert one.compute_ms == pytest.approx(2.0)  # 0.8 GFLOP at the best rate, 400
    assert one.ms == pytest.approx(50.0)
    many = rates.floor(500_000_000, 400_000_000, rows=64)
    assert many.compute_ms == pytest.approx(128.0) and many.ms == pytest.approx(128.0)
    assert "copy 10.0 GB/s" in rates.describe() and "bfloat16 400" in rates.describe()


def test_macs_per_row_counts_every_linear_once_packed_or_quantized():
    import torch
    from torch import nn

    from qserve.runtime.benchmark.machine_rates import macs_per_row
    from qserve.runtime.layers.fp8_linear import Fp8Linear

    codes = torch.zeros(8, 16, dtype=torch.int8)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                          Fp8Linear(codes, torch.ones(8, 1), None, None, torch.float32,
                                    codes="int8"))
    assert macs_per_row(model) == 16 * 32 + 16 * 8


def test_the_machines_rates_are_measured_positive():
    from qserve.runtime.benchmark import machine_rates

    rates = machine_rates.measure(reps=1)
    assert rates.copy_gb_s > 0.1 and rates.gemm_gflop_s["float32"] > 0.1
    assert rates.int8_gop_s is not None and rates.int8_gop_s > 0.01  # torch 2.13 has it on CPU
    assert "int8 (torch._int_mm [512]^2)" in rates.describe()
    # the floor is the recipes' arithmetic: an int8 rate above every float one is left out
    fast_int8 = machine_rates.MachineRates(10.0, {"float32": 100.0}, int8_gop_s=1e6)
    assert fast_int8.floor(0, 400_000_000, 1).compute_ms == pytest.approx(8.0)
