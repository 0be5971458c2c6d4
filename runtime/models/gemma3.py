"""Gemma 3 text decoder on a flat batch (Gemma3ForCausalLM, and the text part of
Gemma3ForConditionalGeneration).

Differences from Llama, all from transformers' modeling_gemma3.py:
  - norms compute x * (1 + w) in fp32; four per block (input, post_attention,
    pre_feedforward, post_feedforward), plus q/k norms per head before RoPE;
  - embeddings scaled by sqrt(hidden), the scale rounded to the model dtype;
  - sliding-window layers interleaved with global ones, each kind with its own RoPE base;
  - attention scale query_pre_attn_scalar ** -0.5; gelu-tanh MLP; tied lm_head.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from ..layers.norm import GemmaRMSNorm
from .config import ArchTraits, ModelConfig
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, Rope
from .registry import register_model

# transformers' Gemma3TextConfig defaults for keys real config.json files leave out.
GEMMA3_DEFAULTS = {
    "vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
}


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's block plus a norm after attention's output and a pair around the MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_cls: type[nn.Module] = GemmaRMSNorm):
        super().__init__(cfg, layer_idx, norm_cls)
        self.pre_feedforward_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = self.self_attn(self.input_layernorm(hidden), rope, meta, attn)
        hidden = hidden + self.post_attention_layernorm(out)
        out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(out)


class Gemma3TextModel(LlamaModel):
    norm_cls = GemmaRMSNorm
    layer_cls = Gemma3DecoderLayer


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(LlamaForCausalLM):
    traits = ArchTraits(
        defaults=GEMMA3_DEFAULTS, sliding="pattern", qk_norm=True, gemma=True,
        act_keys=("hidden_activation", "hidden_act"),
    )
    model_cls = Gemma3TextModel


class _Gemma3MultimodalShell(nn.Module):
    """Holds the text model where HF puts it (model.language_model.*); vision is not served."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.language_model = Gemma3TextModel(cfg)


@register_model("Gemma3ForConditionalGeneration")
class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Text-only serving of a Gemma 3 image-text checkpoint; vision tensors are skipped."""

    traits = replace(Gemma3ForCausalLM.traits, text_config_key="text_config")
    backbone_path = "model.language_model"
    checkpoint_renames = (  # names written by transformers < 4.52
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    )
    ignored_prefixes = ("model.vision_tower.", "model.multi_modal_projector.",
                        "vision_tower.", "multi_modal_projector.")

    def build_backbone(self, cfg: ModelConfig) -> None:
        self.model = _Gemma3MultimodalShell(cfg)
