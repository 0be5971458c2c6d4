"""The CPU class the kernels are built for, and QSERVE_CPU_CLASS, which caps it.

    cpu_flags()        # this CPU's feature flags, less those above the cap
    cpu_class(flags)   # the best of CPU_CLASSES these flags allow
    build_march()      # -march for the C kernels: "native", or the cap's x86-64 level
    apply_to_torch()   # ATen and oneDNN capped too (before torch is imported)

QSERVE_CPU_CLASS=avx2 (or avx512, avx512-bf16, portable) makes a machine of a better class
run as one of that class, end to end: the C kernels are built for the class's x86-64
level (x86-64-v3 for avx2) instead of -march=native, ATen's kernels and oneDNN are capped
the same way (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA; so bf16 matmuls are emulated as
on a real AVX2 CPU and the fp32 strategies are chosen; inductor gets a cache directory of
the class's own), and every probe of the CPU's flags (`qserve env`, the llama.cpp build of
the comparison benchmarks) sees the capped flags. An AVX-512 machine can so test and time
the AVX2 paths. Memory bandwidth, cache sizes and clocks stay the machine's own: timings
under a cap are an emulation, and the records say so (`describe()`). A cap above the
CPU's class is refused.
"""

from __future__ import annotations

import getpass
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

ENV_VAR = "QSERVE_CPU_CLASS"
CPU_CLASSES = ("amx", "avx512-bf16", "avx512", "avx2", "portable")  # best first

