"""The llama.cpp server binary: built once from the llama-cpp-python source distribution.

llama-cpp-python's sdist on PyPI vendors the whole llama.cpp tree (vendor/llama.cpp), so
llama.cpp's own C++ server (`llama-server`, continuous batching with `--parallel N`) can
be built from PyPI alone. The build lives in the cache directory
(`QSERVE_CACHE`/llama.cpp/<version>/build-<hash of its cmake flags>/) and is reused.

Flags: the native build (`GGML_NATIVE=ON`) enables the AMX matmul path, which was seen
to crash on the machine these numbers come from; the build therefore sets
`GGML_NATIVE=OFF` and names each instruction set itself (`cmake_flags`): on where this
CPU has it (its /proc/cpuinfo flags), off where it has not, AMX always off. ggml turns
SSE4.2, AVX, AVX2, BMI2, FMA and F16C on by default once `GGML_NATIVE=OFF`, so each is
set either way. A build for another CPU (a cache directory shared or copied between
machines) has other flags, hence another folder, and is never run here. Nothing is
fetched during the build (no prebuilt web UI, no HTTPS client).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from qserve.kernels.cache import cache_root
from qserve.runtime.capabilities import cpu_flags

from .errors import BenchmarkError

BASE_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
# GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
ISA_OPTIONS = (  # (ggml option, the /proc/cpuinfo flags it needs, all of them)
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", _AVX512),
    ("GGML_AVX512_VBMI", (*_AVX512, "avx512_vbmi")),
    ("GGML_AVX512_VNNI", (*_AVX512, "avx512_vnni")),
    ("GGML_AVX512_BF16", (*_AVX512, "avx512_bf16")),
)
VENDOR_PREFIX = "vendor/llama.cpp/"


@dataclass(frozen=True)
class LlamaServerBuild:
    binary: Path  # the llama-server executable
    version: str  # the llama-cpp-python sdist version it came from
    cmake_flags: tuple[str, ...]  # what it was configured with


def cmake_flags(cpu: Iterable[str]) -> list[str]:
    """The cmake -D flags for a CPU with these /proc/cpuinfo feature flags: BASE_CMAKE_FLAGS,
    then each of ISA_OPTIONS ON where the CPU has all it needs, else OFF."""
    have = set(cpu)
    return [*BASE_CMAKE_FLAGS, *(f"-D{option}={'ON' if have.issuperset(needs) else 'OFF'}"
                                 for option, needs in ISA_OPTIONS)]


def build_name(flags: Iterable[str]) -> str:
    """The build folder's name for these cmake flags: "build-" + 12 hex digits of their hash."""
    return "build-" + hashlib.sha256("\n".join(flags).encode()).hexdigest()[:12]


def build_dir() -> Path:
    return cache_root() / "llama.cpp"


def find_llama_server(flags: list[str]) -> LlamaServerBuild | None:
    """The cached llama-server built with exactly these cmake flags (the newest version),
    or None."""
    found = sorted(build_dir().glob(f"*/{build_name(flags)}/bin/llama-server"))
    if not found:
        return None
    return LlamaServerBuild(found[-1], found[-1].parents[2].name, tuple(flags))


def _run(cmd: list[str], cwd: Path, log: Path) -> None:
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BenchmarkError(
            f"`{' '.join(cmd[:3])} ...` failed (exit {done.returncode}); see the log {log}"
        )


def _download_sdist(dest: Path, log: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), "llama-cpp-python"]
    _run(cmd, dest, log)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise BenchmarkError(f"pip download left no llama_cpp_python-*.tar.gz in {dest}")
    return found[-1]


def _extract_vendor(sdist: Path, src: Path) -> None:
    """Unpack only vendor/llama.cpp of the sdist into `src` (atomic: temp + rename)."""
    tmp = Path(tempfile.mkdtemp(dir=src.parent, prefix="src.tmp"))
    try:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                rel = member.name.split("/", 1)[-1]
                if not rel.startswith(VENDOR_PREFIX) or not (member.isfile() or member.isdir()):
                    continue
                member.name = rel[len(VENDOR_PREFIX):]
                if member.name:
                    tar.extract(member, tmp, filter="data")
        if not (tmp / "CMakeLists.txt").is_file():
            raise BenchmarkError(f"{sdist.name} has no vendor/llama.cpp tree")
        os.replace(tmp, src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_llama_server(jobs: int = 2) -> LlamaServerBuild:
    """Return the cached llama-server, building it first if needed (minutes on 2 cores)."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BenchmarkError(
                f"`{tool}` is not installed; building llama-server needs cmake and a C++ "
                "compiler (Debian: apt-get install -y cmake g++)"
            )
    flags = cmake_flags(cpu_flags())
    existing = find_llama_server(flags)
    if existing is not None:
        return existing
    root = build_dir()
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    sdist = _download_sdist(downloads, log)
    version = sdist.name[len("llama_cpp_python-"):-len(".tar.gz")]
    here = root / version
    here.mkdir(parents=True, exist_ok=True)
    src, build = here / "src", here / build_name(flags)
    if not (src / "CMakeLists.txt").is_file():
        _extract_vendor(sdist, src)
    print(f"building llama-server {version} in {build} (log: {log})", file=sys.stderr)
    _run(["nice", "cmake", "-S", str(src), "-B", str(build), *flags], here, log)
    _run(["nice", "cmake", "--build", str(build), "--target", "llama-server",
          "-j", str(jobs)], here, log)
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise BenchmarkError(f"the build finished but {binary} is missing; see {log}")
    return LlamaServerBuild(binary, version, tuple(flags))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m qserve.runtime.benchmark.llamacpp_build",
        description="Build (once) and print the path of the cached llama-server.")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    args = ap.parse_args(argv)
    try:
        print(ensure_llama_server(args.jobs).binary)
    except BenchmarkError as e:
        print(f"llamacpp_build: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
