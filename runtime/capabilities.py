"""What this machine offers qserve, and which kernel each CPU op takes on it (`qserve env`).

    caps = probe()     # never raises: an item that fails holds "error: ..." instead
    caps.lines()       # the human report, one "label: value" a line
    caps.one_line()    # the same in one line, for a log
    caps.as_dict()     # the same for JSON

The CPU class (`cpu_class`) is the best of "amx", "avx512-bf16", "avx512", "avx2" and
"portable" the CPU's feature flags allow, or the lower one QSERVE_CPU_CLASS asks for
(kernels/cpu_class.py). Probing loads the C kernel libraries, compiling
any this machine has not built yet.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import platform
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..kernels.cpu_class import (CPU_CLASSES, cpu_class, cpu_flags, cpuinfo_field,
                                 parse_cpu_flags, read_cpuinfo)

RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vbmi", "avx512_bf16",
                  "amx_tile", "amx_bf16")
C_KERNELS = (  # (op, kernels module, its function that says whether the C library loaded)
    ("RMS norm", "native_norm", "available"),
    ("rotary", "native_rotary", "available"),
    ("KV store", "native_kv_store", "available"),
    ("paged attention", "native_attention", "native_available"),
    ("prompt attention", "native_prefill_attention", "native_prefill_available"),
    ("FP8 activation", "native_fp8", "available"),
    ("token mask (structured outputs)", "native_token_bitmask", "available"),
)

T = TypeVar("T")


def cpu_model() -> str:
    """The CPU's "model name" from /proc/cpuinfo, else platform.processor(), else "unknown"."""
    return (cpuinfo_field(read_cpuinfo(), ("model name",)) or platform.processor()
            or "unknown")


@dataclass(frozen=True)
class Capabilities:
    """One probe's answers. A field that could not be found holds "error: TYPE: message"."""

    cpu_model: str
    cpu_class: str  # one of CPU_CLASSES
    cpu_flags: tuple[str, ...]  # the RELEVANT_FLAGS the CPU has, in that order
    torch_version: str
    torch_threads: int | str
    onednn_bf16: bool | str  # oneDNN runs bf16 natively on this CPU
    c_compiler: str  # "VERSION (PATH)"
    native_cache: str  # where the compiled C kernels are kept
    fp8_linear: str  # the FP8 linear's C path (a native_fp8_gemv.PATHS entry) or "torch"
    cpu_linear: str  # how large-row linears run: "onednn-bf16" or "fp32" (kernels/cpu_linear)
    bf16_rows_linear: str  # how a bf16 linear (LM head) runs few rows: the above or the C path
    calibration_dtype: str  # what `qserve quantize --dtype auto` computes in
    c_kernels: tuple[tuple[str, str], ...]  # (op, "c" or "torch") for each of C_KERNELS
    # rows the FP8 linear's C path serves in one pass over the weights: "any" (AVX2) or
    # "up to 16" (one AMX tile; a batch-invariant engine runs more rows in several passes,
    # else they take the large-row linear)
    fp8_linear_rows: str = "up to 16"
    # the W8A8 int8 linear's C path (a native_int8_gemm.PATHS entry) or "torch"
    int8_linear: str = "torch"
    # where QSERVE_CPU_CLASS caps the class (kernels/cpu_class.py): the CPU's own class
    own_cpu_class: str | None = None
    torch_cpu_capability: str = "unknown"  # the ISA torch's ATen kernels dispatch to
    # how a bf16 model's prompt chunks run attention: "c" (the C prompt kernel) or "sdpa"
    # (torch's, on AMX tiles where the class is amx); kernels/paged_attention.py
    bf16_prompt_attention: str = "unknown"
    # the engine's one decision under `--device auto` (runtime/execution_backend.py)
    execution: str = "unknown"

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict (c_kernels as {op: "c" or "torch"})."""
        out = dataclasses.asdict(self)
        out["cpu_flags"] = list(self.cpu_flags)
        out["c_kernels"] = dict(self.c_kernels)
        return out

    def lines(self) -> list[str]:
        """The human report, one item a line."""
        rows = [
            ("engine (--device auto)", self.execution),
            ("CPU", self.cpu_model),
            ("CPU class", self._class_text()),
            ("CPU flags", " ".join(self.cpu_flags) or "none of " + " ".join(RELEVANT_FLAGS)),
            ("torch", self.torch_version),
            ("torch threads", self.torch_threads),
            ("torch CPU capability", self.torch_cpu_capability),
            ("oneDNN bf16", self._onednn_text()),
            ("C compiler", self.c_compiler),
            ("native cache", self.native_cache),
            ("FP8 linear", self.fp8_linear),
            ("FP8 linear rows per pass", self.fp8_linear_rows),
            ("W8A8 int8 linear", self.int8_linear),
            ("large-row linear", self.cpu_linear),
            ("bf16 linear, few rows", self.bf16_rows_linear),
            ("calibration dtype", self.calibration_dtype),
            *self.c_kernels,
            ("bf16 prompt attention", self.bf16_prompt_attention),
        ]
        width = max(len(name) for name, _ in rows) + 1
        return [f"{name + ':':<{width}} {value}" for name, value in rows]

    def _class_text(self) -> str:
        if self.own_cpu_class is None:
            return self.cpu_class
        return f"{self.cpu_class} (QSERVE_CPU_CLASS; the CPU's own: {self.own_cpu_class})"

    def _onednn_text(self) -> str:
        return {True: "native", False: "not native"}.get(self.onednn_bf16, self.onednn_bf16)

    def one_line(self) -> str:
        """The report in one line, for a log."""
        c = [op for op, path in self.c_kernels if path == "c"]
        torch = [op for op, path in self.c_kernels if path == "torch"]
        kernels = "; ".join([*([f"C kernels: {', '.join(c)}"] if c else []),
                             *([f"torch ops: {', '.join(torch)}"] if torch else []),
                             *(f"{op}: {path}" for op, path in self.c_kernels
                               if path not in ("c", "torch"))])
        return (f"{self.execution}; "
                f"{self.cpu_model} ({self._class_text()}); torch {self.torch_version}, "
                f"{self.torch_threads} threads, oneDNN bf16 {self._onednn_text()}; "
                f"FP8 linear {self.fp8_linear} ({self.fp8_linear_rows} rows a pass), large-row "
                f"linear {self.cpu_linear}, bf16 "
                f"linear few rows {self.bf16_rows_linear}; {kernels}; bf16 prompt "
                f"attention {self.bf16_prompt_attention}")


def _guarded(fn: Callable[[], T]) -> T | str:
    """fn(), or the error it raised as one short line."""
    try:
        return fn()
    except Exception as exc:  # a report item that fails must not stop the report
        text = " ".join(str(exc).split())
        return f"error: {type(exc).__name__}: {text[:200]}"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _torch_cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _own_cpu_class(shown: str) -> str | None:
    """The CPU's own class where QSERVE_CPU_CLASS caps it below that, else None."""
    from ..kernels.cpu_class import detected_flags

    own = cpu_class(detected_flags())
    return None if own == shown else own


