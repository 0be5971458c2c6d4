"""Pack a loaded model's linear weights for the CPU matmul library, once, before serving.

    n = pack_for_cpu(model)   # number of linears now running on packed weights

Every bf16 linear on the CPU is put in the CPU's packed form (kernels/cpu_linear.py:
oneDNN's blocked bf16 layout where bf16 is native, else an fp32 copy): an `Fp8Linear`
replaces its upcast weight (and keeps its E4M3 bytes for the small-batch C kernel unless
keep_fp8=False); a plain `nn.Linear` (the LM head, or every linear of a model served from
bf16) becomes a `PackedLinear`; one inside the decoder layers of a model with FP8 linears
(a bf16 layer of a mixed artifact, quantize/budget.py) also keeps its bf16 bytes in the
small-batch C kernel's layout on every x86 CPU, so the C decode path
(runtime/models/native_decoder.py) runs it. A tied LM head shares its parameter with the
embedding, which needs the plain layout for lookups, so its packed form is a second copy
(vocab x hidden x 2 bytes, 4 for fp32: 57 / 113 MiB for SmolLM2-135M). A model whose dtype or
device cannot be packed is left as it is. Idempotent.

How many rows of a step run the C linears rather than the packed matmul is decided here,
once (`c_kernel_rows`): batch-invariant (the engine's default), every step does, so each
row gets the sums it gets alone whatever else the step holds; the LM head then also keeps
its bf16 rows copy on every x86 CPU (one more copy of the head where bf16 is native).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ...kernels import native_bf16_gemv, native_fp8_gemv
from ...kernels.cpu_linear import pack_linear_weight, packed_linear, packing_available
from .fp8_linear import Fp8Linear


def c_kernel_rows(batch_invariant: bool, bf16: bool = False) -> int:
    """The most rows of a step that run the C linears (the FP8 bytes or the bf16 rows
    copy). batch_invariant: every step, so a row's sums never depend on the rows beside it
    (on AMX and AVX512-BF16 a step of more than native_fp8_gemv.pass_rows() rows then
    reads the weights once per pass). Else only the rows one pass over the weights
    serves (native_fp8_gemv.pass_rows(), MAX_ROWS for bf16 linears): beyond them the CPU's
    matmul, whose sums change with the row count, is faster."""
    if batch_invariant:
        return sys.maxsize
    return native_bf16_gemv.MAX_ROWS if bf16 else native_fp8_gemv.pass_rows()


def runs_invariant(model: nn.Module, batch_invariant: bool) -> bool:
    """Whether an engine asked to be batch_invariant runs `model` so: a model with FP8
    linears (an artifact) yes; a bf16 model (a source served as it is, the eval gates'
    reference) keeps torch's matmuls for prompt steps, and so is not batch-invariant."""
    return batch_invariant and any(isinstance(m, Fp8Linear) for m in model.modules())


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives only in the CPU's packed form (cpu_linear; bf16 in
    and out), plus, where kept, the small-batch C kernel's bf16 rows copy."""

    def __init__(self, linear: nn.Linear, rows: bool = False) -> None:
        """rows: keep the small-batch C kernel's copy whatever the packed form is."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(pack_linear_weight(linear.weight), requires_grad=False)
        self.bias = linear.bias
        # where the packed form is an fp32 copy (no native bf16 matmul): the bf16 bytes in
        # the small-batch C kernel's layout too, for decode steps (half the bytes to read)
        self.rows: native_bf16_gemv.PackedBf16Weight | None = None
        self.bias_f32: torch.Tensor | None = None  # fp32 [out], the C kernel's bias
        self.c_rows = native_bf16_gemv.MAX_ROWS  # the most rows that run the C kernel
        if rows or self.weight.dtype == torch.float32:
            self.keep_rows(linear.weight)

    def keep_rows(self, weight: torch.Tensor | None = None) -> bool:
        """Keep the bf16 rows copy (from `weight`, the layer's bf16 [out, in], or the packed
        form) where the C kernel is vectorised; True when the layer has it."""
        if self.rows is None and native_bf16_gemv.vectorized():
            if weight is None:  # the packed form back as [out, in] (exact: bf16 or fp32 of it)
                eye = torch.eye(self.in_features, dtype=torch.bfloat16)
                weight = packed_linear(eye, self.weight, None).t().contiguous()
            if weight.dtype == torch.bfloat16:
                self.rows = native_bf16_gemv.pack_bf16_weight(weight)
                if self.bias is not None:
                    self.bias_f32 = self.bias.detach().reshape(-1).float().contiguous()
        return self.rows is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.rows is not None and x2.shape[0] <= self.c_rows \
                and x2.dtype == torch.bfloat16 and x2.stride(-1) == 1:
            y = native_bf16_gemv.bf16_gemv(x2, self.rows, self.bias_f32)
        else:
            y = packed_linear(x2, self.weight, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        rows = " + bf16 rows kernel" if self.rows is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed{rows}"


def _packable(linear: nn.Linear) -> bool:
    w = linear.weight
    return w.device.type == "cpu" and packing_available(w.dtype)


def pack_for_cpu(model: nn.Module, keep_fp8: bool = True, batch_invariant: bool = True) -> int:
    """Pack every linear of `model` that runs on the CPU in bf16; returns how many run packed.
    keep_fp8: FP8 linears also keep their E4M3 bytes for small batches (Fp8Linear.pack).
    batch_invariant: every step's rows run the C linears (c_kernel_rows); set again on
    each call, so one loaded model serves engines of either kind (the last one's)."""
    for module in model.modules():  # weights derived from linears, before they are packed
        if hasattr(module, "prepare"):
            module.prepare()
    # bf16 linears of an FP8 model's decoder layers (a ModuleList's): small-batch bf16 rows
    # for the C path. A bf16 model keeps torch's path (runs_invariant).
    in_layers = set()
    if any(isinstance(m, Fp8Linear) for m in model.modules()):
        in_layers = {id(m) for ml in model.modules() if isinstance(ml, nn.ModuleList)
                     for m in ml.modules()}
    invariant = runs_invariant(model, batch_invariant)
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear):
            count += module.pack(keep_fp8)
        elif isinstance(module, PackedLinear):
            count += 1
        elif type(module) is nn.Linear and _packable(module):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    PackedLinear(module, rows=id(module) in in_layers or invariant))
            count += 1
    for module in model.modules():  # the rows that run the C linears, set every call
        if isinstance(module, Fp8Linear) and module.packed:
            module.c_rows = c_kernel_rows(invariant)
        elif isinstance(module, PackedLinear):
            if invariant and module.weight.device.type == "cpu":
                module.keep_rows()  # a model packed before by an engine of the other kind
            module.c_rows = c_kernel_rows(invariant, bf16=True)
    return count