# flags that a class below each level lacks: dropping them caps the probed flags
_ABOVE = {
    "avx512-bf16": ("amx",),
    "avx512": ("amx", "avx512_bf16", "avx512_fp16"),
    "avx2": ("amx", "avx512", "avx_vnni", "avx_ifma", "avx_ne_convert"),
    "portable": ("amx", "avx", "fma", "f16c", "bmi", "movbe", "sse4", "ssse3", "popcnt"),
}
MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "portable": None}  # under a cap
# what torch is told under a cap (values its ATen dispatch and oneDNN accept)
# MKL_ENABLE_INSTRUCTIONS: torch's fp32 matmuls run in MKL, which neither ATen's nor
# oneDNN's cap reaches (seen: under avx2 on an AMX Xeon, 256-row fp32 linears ran with
# AVX-512, ~1.7x faster than the C kernel beside them, which an AVX2 machine does not show)
_TORCH_ENV = {
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text, or "" where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpuinfo_field(cpuinfo: str, keys: tuple[str, ...]) -> str | None:
    """The value of the first "key : value" line of /proc/cpuinfo text whose key is one of
    `keys` (the first CPU's), stripped; None when there is none."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            return value.strip()
    return None


class CpuClassError(ValueError):
    """QSERVE_CPU_CLASS names no class, or one above what this CPU has."""


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo text (x86 "flags", Arm
    "Features"); empty when there is no such line."""
    return frozenset((cpuinfo_field(cpuinfo, ("flags", "Features")) or "").split())


def cpu_class(flags: Iterable[str]) -> str:
    """The best of CPU_CLASSES that a CPU with these feature flags supports."""
    have = set(flags)
    if {"amx_tile", "amx_bf16"} <= have:
        return "amx"
    if "avx512_bf16" in have:
        return "avx512-bf16"
    if "avx512f" in have:
        return "avx512"
    if {"avx2", "fma"} <= have:
        return "avx2"
    return "portable"


def detected_flags() -> frozenset[str]:
    """This CPU's own feature flags, whatever the cap; empty without /proc/cpuinfo."""
    return parse_cpu_flags(read_cpuinfo())


def cap(flags: Iterable[str] | None = None) -> str | None:
    """The class QSERVE_CPU_CLASS asks for, or None when unset or at or above the CPU's own
    class (then nothing changes). CpuClassError for an unknown class or one the CPU lacks."""
    wanted = os.environ.get(ENV_VAR, "").strip()
    if not wanted:
        return None
    if wanted not in CPU_CLASSES:
        raise CpuClassError(f"{ENV_VAR}={wanted!r} is not a CPU class; choose one of "
                            f"{list(CPU_CLASSES)} or unset it.")
    own = cpu_class(detected_flags() if flags is None else flags)
    if CPU_CLASSES.index(wanted) < CPU_CLASSES.index(own):
        raise CpuClassError(f"{ENV_VAR}={wanted} is above this CPU's class ({own}); a cap "
                            f"can only lower it: choose one of "
                            f"{list(CPU_CLASSES[CPU_CLASSES.index(own):])} or unset it.")
    return None if wanted == own else wanted


def capped_flags(flags: Iterable[str], klass: str | None) -> frozenset[str]:
    """`flags` less every flag above `klass` (None: unchanged)."""
    if klass is None:
        return frozenset(flags)
    drop = _ABOVE.get(klass, ())
    return frozenset(f for f in flags if not f.startswith(drop))


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (e.g. "avx2", "avx512_bf16") as the kernels may use them:
    less those above QSERVE_CPU_CLASS. Empty where /proc/cpuinfo is missing."""
    own = detected_flags()
    return capped_flags(own, cap(own))


def build_march() -> str | None:
    """-march for the C kernels: "native", or under a cap its x86-64 level (None: portable)."""
    klass = cap()
    if klass is None or klass not in MARCH:  # avx512-bf16 on AMX: native less AMX below
        return "native"
    return MARCH[klass]


def build_extra_flags() -> tuple[str, ...]:
    """Extra compiler flags of the first-choice build: 512-bit vectors where the build may
    use AVX-512; under an avx512-bf16 cap on an AMX CPU, no AMX."""
    klass = cap()
    if klass == "avx512-bf16":
        return ("-mprefer-vector-width=512", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
    if klass in (None, "avx512"):
        return ("-mprefer-vector-width=512",)
    return ()


def torch_environment(klass: str | None) -> dict[str, str]:
    """The environment that caps torch's ATen kernels, oneDNN and MKL at `klass` ({} for None),
    and gives inductor a cache of the class's own: its cache key does not hold the vector
    ISA, and a kernel compiled for the CPU's own class, loaded under the cap, computed
    garbage (seen: a 1-thread fused FP8 quantization under avx2 on an AVX-512 machine)."""
    if not klass:
        return {}
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{_user()}-{klass}"
    return {**_TORCH_ENV.get(klass, {}), "TORCHINDUCTOR_CACHE_DIR": str(cache)}


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


def apply_to_torch() -> None:
    """Cap torch like the kernels: sets ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and
    MKL_ENABLE_INSTRUCTIONS (unless the user set them) while torch is not imported yet,
    logging a warning where it already is (the cap then holds for qserve's C kernels
    only), and TORCHINDUCTOR_CACHE_DIR.
    Raises CpuClassError for a bad QSERVE_CPU_CLASS."""
    env = torch_environment(cap())
    if not env:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", env.pop("TORCHINDUCTOR_CACHE_DIR"))
    if "torch" in sys.modules:  # inductor reads its cache directory late, ATen and oneDNN not
        missing = {k: v for k, v in env.items() if os.environ.get(k) != v}
        if missing:
            log.warning("%s=%s: torch was imported before qserve, so its kernels are not "
                        "capped; set %s in the environment too.", ENV_VAR, os.environ[ENV_VAR],
                        " ".join(f"{k}={v}" for k, v in missing.items()))
        return
    for key, value in env.items():
        os.environ.setdefault(key, value)


def describe() -> str:
    """The class in force, and where it is capped the CPU's own: for records of timings."""
    flags = detected_flags()
    own, klass = cpu_class(flags), cap(flags)
    return own if klass is None else f"{klass} (emulated by {ENV_VAR} on an {own} CPU)"


__all__ = ["CPU_CLASSES", "ENV_VAR", "CpuClassError", "apply_to_torch", "build_extra_flags",
           "build_march", "cap", "capped_flags", "cpu_class", "cpu_flags", "cpuinfo_field",
           "describe", "detected_flags", "parse_cpu_flags", "read_cpuinfo", "torch_environment"]