def _onednn_bf16() -> bool:
    import torch

    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _c_compiler() -> str:
    from ..kernels import native_build

    path, version = native_build._compiler()
    return f"{version} ({path})"


def _native_cache() -> str:
    from ..kernels import native_build

    return str(native_build.cache_dir())


def _fp8_linear() -> str:
    from ..kernels import native_fp8_gemv

    return native_fp8_gemv.path() or "torch"


def _int8_linear() -> str:
    from ..kernels import native_int8_gemm

    return native_int8_gemm.path() or "torch"


def _c_kernel(module: str, available: str) -> str:
    mod = importlib.import_module(f"..kernels.{module}", __package__)
    return "c" if getattr(mod, available)() else "torch"


def _bf16_prompt_attention() -> str:
    import torch

    from ..kernels.native_prefill_attention import native_prefill_available
    from ..kernels.paged_attention import default_prefill_impl

    impl = default_prefill_impl(torch.bfloat16)
    return "c" if impl == "native" and native_prefill_available() else "sdpa"


def _cpu_linear() -> str:
    from ..kernels import cpu_linear

    return cpu_linear.strategy()


def _bf16_rows_linear(large_row: str) -> str:
    """How a bf16 linear (the LM head) runs a decode step: on the large-row path where that
    is oneDNN bf16, else the C bf16 linear (its build's path) or torch."""
    from ..kernels import native_bf16_gemv

    if large_row != "fp32":
        return large_row
    if not native_bf16_gemv.available():
        return "fp32"
    return "avx2" if native_bf16_gemv.vectorized() else "portable"


def _fp8_linear_rows() -> str:
    from ..kernels import native_fp8_gemv

    rows = native_fp8_gemv.pass_rows()
    return "any" if rows > 2**31 else f"up to {rows}"


def _calibration_dtype() -> str:
    from ..kernels.cpu_linear import bulk_matmul_dtype  # what calibration computes in

    return str(bulk_matmul_dtype()).removeprefix("torch.")


def _execution() -> str:
    from .device import resolve_device
    from .execution_backend import ExecutionBackend

    return ExecutionBackend.choose(resolve_device("auto")).line()


def probe() -> Capabilities:
    """This machine's capabilities and kernel paths (loads, and if needed compiles, the C
    kernel libraries). Never raises."""
    flags = _guarded(cpu_flags)
    flags = flags if isinstance(flags, frozenset) else frozenset()
    onednn = _guarded(_onednn_bf16)
    large_row = _guarded(_cpu_linear)
    klass = cpu_class(flags)
    own = _guarded(lambda: _own_cpu_class(klass))
    return Capabilities(
        cpu_model=_guarded(cpu_model),
        cpu_class=klass,
        own_cpu_class=own,
        torch_cpu_capability=_guarded(_torch_cpu_capability),
        cpu_flags=tuple(f for f in RELEVANT_FLAGS if f in flags),
        torch_version=_guarded(_torch_version),
        torch_threads=_guarded(_torch_threads),
        onednn_bf16=onednn,
        c_compiler=_guarded(_c_compiler),
        native_cache=_guarded(_native_cache),
        fp8_linear=_guarded(_fp8_linear),
        cpu_linear=large_row,
        bf16_rows_linear=_guarded(lambda: _bf16_rows_linear(large_row)),
        calibration_dtype=_guarded(_calibration_dtype),
        c_kernels=tuple((op, _guarded(lambda m=module, a=fn: _c_kernel(m, a)))
                        for op, module, fn in C_KERNELS),
        bf16_prompt_attention=_guarded(_bf16_prompt_attention),
        fp8_linear_rows=_guarded(_fp8_linear_rows),
        int8_linear=_guarded(_int8_linear),
        execution=_guarded(_execution),
    )


__all__ = ["CPU_CLASSES", "C_KERNELS", "Capabilities", "RELEVANT_FLAGS", "cpu_class",
           "cpu_flags", "cpu_model", "parse_cpu_flags", "probe"]
