"""llama.cpp's cmake flags follow the CPU's features; each flag set has its own build folder."""

from qserve.runtime.benchmark.llamacpp_build import (BASE_CMAKE_FLAGS, ISA_OPTIONS, build_name,
                                                      cmake_flags, find_llama_server)

AVX2 = {"fpu", "sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"}  # e.g. AMD Zen 2
AVX512_BF16 = AVX2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vbmi",
                      "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
                      "amx_bf16"}  # e.g. Intel Sapphire Rapids


def _isa(flags: list[str]) -> dict[str, str]:
    """{option: "ON"/"OFF"} of the ISA_OPTIONS part."""
    assert flags[:len(BASE_CMAKE_FLAGS)] == BASE_CMAKE_FLAGS
    return dict(f.removeprefix("-D").split("=") for f in flags[len(BASE_CMAKE_FLAGS):])


def test_avx2_cpu_gets_no_avx512():
    assert _isa(cmake_flags(AVX2)) == {
        "GGML_SSE42": "ON", "GGML_AVX": "ON", "GGML_AVX2": "ON", "GGML_BMI2": "ON",
        "GGML_FMA": "ON", "GGML_F16C": "ON", "GGML_AVX_VNNI": "OFF", "GGML_AVX512": "OFF",
        "GGML_AVX512_VBMI": "OFF", "GGML_AVX512_VNNI": "OFF", "GGML_AVX512_BF16": "OFF"}


def test_avx512_bf16_cpu_gets_avx512_and_no_amx():
    flags = cmake_flags(AVX512_BF16)
    assert set(_isa(flags).values()) == {"ON"}
    assert len(flags) == len(BASE_CMAKE_FLAGS) + len(ISA_OPTIONS)
    for amx in ("TILE", "INT8", "BF16"):
        assert f"-DGGML_AMX_{amx}=OFF" in flags and f"-DGGML_AMX_{amx}=ON" not in flags
    assert "-DGGML_NATIVE=OFF" in flags


def test_avx512_extension_needs_the_whole_avx512_base():
    isa = _isa(cmake_flags(AVX2 | {"avx512f", "avx512_bf16"}))  # no avx512cd/vl/dq/bw
    assert (isa["GGML_AVX512"], isa["GGML_AVX512_BF16"]) == ("OFF", "OFF")


def test_no_flags_turns_every_isa_off():
    assert set(_isa(cmake_flags(set())).values()) == {"OFF"}


def test_build_folder_is_per_flag_set(tmp_path, monkeypatch):
    avx2, avx512 = cmake_flags(AVX2), cmake_flags(AVX512_BF16)
    assert build_name(avx2) == build_name(list(avx2)) != build_name(avx512)
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    for folder in (build_name(avx512), "build"):  # "build": an earlier version's layout
        binary = tmp_path / "llama.cpp" / "0.3.1" / folder / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.touch()
    assert find_llama_server(avx2) is None
    found = find_llama_server(avx512)
    assert found is not None
    assert found.binary == tmp_path / "llama.cpp" / "0.3.1" / build_name(avx512) / "bin" / \
        "llama-server"
    assert (found.version, found.cmake_flags) == ("0.3.1", tuple(avx512))
