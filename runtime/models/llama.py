"""Llama-family decoder (Llama, Mistral, Qwen 2, Qwen 3) on a flat batch.

    model(input_ids [T], positions [T], meta, attn) -> hidden [T, hidden]
    model.compute_logits(hidden) -> [T, vocab] fp32
    model.greedy_tokens(hidden) -> [T] int64, compute_logits(hidden).argmax(-1)

Module and parameter names equal the HF ones (model.layers.N.self_attn.q_proj.weight,
...), so a checkpoint's state dict maps 1:1. The family members differ only in how their
config.json reads (`ArchTraits`): Mistral slides every layer, Qwen 2 has q/k/v biases,
Qwen 3 normalises each q/k head before RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata, AttentionSpec
from ..layers.fp8_linear import Fp8Linear
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.self_attention import SelfAttention
from .config import ArchTraits, ModelConfig
from .registry import register_model

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, head_dim] model dtype

# transformers' defaults for keys a config.json may leave out.
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
                  "max_position_embeddings": 2048}
QWEN_DEFAULTS = {**LLAMA_DEFAULTS, "use_sliding_window": False, "sliding_window": 4096,
                 "max_window_layers": 28, "max_position_embeddings": 32768}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.rope_kind = "local" if cfg.uses_local_rope(layer_idx) else "global"
        self.self_attn = SelfAttention(cfg, layer_idx, norm_cls)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        self.input_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, meta, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: HF's `model.*` submodule."""

    norm_cls: type[nn.Module] = RMSNorm
    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [self.layer_cls(cfg, i, self.norm_cls) for i in range(cfg.num_layers)]
        )
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_scale = cfg.embedding_scale
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.rotary_emb_local = (
            RotaryEmbedding(cfg.head_dim, cfg.rope_local) if cfg.rope_local is not None else None
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, Rope]]:
        """Input embeddings [T, hidden] and the RoPE tables by kind ("global"/"local")."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden] model dtype
        if self.embedding_scale is not None:  # scale rounded to the model dtype, as HF does
            hidden = hidden * torch.tensor(self.embedding_scale).to(hidden.dtype)
        return hidden, self.ropes(positions, hidden.dtype)

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        """The RoPE tables (cos, sin) [T, width] by kind: a layer reads its `rope_kind`."""
        ropes = {"global": self.rotary_emb(positions, dtype)}
        if self.rotary_emb_local is not None:
            ropes["local"] = self.rotary_emb_local(positions, dtype)
        return ropes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        hidden, ropes = self.embed(input_ids, positions)
        for layer in self.layers:
            hidden = layer(hidden, ropes[layer.rope_kind], meta, attn)
        return self.norm(hidden)  # [T, hidden]


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    traits = ArchTraits(defaults=LLAMA_DEFAULTS)
    model_cls: type[nn.Module] = LlamaModel
    backbone_path = "model"  # where the LlamaModel-like module sits
    # Checkpoint name prefixes: renamed (old -> new) first, then ignored if listed.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    ignored_prefixes: tuple[str, ...] = ()
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)  # old checkpoints saved it

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.build_backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def build_backbone(self, cfg: ModelConfig) -> None:
        self.model = self.model_cls(cfg)

    @classmethod
    def config_from_hf(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        return ModelConfig.from_hf(raw, cls.traits, source)

    @property
    def backbone(self) -> nn.Module:
        return self.get_submodule(self.backbone_path)

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [layer.self_attn.spec for layer in self.backbone.layers]

    def tie_weights(self) -> None:
        """With tied embeddings lm_head.weight *is* the embedding parameter."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embed_tokens.weight

    def param_name(self, checkpoint_name: str) -> str | None:
        """Our parameter name for a checkpoint tensor, or None for one to skip."""
        name = checkpoint_name
        for old, new in self.checkpoint_renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith(self.ignored_prefixes) or name.endswith(self.ignored_suffixes):
            return None
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None  # some tied checkpoints store a copy; the embedding is used
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        # input_ids, positions: [T] int64 (a flat batch) -> [T, hidden] model dtype
        return self.backbone(input_ids, positions, meta, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [T, vocab] fp32
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy next token, compute_logits(hidden).argmax(-1): [T] int64 for
        hidden [T, hidden]. The one place that picks how: an LM head with 8-bit weights
        (Fp8Linear: int8 or E4M3, static or weight-only) whose forward would run these rows
        on its C kernel (a CPU step of up to its c_rows rows) gives the argmax from the
        kernel's running max per row, with the same sums and roundings and without making
        the [T, vocab] logits (Fp8Linear.greedy_ids); every other head, device or row
        count takes the logits' argmax.

        A final logit softcap, cap * tanh(logit / cap), is monotonic, so it cannot move the
        largest logit: the kernel does not apply it. In fp32 it is only non-decreasing,
        though (neighbouring logits can round to one capped value; it saturates at cap), and
        a tie it makes goes to the lower id: a capped model takes the capped logits'
        argmax, so its tokens stay those of compute_logits."""
        head = self.lm_head
        if self.config.final_logit_softcap is None and isinstance(head, Fp8Linear):
            ids = head.greedy_ids(hidden)
            if ids is not None:
                return ids
        return self.compute_logits(hidden).argmax(-1)


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    traits = ArchTraits(defaults={**LLAMA_DEFAULTS, "sliding_window": 4096}, sliding="all")


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    traits = ArchTraits(defaults=QWEN_DEFAULTS, sliding="qwen", qkv_bias=True, o_bias=False)


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    traits = ArchTraits(defaults={**QWEN_DEFAULTS, "head_dim": 128}, sliding="qwen", qk_norm=True)
