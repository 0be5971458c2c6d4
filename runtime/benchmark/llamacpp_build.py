"""The llama.cpp server binary: built once from the llama-cpp-python source distribution.

llama-cpp-python's sdist on PyPI vendors the whole llama.cpp tree (vendor/llama.cpp), so
llama.cpp's own C++ server (`llama-server`, continuous batching with `--parallel N`) can
be built from PyPI alone. The build lives in the cache directory
(`QSERVE_CACHE`/llama.cpp/<version>/) and is reused.

Flags: the native build (`GGML_NATIVE=ON`) enables the AMX matmul path, which was seen
to crash on the machine these numbers come from; the build is therefore portable
(`GGML_NATIVE=OFF`) with AVX, AVX2, FMA, F16C and AVX-512 on and AMX off. Nothing is
fetched during the build (no prebuilt web UI, no HTTPS client).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qserve.quantize.sources import cache_root

from .errors import BenchmarkError

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
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
VENDOR_PREFIX = "vendor/llama.cpp/"


@dataclass(frozen=True)
class LlamaServerBuild:
    binary: Path  # the llama-server executable
    version: str  # the llama-cpp-python sdist version it came from


def build_dir() -> Path:
    return cache_root() / "llama.cpp"


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
    root = build_dir()
    existing = sorted(root.glob("*/build/bin/llama-server"))
    if existing:
        return LlamaServerBuild(existing[-1], existing[-1].parents[2].name)
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    sdist = _download_sdist(downloads, log)
    version = sdist.name[len("llama_cpp_python-"):-len(".tar.gz")]
    here = root / version
    here.mkdir(parents=True, exist_ok=True)
    src, build = here / "src", here / "build"
    if not (src / "CMakeLists.txt").is_file():
        _extract_vendor(sdist, src)
    print(f"building llama-server {version} in {build} (log: {log})", file=sys.stderr)
    _run(["nice", "cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], here, log)
    _run(["nice", "cmake", "--build", str(build), "--target", "llama-server",
          "-j", str(jobs)], here, log)
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise BenchmarkError(f"the build finished but {binary} is missing; see {log}")
    return LlamaServerBuild(binary, version)


if __name__ == "__main__":
    print(ensure_llama_server().binary)
