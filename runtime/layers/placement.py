"""Put a loaded model on its engine's device, in the form its ExecutionBackend computes.

    place_on_device(model, backend)   # once, before the engine's first step

The CPU torch backend packs weights instead (runtime/layers/packing.py); every other
backend comes here: each FP8 linear is told its GEMM (and keeps one byte a weight where
that GEMM reads E4M3 bytes), then every parameter and buffer moves to the device.
"""

from __future__ import annotations

import torch
from torch import nn

from ..device import DeviceError, weights_bytes
from .fp8_linear import Fp8Linear


def place_on_device(model: nn.Module, backend) -> None:
    """backend: a runtime.execution_backend.ExecutionBackend whose cpu_native is False."""
    if backend.cpu_native:
        raise ValueError("the CPU torch backend packs weights (pack_for_cpu) rather than "
                         "placing them.")
    try:
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.place(backend.device, backend.fp8_gemm)
        model.to(backend.device)
    except torch.OutOfMemoryError:
        model.to("cpu")  # what did move goes back, so the device is left as found
        need = weights_bytes(model) / 2**30
        raise DeviceError(f"the model's weights ({need:.2f} GiB as placed) do not fit in "
                          f"{backend.device}'s free memory: free the device, pick another "
                          f"(--device cuda:N), or serve a smaller artifact.") from None
