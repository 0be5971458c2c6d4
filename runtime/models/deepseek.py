"""DeepSeek-V2 / V3 decoders: latent attention (MLA) and mixture-of-experts MLPs.

    model(input_ids [T], positions [T], meta, attn) -> hidden [T, hidden]

Parameter names equal the checkpoints' (model.layers.N.self_attn.kv_a_proj_with_mqa.weight,
model.layers.N.mlp.experts.E.gate_proj.weight, ...). Layers before `first_k_dense_replace`
have a dense GatedMLP, the rest a MoE (runtime/layers/moe.py). The two versions differ in
config defaults only: V2 routes by softmax ("greedy" / "group_limited_greedy") and always
rotates interleaved pairs; V3 routes by sigmoid with a learned bias ("noaux_tc") and reads
`rope_interleave`. The multi-token-prediction layers some V3 checkpoints carry past
`num_hidden_layers` are not used (as in transformers).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..layers.mla_attention import MLAAttention
from ..layers.mlp import GatedMLP
from ..layers.moe import MoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .config import ArchTraits, ModelConfig
from .llama import LLAMA_DEFAULTS, LlamaForCausalLM, LlamaModel
from .registry import register_model

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(nn.Module):
    rope_kind = "global"

    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_idx)
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg.hidden_size, cfg.moe, cfg.hidden_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, rope, meta, attn):  # [T, hidden] -> [T, hidden]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, meta, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekModel(LlamaModel):
    layer_cls = DeepseekDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        # one table for each of the RoPE key's rope_heads parts (DeepSeek's own: the whole)
        self.rotary_emb = RotaryEmbedding(cfg.mla.qk_rope_head_dim // cfg.mla.rope_heads,
                                          cfg.rope)
        # a converted model's per-layer frequency pairs (mla.rope_pairs): one table of the
        # source head's frequencies, each distinct choice ("pairs<k>", the layers'
        # rope_kind) its columns in halves, gathered from it in one call per step
        self.rotary_pairs = None
        kinds: dict[tuple[int, ...], str] = {}
        for layer, pairs in zip(self.layers, cfg.mla.rope_pairs or ()):
            layer.rope_kind = kinds.setdefault(pairs, f"pairs{len(kinds)}")
        if kinds:
            half = cfg.mla.rope_pair_dim // 2
            self.rotary_pairs = RotaryEmbedding(cfg.mla.rope_pair_dim, cfg.rope)
            self.pair_kinds = list(kinds.values())
            # [kinds, P] int64 columns of the source table (explicitly on the CPU: the
            # model may be built on the meta device)
            self.pair_columns = torch.tensor([p + tuple(i + half for i in p) for p in kinds],
                                             device="cpu")

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.rotary_pairs is None:
            return super().ropes(positions, dtype)
        cos, sin = self.rotary_pairs(positions, dtype)  # [T, pair_dim] each
        cos, sin = (t[:, self.pair_columns].transpose(0, 1).contiguous()  # [kinds, T, P]
                    for t in (cos, sin))
        return {kind: (cos[k], sin[k]) for k, kind in enumerate(self.pair_kinds)}


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(LlamaForCausalLM):
    traits = ArchTraits(defaults={**LLAMA_DEFAULTS, "max_position_embeddings": 4096},
                        mla=True, topk_method="noaux_tc")
    model_cls = DeepseekModel

    def param_name(self, checkpoint_name: str) -> str | None:
        m = _LAYER.match(checkpoint_name)
        if m and int(m.group(1)) >= self.config.num_layers:
            return None  # a multi-token-prediction layer
        return super().param_name(checkpoint_name)

    @staticmethod
    def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
        """The router's weights stay fp32 (as the checkpoints and transformers keep them)."""
        return torch.float32 if ".mlp.gate." in name else dtype


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    traits = ArchTraits(defaults={**LLAMA_DEFAULTS, "max_position_embeddings": 2048},
                        mla=True, rope_interleave=True, topk_method="greedy")


@register_model("QserveMLAForCausalLM")
class QserveMLAForCausalLM(DeepseekV3ForCausalLM):
    """A GQA model converted to latent attention that kept RoPE on several kv heads
    (quantize/mla_convert.py): DeepSeek-V3's layout plus `rope_heads`, which DeepSeek's
    config cannot express. RoPE in halves, dense MLPs."""

    traits = ArchTraits(defaults={**LLAMA_DEFAULTS, "rope_interleave": False}, mla=True,
                        topk_method="noaux_tc")
