"""The gated MLP every supported family uses: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from .activation import get_activation


class GatedMLP(nn.Module):
    """gate_proj / up_proj / down_proj stay separate nn.Linear modules (HF names), so a
    quantization pass can swap each one for an FP8 linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act  # the config's name for it (a native decode path picks its kernel by it)
        self.act_fn = get_activation(act)
        self.gate_up_proj: nn.Module | None = None  # gate|up in one (runtime/layers/fusion.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, inter] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)
