"""Build a C source of kernels/csrc into a shared library once per machine, load it with ctypes.

    lib = load_library("paged_attention_cpu")     # ctypes.CDLL, or None (logged) on failure
    lib = bind_library(NAME)        # the same, every qserve_* entry point's signature set
    _library = cached_library(NAME)   # a function: bind_library once, then cached

Each entry point is bound (argtypes, restype) from its C prototype (c_source.py reads the
source), so no Python code restates a signature.

csrc/NAME.c (which may include the folder's headers) is compiled with the system C compiler
(`CC`, else `cc`) for this CPU (`-O3 -march=native -fopenmp`) into QSERVE_CACHE/native
(default ~/.cache/qserve/native) under a name that hashes the source and headers, the
compiler's version, the flags and (for -march=native) the CPU's feature flags, so a changed
source, compiler or machine builds a fresh one. QSERVE_CPU_CLASS (kernels/cpu_class.py)
builds for a lower class's x86-64 level instead of -march=native. The file is
written under a temporary name and renamed into place, so concurrent processes never load
a half-written library. OpenMP: the library links `libgomp.so.1`, the runtime torch has
already loaded, so kernels share torch's thread pool.

Where the build for this CPU fails, the portable flags are tried; where building fails
altogether (no compiler, unsupported flags) the caller falls back to its torch path; the
failure is logged once per library. QSERVE_REQUIRE_COMPILE=1 (kernels/inductor.py) turns
a failed build for this CPU into an error (no portable build, no torch fallback), so tests
cannot pass on a slower path by accident.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

from . import cpu_class
from .c_source import SOURCE_DIR, Signature, library_signatures
from .cache import cache_root
from .cpu_class import cpuinfo_field, read_cpuinfo
from .inductor import require_compile

log = logging.getLogger(__name__)

# -fno-trapping-math: the kernels never read FP exception flags, and without it GCC keeps
# loops with selects (clamps, NaN checks) scalar where the CPU has no AVX-512 masks
# (elementwise_cpu.c's activation loop). Roundings are unchanged.
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")


def flags_for(march: str | None, *extra: str) -> list[str]:
    """Compiler flags for a build for `march` (e.g. "native", "x86-64-v3"; None: portable)."""
    return [COMMON_FLAGS[0], *([f"-march={march}"] if march else []), *extra, *COMMON_FLAGS[1:]]


FLAG_SETS = (  # tried in order: the first that compiles is used. -march=native, or the
    # x86-64 level of the class QSERVE_CPU_CLASS caps this CPU at (kernels/cpu_class.py)
    flags_for(cpu_class.build_march(), *cpu_class.build_extra_flags()),
    flags_for(None),
)


class NativeBuildError(RuntimeError):
    """A kernel library could not be compiled or loaded."""


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return cache_root() / "native"


def _cpu_flags() -> str:
    """The CPU's feature flags line (x86 "flags", Arm "Features"), else the processor name:
    part of the cache key of each library built for this CPU (-march=native)."""
    return cpuinfo_field(read_cpuinfo(), ("flags", "Features")) or platform.processor()


def _compiler() -> tuple[str, str]:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeBuildError(f"no C compiler: {cc!r} is not on PATH (set CC to one).")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        raise NativeBuildError(f"{path} --version failed: {exc}") from exc
    return path, version


def build(name: str) -> Path:
    """The compiled library for csrc/NAME.c, building it if this machine has none yet."""
    source = SOURCE_DIR / f"{name}.c"
    if not source.is_file():
        raise NativeBuildError(f"no kernel source {source.name} in {SOURCE_DIR.name}/.")
    code = source.read_bytes() + b"".join(  # the headers it may include count too
        h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    cc, version = _compiler()
    errors = []
    for flags in FLAG_SETS:
        # a build for a named level (x86-64-v3, portable) is the same on any CPU
        machine = _cpu_flags() if "-march=native" in flags else ""
        key = hashlib.sha256(b"\0".join([code, version.encode(), " ".join(flags).encode(),
                                         machine.encode()])).hexdigest()[:16]
        target = cache_dir() / f"{name}-{key}.so"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode == 0:
                os.replace(tmp, target)
                return target
            errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-500:]}")
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if require_compile():  # the portable build would hide a broken fast path
            break
    raise NativeBuildError(f"compiling {source.name} failed:\n" + "\n".join(errors))


def load_library(name: str) -> ctypes.CDLL | None:
    """csrc/NAME.c as a loaded library, or None where it cannot be built (logged once;
    raises instead under QSERVE_REQUIRE_COMPILE=1)."""
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = ctypes.CDLL(str(build(name)))
            except (NativeBuildError, OSError) as exc:
                if require_compile():
                    raise
                log.warning("native kernel %s unavailable (%s); using the torch path.",
                            name, exc)
                _loaded[name] = None
        return _loaded[name]


def bind_library(name: str) -> ctypes.CDLL | None:
    """load_library(name) with each exported entry point's argtypes and restype set from
    its C prototype, or None where it cannot be built. Callers cache the result
    (cached_library); a raise under QSERVE_REQUIRE_COMPILE is not cached."""
    lib = load_library(name)
    if lib is not None:
        for signature in library_signatures(name).values():
            function = getattr(lib, signature.name)
            function.argtypes = signature.argtypes
            function.restype = signature.restype
    return lib


# library name -> {entry point: Signature}: every library bound through cached_library
BINDINGS: dict[str, dict[str, Signature]] = {}
_cached: dict[str, Callable[[], ctypes.CDLL | None]] = {}


def cached_library(name: str) -> Callable[[], ctypes.CDLL | None]:
    """A function that returns bind_library(name), loading on its first call and then
    cached (`cache_clear()` forgets it; a raise under QSERVE_REQUIRE_COMPILE is not cached,
    so the next call tries again). The same function for every caller of one name; its
    signatures are recorded in BINDINGS (read now: a prototype this cannot bind raises
    c_source.CSourceError at import)."""
    if name not in _cached:
        BINDINGS[name] = library_signatures(name)
        _cached[name] = functools.cache(lambda: bind_library(name))
    return _cached[name]


__all__ = ["BINDINGS", "NativeBuildError", "SOURCE_DIR", "bind_library", "build", "cache_dir",
           "cached_library", "cpuinfo_field", "load_library", "read_cpuinfo"]
