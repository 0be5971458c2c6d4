"""The one decision of how an engine computes: on which device, with which kernels.

    backend = ExecutionBackend.choose(resolve_device("auto"))   # once, at engine build
    backend.kernels     # "torch" | "triton": KV store, paged attention (kernels/dispatch.py)
    backend.fp8_gemm    # how a W8A8 FP8 linear multiplies (FP8_GEMMS)
    backend.cpu_native  # the CPU C kernels: packed weights, the C decode step
    backend.decode_graphs  # "off" | "padded" | "captured" (runtime/decode_graphs.py)
    backend.line()      # the decision in one line (`qserve env`, the server's log)

Every layer and the model runner follow this object; nothing else picks a kernel by
device or environment for an engine.

- CPU, kernels "torch" (the default): weights packed for the CPU (runtime/layers/packing.py),
  the C kernels the CPU class allows, the C decode step for FP8 Llama-family models.
- CPU, kernels "triton": the Triton kernels on CPU tensors under the Triton interpreter
  (TRITON_INTERPRET=1). Slow; it runs the device path's code where there is no GPU.
- CUDA: the Triton kernels; FP8 linears through torch._scaled_mm where the device has
  FP8 tensor cores (compute capability >= 8.9), else their exact bf16 values in bf16
  matmuls (a note says why); `fp8_gemm="triton"` chooses the Triton FP8 GEMM instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels import dispatch
from .decode_graphs import DECODE_GRAPH_MODES
from .device import FP8_MIN_CAPABILITY, DeviceError, device_line, fp8_matmul_native

KERNEL_CHOICES = ("auto", "torch", "triton")
# how an FP8 W8A8 linear multiplies: "cpu" (C kernel for few rows, the packed matmul for
# many: runtime/layers/fp8_linear.py), "scaled_mm", "triton", or "bf16" (the E4M3 values
# upcast, a bf16 matmul: kernels/fp8_gemm.fp8_linear_torch)
FP8_GEMMS = ("cpu", "scaled_mm", "triton", "bf16")


@dataclass(frozen=True)
class ExecutionBackend:
    device: torch.device
    kernels: str  # "torch" | "triton"
    fp8_gemm: str  # one of FP8_GEMMS
    cpu_native: bool  # CPU weight packing and the C kernels
    notes: tuple[str, ...] = ()  # why a slower path was taken
    # how decode steps run: "off" (eager), "padded" (fixed buffers, eager), "captured"
    # (CUDA graphs); runtime/decode_graphs.py
    decode_graphs: str = "off"

    @classmethod
    def choose(cls, device: torch.device, kernels: str | None = None,
               fp8_gemm: str | None = None,
               decode_graphs: str | None = None) -> "ExecutionBackend":
        """kernels: "auto" | "torch" | "triton"; None reads QSERVE_KERNELS, else "auto"
        (Triton on CUDA, torch on CPU). fp8_gemm: None picks by device. decode_graphs:
        None is "captured" on CUDA and "off" elsewhere (`--enforce-eager`: "off")."""
        choice = kernels or os.environ.get(dispatch.ENV_VAR) or "auto"
        if choice not in KERNEL_CHOICES:
            raise DeviceError(f"kernels {choice!r} (argument or {dispatch.ENV_VAR}): choose "
                              f"one of {list(KERNEL_CHOICES)}.")
        if device.type not in ("cpu", "cuda"):
            raise DeviceError(f"qserve runs on cpu or cuda devices, not {device}.")
        if choice == "auto":
            choice = "triton" if device.type == "cuda" else "torch"
        if device.type == "cuda" and choice != "triton":
            raise DeviceError(f"kernels {choice!r} on {device}: the torch attention path "
                              f"is the CPU's; on CUDA the Triton kernels run (kernels auto).")
        if device.type == "cpu" and choice == "triton" \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise DeviceError("the Triton kernels run on CPU tensors only under the Triton "
                              "interpreter: set TRITON_INTERPRET=1 before starting, or use "
                              "kernels torch.")
        notes: list[str] = []
        if device.type == "cpu":
            auto_gemm = "cpu" if choice == "torch" else "triton"
        elif fp8_matmul_native(device):
            auto_gemm = "scaled_mm"
        else:
            auto_gemm = "bf16"
            major, minor = torch.cuda.get_device_capability(device)
            notes.append(f"{device} has compute capability {major}.{minor}, FP8 tensor cores "
                         f"need {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: FP8 weights "
                         f"run as their exact bf16 values in bf16 matmuls")
        gemm = fp8_gemm or auto_gemm
        if gemm not in FP8_GEMMS:
            raise DeviceError(f"fp8_gemm {gemm!r}: choose one of {list(FP8_GEMMS)}.")
        cpu_native = device.type == "cpu" and choice == "torch"
        if (gemm == "cpu") != cpu_native:
            raise DeviceError(f"fp8_gemm {gemm!r} on {device} with kernels {choice!r}: "
                              f"fp8_gemm 'cpu' is the CPU torch backend's, and only its.")
        graphs = decode_graphs or ("captured" if device.type == "cuda" else "off")
        if graphs not in DECODE_GRAPH_MODES:
            raise DeviceError(f"decode_graphs {graphs!r}: choose one of "
                              f"{list(DECODE_GRAPH_MODES)}.")
        if graphs == "captured" and device.type != "cuda":
            raise DeviceError(f"CUDA graphs need a CUDA device, not {device}: use "
                              f"decode_graphs 'padded' (the same inputs, run eagerly) or 'off'.")
        if graphs != "off" and cpu_native:
            raise DeviceError("decode graphs run the Triton kernels' static path; the CPU "
                              "torch backend runs its own C decode step: use 'off' there.")
        return cls(device, choice, gemm, cpu_native, tuple(notes), graphs)

    def line(self) -> str:
        """The decision in one line."""
        native = ", CPU C kernels" if self.cpu_native else ""
        notes = "".join(f"; {n}" for n in self.notes)
        graphs = {"off": "", "padded": ", decode on fixed buffers (padded, eager)",
                  "captured": ", decode as CUDA graphs"}[self.decode_graphs]
        return (f"device {device_line(self.device)}, {self.kernels} kernels, FP8 linears: "
                f"{self.fp8_gemm}{native}{graphs}{notes}")
