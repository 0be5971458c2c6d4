"""Activation functions by the names config.json uses (`hidden_act` / `hidden_activation`)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]

# config.json name -> function; the same math as transformers' ACT2FN entries.
ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf) GELU
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
}


def get_activation(name: str) -> Activation:
    """The activation called `name`; KeyError lists the supported names."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise KeyError(
            f"activation {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})"
        ) from None
