"""An 8-bit linear: static W8A8 FP8 linear layer (the runtime form of a compressed-tensors FP8 linear), or
weight-only W8A16 (no input scale: the input is not quantized, the weight still is), or
W8A8 with dynamic per-token input scales (`dynamic_input`: the layout vLLM's CPU build
serves; each row of the input gets scale max|row| / 448, as vLLM computes it, and the
product is accumulated and scaled in fp32; runs in torch only, never the C kernels).

Replaces an `nn.Linear` of a quantized artifact. On CPU the FP8 weight is upcast once at
load to the compute dtype (exact: every E4M3 value is a bf16 value) and the input is
quantized to FP8 and back with the static input scale, so numerics match the GPU FP8 path
(kernels/fp8_gemm.py); memory holds bf16 weights, the artifact on disk holds FP8.
`pack()` (called by the engine, runtime/layers/packing.py) replaces the bf16 weight by the
CPU's packed form for many rows (kernels/cpu_linear.py: oneDNN's blocked bf16 layout where
bf16 is native, else an fp32 copy) and, by default, keeps the E4M3 bytes beside it (one
more byte per weight): inputs of up to `c_rows` rows then run the C kernel that reads
those bytes, multiplying them with AMX tiles, AVX512-BF16 dot products or AVX2 FMAs, each
row with the sums it gets alone (kernels/native_fp8_gemv.py); `c_rows` is set by
runtime/layers/packing.py (every step when the engine is batch-invariant). On CUDA the layer
runs the FP8 GEMM its engine's ExecutionBackend chose (`place`: torch._scaled_mm or the
Triton kernel, through kernels/dispatch.py) on the FP8 bytes, made once from the exact
bf16 values.

`codes="int8"`: weight-only with int8 codes instead of E4M3 (W8A16 int, symmetric, one
scale per output channel or per tensor: compressed-tensors' `type: int` weights). The
same layer otherwise: every int8 value is exact in bf16, so the torch path is the same
matmul, and the C kernel reads the int8 bytes in the same tile layout
(native_fp8_gemv.pack_int8_weight). On every device the torch path runs (no GPU kernel).

`codes="int8"` with `dynamic_input`: W8A8 int8 (compressed-tensors' "int-quantized"),
each input row quantized to int8 with its own scale at run time and multiplied in exact
int32 sums (kernels/int8_gemm.py). The weight stays int8 (one byte); pack() moves it into
the C kernel's band layout (kernels/native_int8_gemm.py), which then runs every CPU call
of bf16 rows, whatever their number: integer sums are the same in any order, so the C
kernel, torch's integer matmul and any batch give the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import dispatch, native_fp8_gemv, native_int8_gemm
from ...kernels.fp8 import FP8_DTYPE, quantize_per_token
from ...kernels.fp8_gemm import fp8_linear_torch
from ...kernels.int8_gemm import int8_linear_torch
from ...kernels.cpu_linear import pack_linear_weight, packing_available

CODES = ("e4m3", "int8")  # what a weight byte holds


class Fp8Linear(nn.Module):
    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype, dynamic_input: bool = False, codes: str | None = None):
        super().__init__()
        # "e4m3" | "int8": what one weight byte holds (default: from weight_fp8's dtype)
        codes = codes or ("int8" if weight_fp8.dtype == torch.int8 else "e4m3")
        if codes not in CODES:
            raise ValueError(f"codes must be one of {CODES}, got {codes!r}.")
        if codes == "int8" and input_scale is not None:
            raise ValueError("an int8 linear has no static input scale: it is weight-only "
                             "(W8A16) or quantizes its inputs per row (dynamic_input).")
        self.codes = codes
        self.compute_dtype = dtype  # of the input, the output and the bias
        # W8A8 int8: int8 inputs per row, exact int32 sums (kernels/int8_gemm.py)
        self.int8_inputs = codes == "int8" and dynamic_input
        out_features, in_features = weight_fp8.shape
        self.in_features, self.out_features = in_features, out_features
        # [out, in] compute dtype, the exact E4M3 values (oneDNN layout once packed); int8
        # codes as they are for W8A8 int8 (the C kernel's band layout once packed)
        self.weight = nn.Parameter(weight_fp8.to(torch.int8 if self.int8_inputs else dtype),
                                   requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1, 1))  # [out|1, 1]
        if dynamic_input and input_scale is not None:
            raise ValueError("a dynamic-input FP8 linear has no static input scale")
        self.dynamic_input = dynamic_input  # W8A8, one scale per input row at run time
        self.weight_only = input_scale is None and not dynamic_input  # W8A16
        self._weight_f32: torch.Tensor | None = None  # [in, out] fp32, dynamic inputs only
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.float().reshape(1))  # [1] fp32 or None
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        # [1, out|1] fp32: both scales (the weight's alone when weight-only), applied to the
        # fp32 accumulator in one multiply
        out_scale = self.weight_scale.reshape(1, -1)
        if self.input_scale is not None:
            out_scale = self.input_scale.reshape(1, 1) * out_scale
        self.register_buffer("out_scale", out_scale, persistent=False)
        self.packed = False
        self._device_fp8: torch.Tensor | None = None  # [out, in] float8_e4m3fn, GPU path
        # small batches: the E4M3 bytes in the C kernel's tile layout
        self._c_weight: native_fp8_gemv.PackedFp8Weight | None = None
        # W8A8 int8: the int8 codes in the C kernel's band layout, kept by pack()
        self._c_int8: native_int8_gemm.PackedInt8Weight | None = None
        self._c_input_scale = 0.0  # float(input_scale), set with _c_weight
        self.c_rows = 0  # the most rows that run the C kernel (packing.c_kernel_rows)
        # how the device path multiplies (an ExecutionBackend.fp8_gemm other than "cpu",
        # set by place_on_device); None: by the input's device (kernels/dispatch.py)
        self.gemm: str | None = None

    @property
    def c_weight(self) -> "native_fp8_gemv.PackedFp8Weight | None":
        """The weight's codes in the C kernel's tile layout (E4M3 or int8 bytes), kept by
        pack() where the C kernel runs this layer; None elsewhere. What the C decode path
        (runtime/models/native_decoder.py) reads."""
        return self._c_weight

    @property
    def c_int8_weight(self) -> "native_int8_gemm.PackedInt8Weight | None":
        """A W8A8 int8 layer's codes in the C kernel's band layout, kept by pack() where
        that kernel is vectorised; None elsewhere. What the C decode path reads."""
        return self._c_int8

    @property
    def c_input_scale(self) -> float:
        """The static input scale as the C kernel takes it: 0.0 for a weight-only layer."""
        return self._c_input_scale

    def pack(self, keep_fp8: bool = True) -> bool:
        """Replace the weight by the CPU's packed form for many rows (cpu_linear: oneDNN's
        layout in place, or an fp32 copy where bf16 is not native). keep_fp8: also keep the
        E4M3 bytes, in the tile layout of the small-batch C kernel, where it is vectorised
        (AMX, AVX512-BF16, AVX2; bf16 only; its portable loop is slower than the matmul).
        Afterwards the weight's elements are only readable through the layer."""
        if self.packed:
            return True
        if self.int8_inputs:  # the C kernel at every row count, where it is vectorised
            w = self.weight  # keep_fp8 False: no C form kept, torch's exact integer matmul
            if not keep_fp8 or w.device.type != "cpu" \
                    or native_int8_gemm.path() in (None, "portable"):
                return False
            try:
                self._c_int8 = native_int8_gemm.pack_int8_w8a8_weight(w.detach())
            except native_int8_gemm.Int8RangeError:
                return False  # -128 (another writer's full range): torch's integer matmul
            # the band layout is the only copy kept (one byte a weight)
            self.weight = nn.Parameter(self._c_int8.data, requires_grad=False)
            self.packed = True
            return True
        if self.dynamic_input:
            return False  # torch only (forward)
        w = self.weight
        if w.device.type != "cpu" or not packing_available(w.dtype):
            return False
        if keep_fp8 and w.dtype == torch.bfloat16 and native_fp8_gemv.vectorized():
            if self.codes == "int8":
                try:  # the codes are exact in bf16
                    self._c_weight = native_fp8_gemv.pack_int8_weight(w.detach().to(torch.int8))
                except native_fp8_gemv.Int8RangeError:
                    pass  # -128 (another writer's full int8 range): the layer keeps the matmul
            else:
                self._c_weight = native_fp8_gemv.pack_fp8_weight(w.detach().to(FP8_DTYPE))
            # read once, not per call; 0.0 marks weight-only (no input quantization)
            self._c_input_scale = 0.0 if self.weight_only else float(self.input_scale)
            self.c_rows = native_fp8_gemv.pass_rows()
        self.weight = nn.Parameter(pack_linear_weight(w), requires_grad=False)
        self.packed = True
        return True

    def place(self, device: torch.device, gemm: str) -> None:
        """Move to `device` and multiply by `gemm` there (an ExecutionBackend.fp8_gemm:
        "scaled_mm", "triton" or "bf16"). A W8A8 layer whose GEMM reads E4M3 bytes then
        keeps only those ([out, in] float8_e4m3fn, one byte a weight); the others keep
        the exact values in the compute dtype."""
        if self.packed:
            raise RuntimeError("this FP8 linear was packed for the CPU; load the artifact "
                               "again to place it on another device.")
        self.gemm = gemm
        if gemm in ("scaled_mm", "triton") and self.codes == "e4m3" and not self.weight_only \
                and not self.dynamic_input and self.weight.dtype != FP8_DTYPE:
            # exact; converted before the move, so the device never holds the wider copy
            self.weight = nn.Parameter(self.weight.detach().to(FP8_DTYPE), requires_grad=False)
        self.to(device)
        self._device_fp8 = self.weight if self.weight.dtype == FP8_DTYPE else None

    def _fp8_weight(self, device: torch.device) -> torch.Tensor:
        if self._device_fp8 is None or self._device_fp8.device != device:
            self._device_fp8 = self.weight.to(device=device, dtype=FP8_DTYPE)  # exact
        return self._device_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.packed and x.device.type != "cpu":
            raise RuntimeError(f"this FP8 linear was packed for the CPU and got input on "
                               f"{x.device}; load the artifact again to run it there.")
        if self.int8_inputs:
            y = self._int8_forward(x2)
        elif self.dynamic_input:
            y = self._dynamic_forward(x2)
        elif self.runs_c_kernel(x2):
            if self.weight_only:
                y = native_fp8_gemv.fp8_gemv_wonly_bf16(x2, self._c_weight, self.out_scale)
            else:
                y = native_fp8_gemv.fp8_gemv_bf16(x2, self._c_weight, self._c_input_scale,
                                                  self.out_scale)
            if self.bias is not None:
                y = y + self.bias
        elif self.packed or self.weight_only or self.gemm == "bf16" or (
                self.gemm is None and dispatch.backend_for(x.device) == "torch"):
            y = fp8_linear_torch(x2, self.weight, self.weight_scale, self.input_scale,
                                 self.bias, packed=self.packed, out_scale=self.out_scale)
        else:  # the device path's FP8 GEMM: self.gemm, else by device (Triton on CUDA)
            y = dispatch.fp8_linear(x2, self._fp8_weight(x.device), self.weight_scale,
                                    self.input_scale, self.bias, backend=self.gemm)
        return y.reshape(*lead, self.out_features)

    def runs_c_kernel(self, x2: torch.Tensor) -> bool:
        """Whether forward multiplies x2 [M, in] by the C kernel (the kept E4M3 or int8
        bytes): at most c_rows bf16 rows with unit stride."""
        return (self._c_weight is not None and x2.shape[0] <= self.c_rows
                and x2.dtype == torch.bfloat16 and x2.stride(-1) == 1)

    def greedy_ids(self, x: torch.Tensor) -> torch.Tensor | None:
        """torch.argmax(self(x), -1) ([...] int64 for x [..., in]) from the C kernel's
        running max per row, without the [..., out] outputs (native_fp8_gemv.
        fp8_gemv_argmax_bf16, or native_int8_gemm.int8_gemm_argmax_bf16 for W8A8 int8: the
        same sums and roundings as forward's C kernel), where forward would run x on the C
        kernel on the CPU and the layer has no bias; None elsewhere (the caller then takes
        the argmax of forward's outputs)."""
        x2 = x.reshape(-1, self.in_features)
        if self.bias is not None or x.device.type != "cpu":
            return None
        if self.int8_inputs:
            if self._c_int8 is None or x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
                return None
            ids, _ = native_int8_gemm.int8_gemm_argmax_bf16(x2, self._c_int8, self.weight_scale)
            return ids.reshape(x.shape[:-1])
        if (self.dynamic_input or not self.runs_c_kernel(x2)
                or not (self.weight_only or self._c_input_scale > 0)):
            return None
        ids, _ = native_fp8_gemv.fp8_gemv_argmax_bf16(
            x2, self._c_weight, self.out_scale,
            0.0 if self.weight_only else self._c_input_scale)  # [M] int64, [M] fp32
        return ids.reshape(x.shape[:-1])

    def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._c_int8 is None:
            return int8_linear_torch(x, self.weight, self.weight_scale, self.bias)
        # packed: the band layout is the only copy; the C kernel takes bf16 rows with unit
        # stride (what every CPU step passes)
        x = x if x.dtype == torch.bfloat16 and x.stride(-1) == 1 else \
            x.to(torch.bfloat16).contiguous()
        y = native_int8_gemm.int8_gemm_bf16(x, self._c_int8, self.weight_scale)
        return y + self.bias if self.bias is not None else y

    def _dynamic_forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._weight_f32 is None or self._weight_f32.device != x.device:
            self._weight_f32 = self.weight.detach().to(x.device, torch.float32).t()  # exact
        x_q, x_scale = quantize_per_token(x)  # [T, in] fp32 holding E4M3 values, [T, 1]
        acc = torch.matmul(x_q, self._weight_f32)  # [T, out] fp32
        y = (acc * (x_scale * self.weight_scale.reshape(1, -1).to(x.device))).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        packed = ", packed" if self.packed else ""
        packed += " + fp8 bytes" if self._c_weight is not None else ""
        packed += " + int8 bands" if self._c_int8 is not None else ""
        scheme = "int8 W8A8 dynamic per-token" if self.int8_inputs else \
            "int8 W8A16 weight-only" if self.codes == "int8" else \
            "fp8 W8A16 weight-only" if self.weight_only else \
            "fp8 W8A8 dynamic per-token" if self.dynamic_input else "fp8 W8A8 static"
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"{scheme}{packed}"
