"""Which torch device an engine runs on: `--device auto|cpu|cuda|cuda:N` resolved once.

    device = resolve_device("auto")        # cuda:0 where torch sees a GPU, else cpu
    resolve_device("cuda:3")               # DeviceError naming the devices there are

A wrong choice is a `DeviceError` (a ValueError) whose message says what is wrong and
what to pass instead; the CLI prints it as one line. Nothing here allocates on the device.
"""

from __future__ import annotations

import re

import torch

from .formats.errors import QserveError

DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: the first CUDA GPU when torch sees one)"
_CUDA = re.compile(r"cuda(?::(\d+))?")
# compute capability from which a CUDA device multiplies FP8 (E4M3) natively (Ada, Hopper)
FP8_MIN_CAPABILITY = (8, 9)


class DeviceError(QserveError, ValueError):
    """A device (or device setting) this machine cannot run; the command line prints its
    message alone."""


def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 on a CPU-only build or without a driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a driver that fails to initialise counts as none
        return 0


def resolve_device(choice: str | torch.device | None = "auto") -> torch.device:
    """The torch.device for a --device value (None counts as "auto")."""
    if isinstance(choice, torch.device):
        choice = str(choice)
    text = (choice or "auto").strip().lower()
    count = cuda_device_count()
    if text == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA.fullmatch(text)
    if match is None:
        raise DeviceError(f"--device {choice!r} is not a device qserve runs on; "
                          f"choose {DEVICE_HELP}.")
    index = int(match.group(1) or 0)
    if count == 0:
        build = torch.__version__
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "torch finds no CUDA GPU (driver or CUDA_VISIBLE_DEVICES)")
        raise DeviceError(f"--device {choice}: {why} (torch {build}); use --device cpu, or "
                          f"install a CUDA build of torch on a machine with a GPU.")
    if index >= count:
        raise DeviceError(f"--device {choice}: this machine has {count} CUDA device(s), "
                          f"cuda:0..cuda:{count - 1}; pick one of those.")
    return torch.device("cuda", index)


def fp8_matmul_native(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 natively (CUDA compute capability >= 8.9)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def device_line(device: torch.device) -> str:
    """One line naming the device (its GPU name and capability on CUDA)."""
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"


def free_device_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the CUDA device's memory, as the driver reports them now."""
    if device.type != "cuda":
        raise DeviceError(f"free memory is measured on a CUDA device, not {device}.")
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, as they are now."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_pool_bytes(device: torch.device, utilization: float) -> int:
    """Bytes the KV pool may take on a CUDA device so that everything this process has
    allocated there plus the pool stays within `utilization` of the device's memory
    (vLLM's --gpu-memory-utilization). Call it after the weights are on the device."""
    if not 0.0 < utilization <= 1.0:
        raise DeviceError(f"--gpu-memory-utilization {utilization} must be in (0, 1].")
    free, total = free_device_bytes(device)
    used_elsewhere = total - free  # this process's weights and anything else on the GPU
    budget = int(total * utilization) - used_elsewhere
    if budget <= 0:
        raise DeviceError(
            f"the model leaves no room for a KV cache on {device}: "
            f"{used_elsewhere / 2**30:.2f} GiB of {total / 2**30:.2f} GiB are in use and "
            f"--gpu-memory-utilization {utilization} allows {total * utilization / 2**30:.2f}"
            f" GiB; raise it, free the GPU, or use a smaller model.")
    return budget
