"""Elementwise steps of the C decode path in C on CPU (csrc/elementwise_cpu.c): the
residual add, the bias add, the gated activation bf16(bf16(act(gate)) * up) and the fp32 ->
bf16 rounding of attention's output, and the copy of bf16 rows between strided layouts
(plain, or with each row's interleaved pairs split into halves). Called through
kernels/native_step_program.py; the library is None where it cannot build."""

from __future__ import annotations

from .native_build import cached_library

_library = cached_library("elementwise_cpu")
