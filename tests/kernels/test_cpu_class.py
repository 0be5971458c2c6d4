"""QSERVE_CPU_CLASS: a machine of a better class runs as one of a lower class, end to end."""

import json
import os
import subprocess
import sys

import pytest

from qserve.kernels import cpu_class, native_build

AMX = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw",
                 "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"})
AVX512_BF16 = AMX - {"amx_tile", "amx_bf16"}


@pytest.fixture
def on_cpu(monkeypatch):
    """Pretend this machine's CPU has the given flags."""
    def pretend(flags):
        monkeypatch.setattr(cpu_class, "detected_flags", lambda: frozenset(flags))
    return pretend


def test_unset_changes_nothing(monkeypatch, on_cpu):
    monkeypatch.delenv(cpu_class.ENV_VAR, raising=False)
    on_cpu(AMX)
    assert cpu_class.cap() is None
    assert cpu_class.cpu_flags() == AMX
    assert cpu_class.build_march() == "native"
    assert cpu_class.describe() == "amx"


def test_avx2_cap_drops_every_wider_flag(monkeypatch, on_cpu):
    monkeypatch.setenv(cpu_class.ENV_VAR, "avx2")
    on_cpu(AMX)
    flags = cpu_class.cpu_flags()
    assert flags == {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    assert cpu_class.cpu_class(flags) == "avx2"
    assert cpu_class.build_march() == "x86-64-v3"
    assert cpu_class.build_extra_flags() == ()
    env = cpu_class.torch_environment("avx2")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"  # torch's fp32 matmuls
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("-avx2")  # never the own class's kernels
    assert cpu_class.torch_environment(None) == {}
    assert cpu_class.describe() == "avx2 (emulated by QSERVE_CPU_CLASS on an amx CPU)"


@pytest.mark.parametrize("klass, march", [("avx512", "x86-64-v4"), ("portable", None)])
def test_each_lower_class_builds_for_its_level(monkeypatch, on_cpu, klass, march):
    monkeypatch.setenv(cpu_class.ENV_VAR, klass)
    on_cpu(AMX)
    assert cpu_class.cpu_class(cpu_class.cpu_flags()) == klass
    assert cpu_class.build_march() == march


def test_avx512_bf16_cap_on_amx_keeps_native_without_amx(monkeypatch, on_cpu):
    monkeypatch.setenv(cpu_class.ENV_VAR, "avx512-bf16")
    on_cpu(AMX)
    assert cpu_class.cpu_flags() == AVX512_BF16
    assert cpu_class.build_march() == "native"
    assert "-mno-amx-tile" in cpu_class.build_extra_flags()


def test_the_cpus_own_class_is_no_cap(monkeypatch, on_cpu):
    monkeypatch.setenv(cpu_class.ENV_VAR, "avx512-bf16")
    on_cpu(AVX512_BF16)
    assert cpu_class.cap() is None
    assert cpu_class.build_march() == "native"


@pytest.mark.parametrize("value, says", [
    ("avx3", "is not a CPU class"),
    ("amx", "above this CPU's class (avx512-bf16)"),
])
def test_a_bad_cap_is_refused_with_what_would_work(monkeypatch, on_cpu, value, says):
    monkeypatch.setenv(cpu_class.ENV_VAR, value)
    on_cpu(AVX512_BF16)
    with pytest.raises(cpu_class.CpuClassError, match=r"choose one of .*or unset it") as err:
        cpu_class.cap()
    assert says in str(err.value)


def test_builds_for_a_named_level_share_one_cache_entry_on_any_cpu(monkeypatch, tmp_path):
    """Only -march=native builds key on the CPU's flags: the AVX2 build the kernel tests make
    (FLAG_SETS patched) and the one QSERVE_CPU_CLASS=avx2 makes are one file."""
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "FLAG_SETS", (native_build.flags_for("x86-64-v3"),))
    first = native_build.build("rms_norm_cpu")
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: "some other cpu")
    assert native_build.build("rms_norm_cpu") == first
    monkeypatch.setattr(native_build, "FLAG_SETS", (native_build.flags_for("native"),))
    native = native_build.build("rms_norm_cpu")
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: "yet another cpu")
    assert native_build.build("rms_norm_cpu") != native


def _env_json(extra: dict) -> tuple[int, str, str]:
    env = {**os.environ, **extra}
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "-m", "qserve.runtime.cli", "env", "--json"],
                         env=env, capture_output=True, text=True, timeout=600)
    return run.returncode, run.stdout, run.stderr


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_class.detected_flags(),
                    reason="needs an x86 CPU with AVX2, FMA and F16C")
def test_qserve_runs_as_an_avx2_cpu_end_to_end():
    """On any AVX2 CPU (AVX-512 and AMX ones included): the C kernels take their AVX2
    builds, torch's ATen dispatches to AVX2, oneDNN has no native bf16, so the large-row
    linear and calibration compute in fp32, exactly as on an AVX2-only CPU."""
    rc, out, err = _env_json({cpu_class.ENV_VAR: "avx2"})
    assert rc == 0, err
    caps = json.loads(out)
    assert caps["cpu_class"] == "avx2"
    assert caps["torch_cpu_capability"] == "AVX2"
    assert caps["onednn_bf16"] is False
    assert caps["cpu_linear"] == "fp32"
    assert caps["calibration_dtype"] == "float32"
    assert caps["fp8_linear"] == "avx2"
    assert caps["fp8_linear_rows"] == "any"
    assert caps["bf16_rows_linear"] == "avx2"
    assert set(caps["c_kernels"].values()) == {"c"}
    own = cpu_class.cpu_class(cpu_class.detected_flags())
    assert caps["own_cpu_class"] == (None if own == "avx2" else own)


def test_a_bad_cap_stops_the_cli_with_the_reason():
    rc, out, err = _env_json({cpu_class.ENV_VAR: "avx3"})
    assert rc != 0 and out == ""
    assert "QSERVE_CPU_CLASS='avx3' is not a CPU class" in err
    assert "Traceback" not in err
