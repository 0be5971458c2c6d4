"""`qserve env`: the CPU class from fixed flag sets, the probe's kernel paths, the command."""

import json

import pytest
from click.testing import CliRunner

from qserve.kernels import native_fp8_gemv, native_int8_gemm
from qserve.runtime import capabilities
from qserve.runtime.capabilities import (RELEVANT_FLAGS, Capabilities, cpu_class, cpu_model,
                                         parse_cpu_flags, probe)
from qserve.runtime.cli import main
from qserve.runtime.device import resolve_device
from qserve.runtime.execution_backend import ExecutionBackend

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
AVX512 = AVX2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
AVX512_BF16 = AVX512 | {"avx512_vnni", "avx512_vbmi", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


def _report(lines: list[str]) -> dict[str, str]:
    """{label: value} of the report's "label: value" lines."""
    out = {}
    for line in lines:
        label, sep, value = line.partition(":")
        assert sep, f"not a 'label: value' line: {line!r}"
        out[label] = value.strip()
    return out


@pytest.mark.parametrize("flags, expected", [
    (set(), "portable"),
    ({"avx", "avx2"}, "portable"),  # AVX2 without FMA
    ({"avx2", "fma"}, "avx2"),
    (AVX2, "avx2"),
    (AVX512, "avx512"),
    (AVX512_BF16, "avx512-bf16"),
    (AMX, "amx"),
    (AVX512_BF16 | {"amx_tile"}, "avx512-bf16"),  # AMX tiles without bf16
])
def test_cpu_class_from_flags(flags, expected):
    assert cpu_class(flags) == expected


def test_parse_cpu_flags_reads_the_first_flags_line():
    text = ("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 fma\n\n"
            "processor\t: 1\nflags\t\t: fpu avx2 fma avx512f\n")
    assert parse_cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert parse_cpu_flags("processor\t: 0\n") == frozenset()


def test_probe_reports_the_fp8_linear_path(monkeypatch):
    assert probe().fp8_linear == (native_fp8_gemv.path() or "torch")
    monkeypatch.setattr(native_fp8_gemv, "path", lambda: "amx")
    assert probe().fp8_linear == "amx"
    monkeypatch.setattr(native_fp8_gemv, "path", lambda: None)  # the library did not build
    assert probe().fp8_linear == "torch"


def test_probe_reports_an_error_in_place_of_the_value(monkeypatch):
    def broken():
        raise RuntimeError("no\nlibrary")

    monkeypatch.setattr(native_fp8_gemv, "path", broken)
    caps = probe()
    assert caps.fp8_linear == "error: RuntimeError: no library"
    assert _report(caps.lines())["FP8 linear"] == "error: RuntimeError: no library"


def test_probe_cpu_class_matches_its_flags():
    caps = probe()
    flags = capabilities.cpu_flags()
    assert caps.cpu_flags == tuple(f for f in RELEVANT_FLAGS if f in flags)
    assert caps.cpu_class == cpu_class(flags)
    assert caps.cpu_model == cpu_model()


def test_linear_paths_follow_the_kernels(monkeypatch):
    from qserve.kernels import cpu_linear, native_bf16_gemv
    from qserve.quantize.pipeline import calibration_dtype

    caps = probe()
    assert caps.cpu_linear == cpu_linear.strategy()
    assert caps.calibration_dtype == str(calibration_dtype()).removeprefix("torch.")
    if caps.cpu_linear == "fp32":
        assert caps.bf16_rows_linear == ("avx2" if native_bf16_gemv.vectorized() else "portable")
        assert caps.calibration_dtype == "float32"
    else:
        assert caps.bf16_rows_linear == caps.cpu_linear == "onednn-bf16"
    monkeypatch.setenv(cpu_linear.ENV_VAR, "fp32")  # the strategy of CPUs without bf16
    caps = probe()
    assert (caps.cpu_linear, caps.calibration_dtype) == ("fp32", "float32")
    monkeypatch.setenv(cpu_linear.ENV_VAR, "nonsense")  # a bad setting is reported, not raised
    caps = probe()
    assert caps.cpu_linear.startswith("error: ValueError: QSERVE_CPU_LINEAR='nonsense'")


def test_env_command_prints_the_report():
    r = CliRunner().invoke(main, ["env"], catch_exceptions=False)
    assert r.exit_code == 0
    report = _report(r.output.splitlines())
    assert list(report)[:3] == ["engine (--device auto)", "CPU", "CPU class"]
    assert report["CPU"] == cpu_model()
    # the engine's one decision (runtime/execution_backend.py) as an engine makes it here
    want = ExecutionBackend.choose(resolve_device("auto")).line()
    assert report["engine (--device auto)"] == want
    assert report["FP8 linear"] == (native_fp8_gemv.path() or "torch")


def test_env_json_parses():
    r = CliRunner().invoke(main, ["env", "--json"], catch_exceptions=False)
    assert r.exit_code == 0
    data = json.loads(r.output)
    assert data["cpu_model"] == cpu_model()
    assert data["fp8_linear"] == (native_fp8_gemv.path() or "torch")
    assert data["execution"] == ExecutionBackend.choose(resolve_device("auto")).line()
    assert data["int8_linear"] == (native_int8_gemm.path() or "torch")
    assert data["fp8_linear_rows"] == ("any" if native_fp8_gemv.pass_rows() > 2**31
                                       else f"up to {native_fp8_gemv.pass_rows()}")
    assert set(data["c_kernels"]) == {op for op, _, _ in capabilities.C_KERNELS}
    assert set(data["c_kernels"].values()) <= {"c", "torch"}
    # SDPA on AMX tiles for bf16 prompts where the class is amx, the C kernel elsewhere
    want = "sdpa" if data["cpu_class"] == "amx" or data["c_kernels"]["prompt attention"] \
        != "c" else "c"
    assert data["bf16_prompt_attention"] == want


def test_one_line():
    caps = Capabilities(
        cpu_model="Some CPU", cpu_class="avx2", cpu_flags=("avx2", "fma"),
        torch_version="2.0", torch_threads=4, onednn_bf16=False, c_compiler="cc 1 (cc)",
        native_cache="cache", fp8_linear="avx2", cpu_linear="fp32", bf16_rows_linear="avx2",
        calibration_dtype="float32", c_kernels=(("RMS norm", "c"), ("rotary", "torch"), ("KV store", "c"),
                   ("paged attention", "error: OSError: gone")), fp8_linear_rows="any",
        bf16_prompt_attention="c", execution="device cpu, torch kernels")
    assert caps.one_line() == (
        "device cpu, torch kernels; Some CPU (avx2); torch 2.0, 4 threads, oneDNN bf16 not native; FP8 linear avx2 "
        "(any rows a pass), large-row linear fp32, bf16 linear few rows avx2; C kernels: RMS norm, "
        "KV store; "
        "torch ops: rotary; "
        "paged attention: error: OSError: gone; bf16 prompt attention c")
    assert "\n" not in probe().one_line()
