"""GGUF -> Hugging Face tensor names and layouts, one entry per `general.architecture`.

llama.cpp's converter renames every tensor (`model.layers.3.self_attn.q_proj.weight` becomes
`blk.3.attn_q.weight`) and, for some architectures, changes the numbers it stores:

- llama: the rows of Q and K are permuted so that RoPE pairs adjacent elements (GPT-J
  style, dims (2i, 2i+1)) where HF Llama pairs the two halves of each head (NeoX style,
  dims (i, i + d/2)). `_unpermute_rope` undoes it.
- gemma3: every RMSNorm weight is stored with 1 added, since llama.cpp's norm computes
  `x * w` where HF Gemma3RMSNorm computes `x * (1 + w)`. We subtract 1 again (in float32,
  as transformers' GGUF loader does).

Shapes: GGUF lists dimensions fastest-first (`ne[0]` is the row length), the reverse of
torch. `gguf_reader` hands tensors over already in torch order, so a 2-D weight arrives
as `[out_features, in_features]`, the same as in an HF checkpoint.

Add an architecture by registering a `TensorLayout` in `LAYOUTS` (and a config builder in
`gguf_reader.CONFIG_BUILDERS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import CheckpointError

# transform(hf_name, tensor, hf_config) -> tensor; tensor is float32 in torch order
Transform = Callable[[str, torch.Tensor, dict], torch.Tensor]

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _identity(hf_name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    return tensor


def _unpermute_rope(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `LlamaModel.permute` for a Q or K projection.

    llama.cpp wrote w.reshape(n_heads, 2, rows // n_heads // 2, *rest).swapaxes(1, 2);
    undo it: view each head's rows as [half, 2] and swap back to [2, half].
    """
    rows = tensor.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(
            f"cannot undo the RoPE permutation: {rows} rows do not split into {n_heads} heads "
            "of even size. The file's head counts do not match its Q/K tensors."
        )
    rest = tensor.shape[1:]
    # [rows, *rest] -> [n_heads, rows/n_heads/2, 2, *rest] -> [n_heads, 2, rows/n_heads/2, *rest]
    return (
        tensor.reshape(n_heads, rows // n_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )


def _llama_transform(hf_name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    if ".self_attn.q_proj." in hf_name:
        return _unpermute_rope(tensor, config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return _unpermute_rope(tensor, config["num_key_value_heads"])
    return tensor


def _gemma_transform(hf_name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    if hf_name.endswith("norm.weight"):
        return tensor - 1.0  # float32, exactly as transformers' loader does it
    return tensor


@dataclass(frozen=True)
class TensorLayout:
    """How one GGUF architecture's tensors become HF tensors."""

    gguf_arch: str
    # GGUF name outside the blocks -> HF name
    globals: dict[str, str]
    # GGUF name inside block N, without the `blk.N.` prefix -> HF name with `{i}` for N
    per_layer: dict[str, str]
    transform: Transform = _identity
    # GGUF tensors that carry nothing HF keeps (recomputed from the config)
    ignored: frozenset[str] = field(default_factory=frozenset)
    # HF tensors that may be absent (e.g. lm_head when the embeddings are tied)
    optional: frozenset[str] = field(default_factory=frozenset)

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor; None when the tensor is ignored."""
        if gguf_name in self.ignored:
            return None
        if gguf_name in self.globals:
            return self.globals[gguf_name]
        m = _BLOCK.match(gguf_name)
        if m and m.group(2) in self.per_layer:
            return self.per_layer[m.group(2)].format(i=int(m.group(1)))
        raise CheckpointError(
            f"unexpected tensor {gguf_name!r} for architecture {self.gguf_arch!r}: qserve does "
            f"not know where it goes. Known per-layer tensors: {sorted(self.per_layer)}; "
            f"global: {sorted(self.globals)}."
        )

    def expected_hf_names(self, num_layers: int, tie_word_embeddings: bool) -> set[str]:
        """Every HF tensor a complete checkpoint of this layout holds."""
        names = {v for v in self.globals.values() if v not in self.optional}
        if not tie_word_embeddings and "lm_head.weight" in self.globals.values():
            names.add("lm_head.weight")
        for i in range(num_layers):
            names.update(t.format(i=i) for t in self.per_layer.values() if t not in self.optional)
        return names


_LLAMA_PER_LAYER = {
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_GLOBALS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

LAYOUTS: dict[str, TensorLayout] = {
    "llama": TensorLayout(
        gguf_arch="llama",
        globals=_GLOBALS,
        per_layer=_LLAMA_PER_LAYER,
        transform=_llama_transform,
        optional=frozenset({"lm_head.weight"}),
    ),
    # llama.cpp writes Qwen2's Q/K unpermuted (NEOX RoPE), with q/k/v biases
    "qwen2": TensorLayout(
        gguf_arch="qwen2",
        globals=_GLOBALS,
        per_layer={
            **_LLAMA_PER_LAYER,
            "attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
            "attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
            "attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
        },
        optional=frozenset({"lm_head.weight"}),
    ),
    "gemma3": TensorLayout(
        gguf_arch="gemma3",
        globals=_GLOBALS,
        per_layer={
            "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
            "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
            "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
            "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
            "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
            "attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
            "attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
            "post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
            "ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
            "ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
            "ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
            "ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
        },
        transform=_gemma_transform,
        optional=frozenset({"lm_head.weight"}),
    ),
}


def supported_architectures() -> list[str]:
    return sorted(LAYOUTS)


def get_layout(gguf_arch: str, path: object = "") -> TensorLayout:
    try:
        return LAYOUTS[gguf_arch]
    except KeyError:
        raise CheckpointError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported. qserve reads GGUF "
            f"architectures: {', '.join(supported_architectures())}."
        ) from None
