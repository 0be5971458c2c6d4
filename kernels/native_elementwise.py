"""Elementwise steps of the C decode path in C on CPU (csrc/elementwise_cpu.c): the
residual add, the bias add, the gated activation bf16(bf16(act(gate)) * up) and the fp32 ->
bf16 rounding of attention's output, and the copy of bf16 rows between strided layouts
(plain, or with each row's interleaved pairs split into halves). Called through
kernels/native_step_program.py; the library is None where it cannot build."""

from __future__ import annotations

import ctypes

from .native_build import cached_library

_P = ctypes.c_void_p
_I64 = ctypes.c_int64

_library = cached_library("elementwise_cpu", {
    "qserve_add_bf16": ([_P, _P, _I64], None),
    "qserve_add_rows_bf16": ([_P, _P, _I64, _I64], None),
    "qserve_act_mul_bf16": ([_P, _I64, _I64, ctypes.c_int, _P], None),
    "qserve_round_bf16": ([_P, _I64, _P], None),
    "qserve_copy_rows_bf16": ([_P, _I64, _I64, _I64, _P, _I64], None),
    "qserve_deinterleave_rows_bf16": ([_P, _I64, _I64, _I64, _P, _I64], None),
})
