"""Self-draft by early exit: the target's first N decoder layers, its final norm and LM
head, optionally with a small trained head (a residual MLP on the normed hidden state,
distilled offline on calibration text to predict the target's next token; see
quantize/draft.py). No second model: the layers are the target's own modules.

Options: num_layers (N, required), head (path of the head's safetensors file, optional).
Its KV cache holds N layers, with the target cache's dtype and k/v scales.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kv_cache import KVCache, KVCacheSpec
from .model_proposer import ModelDraftProposer
from .proposer import SpeculativeConfig, register_proposer


class DraftHead(nn.Module):
    """h + up(silu(down(h))): [T, H] -> [T, H]. `up` starts at zero (plain early exit)."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(torch.nn.functional.silu(self.down(hidden)))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], dtype: torch.dtype) -> "DraftHead":
        down = state.get("down.weight")
        up = state.get("up.weight")
        if down is None or up is None or down.shape[::-1] != up.shape:
            raise ValueError("a draft head needs down.weight [rank, hidden] and up.weight "
                             f"[hidden, rank]; got {sorted(state)}.")
        head = cls(down.shape[1], down.shape[0])
        head.load_state_dict({"down.weight": down, "up.weight": up})
        return head.to(dtype).eval()


class EarlyExitModel(nn.Module):
    """The target's embedding, first `num_layers` layers, final norm, (head), LM head."""

    def __init__(self, target: nn.Module, num_layers: int, head: DraftHead | None = None):
        super().__init__()
        total = len(target.backbone.layers)
        if not isinstance(num_layers, int) or not 1 <= num_layers < total:
            raise ValueError(f"early exit needs 1 <= num_layers < {total} (the target's "
                             f"layers), got {num_layers!r}.")
        self.target = target
        self.num_layers = num_layers
        self.head = head

    def hidden_states(self, input_ids, positions, meta, attn) -> torch.Tensor:
        """Normed hidden state after the first N layers: [T, H] model dtype."""
        backbone = self.target.backbone
        hidden, ropes = backbone.embed(input_ids, positions)
        for layer in backbone.layers[:self.num_layers]:
            hidden = layer(hidden, ropes[layer.rope_kind], meta, attn)
        return backbone.norm(hidden)

    def forward(self, input_ids, positions, meta, attn) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, meta, attn)
        return hidden if self.head is None else self.head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, V] fp32
        return self.target.compute_logits(hidden)


def load_head(path: str, dtype: torch.dtype) -> DraftHead:
    from safetensors.torch import load_file

    return DraftHead.from_state_dict(load_file(path), dtype)


@register_proposer("early_exit")
def build(config: SpeculativeConfig, target, kv_cache: KVCache, decode_impl=None,
          execution=None, **_) -> ModelDraftProposer:
    """`target`: the engine's LoadedModel; `kv_cache`: the target's cache (for its dtype,
    scales, size and device); `execution`: the engine's ExecutionBackend (None: the CPU
    torch backend). The draft shares the target's layers, already placed."""
    n = config.options.get("num_layers")
    if n is None:
        raise ValueError("the early_exit proposer needs num_layers (e.g. "
                         "`--speculative early_exit:8`, or an artifact quantized with "
                         "`--draft early_exit:8`).")
    head = config.options.get("head")
    model = EarlyExitModel(target.model, int(n),
                           load_head(head, target.dtype) if head else None)
    cs = kv_cache.spec
    spec = KVCacheSpec(int(n), cs.num_kv_heads, cs.head_dim, cs.block_size, cs.dtype,
                       values_in_keys=cs.values_in_keys)
    scales = None
    if cs.dtype == "fp8":
        scales = {i: (kv_cache.layer(i).k_scale, kv_cache.layer(i).v_scale) for i in range(int(n))}
    if model.head is not None:
        model.head.to(kv_cache.device)
    cache = KVCache(spec, kv_cache.blocks_per_group, scales, kv_cache.device)
    return ModelDraftProposer(model, cache, decode_impl,
                              kernels=None if execution is None else execution.kernels)
