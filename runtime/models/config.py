"""ModelConfig: what a model implementation needs from an HF config.json, normalised.

config.json differs between families and between transformers versions (RoPE settings as
`rope_theta` + `rope_scaling`, or as `rope_parameters`, flat or per layer type; sliding
windows from `layer_types`, `sliding_window_pattern`, or Qwen's `max_window_layers`).
`ModelConfig.from_hf` reads all of them into one flat, validated dataclass. What differs
per architecture (defaults, which keys apply) is an `ArchTraits` the model class carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..formats.errors import CheckpointError
from ..layers.activation import ACTIVATIONS
from ..layers.rotary import ROPE_TYPES, RopeConfig
from .mla_config import MLAConfig, MoEConfig, read_mla, read_moe

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ArchTraits:
    """How one architecture reads its config.json."""

    defaults: Mapping[str, Any] = field(default_factory=dict)  # for keys config.json may omit
    # Which layers use `sliding_window`: "none" (Llama ignores it), "all" (Mistral),
    # "qwen" (`use_sliding_window`, layers >= `max_window_layers`, or `layer_types`),
    # "pattern" (Gemma 3: `layer_types`, else every `sliding_window_pattern`-th is global).
    sliding: str = "none"
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE
    qkv_bias: bool | None = None  # None: read `attention_bias`
    o_bias: bool | None = None  # None: read `attention_bias`
    act_keys: tuple[str, ...] = ("hidden_act",)  # first present key names the activation
    gemma: bool = False  # sqrt(hidden) embedding scale, attention scale from query_pre_attn_scalar
    text_config_key: str | None = None  # multimodal configs nest the text model's config
    mla: bool = False  # DeepSeek attention and experts (runtime/models/mla_config.py)
    rope_interleave: bool | None = None  # MLA: None reads `rope_interleave` (default true)
    topk_method: str = "greedy"  # MoE: default of `topk_method`


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig  # RoPE of full-attention layers (and of all layers without rope_local)
    rope_local: RopeConfig | None  # RoPE of sliding-window layers, if it differs (Gemma 3)
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    hidden_act: str
    embedding_scale: float | None  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None  # attention scale is this ** -0.5 (else head_dim ** -0.5)
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # DeepSeek latent attention; then num_kv_heads is 1 and head_dim the cached width
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None  # mixture-of-experts MLP layers

    @property
    def attn_scale(self) -> float:
        if self.mla is not None:
            return self.mla.softmax_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_local_rope(self, layer_idx: int) -> bool:
        return self.rope_local is not None and self.sliding_windows[layer_idx] is not None

    @classmethod
    def from_hf(
        cls, raw: Mapping[str, Any], traits: ArchTraits, source: str = "config.json"
    ) -> "ModelConfig":
        """Normalise an HF config.json dict; CheckpointError names `source` and the key."""
        r = _Reader(raw, traits, source)
        arch = (raw.get("architectures") or ["?"])[0]
        hidden = r.int("hidden_size")
        heads = r.int("num_attention_heads")
        layers = r.int("num_hidden_layers")
        rope, rope_local = _read_rope(r)
        mla = moe = None
        if traits.mla:  # one cached "head": c_kv and the RoPE key
            mla = read_mla(r, rope, traits.rope_interleave)
            moe = read_moe(r, layers, traits.topk_method)
            kv_heads, head_dim = 1, mla.cache_dim
        else:
            kv_heads = r.int("num_key_value_heads", heads)
            if heads % kv_heads:
                r.fail("num_key_value_heads",
                       f"{kv_heads} does not divide num_attention_heads={heads}")
            head_dim = r.int("head_dim", hidden // heads)
            if head_dim % 2:
                r.fail("head_dim", f"{head_dim} is odd; RoPE needs an even head dimension")
        act_key = next((k for k in traits.act_keys if r.get(k) is not None), traits.act_keys[0])
        act = r.str(act_key)
        if act not in ACTIVATIONS:
            r.fail(act_key, f"activation {act!r} is not supported "
                   f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        if r.get("partial_rotary_factor", 1.0) != 1.0:
            r.fail("partial_rotary_factor", "partial RoPE is not supported")
        if r.get("use_bidirectional_attention"):
            r.fail("use_bidirectional_attention", "bidirectional attention is not supported")
        attention_bias = r.bool("attention_bias", False)
        eos = r.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) for e in eos_ids):
            r.fail("eos_token_id", f"expected an int or a list of ints, got {eos!r}")
        return cls(
            architecture=arch,
            vocab_size=r.int("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=r.int("intermediate_size"),
            rms_norm_eps=r.float("rms_norm_eps"),
            rope=rope,
            rope_local=rope_local,
            sliding_windows=_read_sliding_windows(r, layers),
            qk_norm=traits.qk_norm,
            qkv_bias=attention_bias if traits.qkv_bias is None else traits.qkv_bias,
            o_bias=attention_bias if traits.o_bias is None else traits.o_bias,
            mlp_bias=r.bool("mlp_bias", False),
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            hidden_act=act,
            embedding_scale=hidden**0.5 if traits.gemma else None,
            query_pre_attn_scalar=r.float("query_pre_attn_scalar") if traits.gemma else None,
            attn_logit_softcap=r.float("attn_logit_softcapping", None),
            final_logit_softcap=r.float("final_logit_softcapping", None),
            bos_token_id=r.int("bos_token_id", None),
            eos_token_ids=eos_ids,
            mla=mla,
            moe=moe,
        )


_REQUIRED = object()
_TOP_LEVEL_KEYS = ("bos_token_id", "eos_token_id", "tie_word_embeddings")


class _Reader:
    """Typed access to config keys: the nested text config (if any) over the top level,
    over the architecture's defaults. A JSON null counts as absent."""

    def __init__(self, raw: Mapping[str, Any], traits: ArchTraits, source: str):
        self.source, self.traits, self.prefix = source, traits, ""
        values = dict(traits.defaults)
        if traits.text_config_key:
            sub = raw.get(traits.text_config_key)
            if not isinstance(sub, dict):
                raise CheckpointError(f"{source}: missing {traits.text_config_key!r} object.")
            values.update({k: v for k, v in sub.items() if v is not None})
            values.update({k: raw[k] for k in _TOP_LEVEL_KEYS if raw.get(k) is not None})
            self.prefix = traits.text_config_key + "."
        else:
            values.update({k: v for k, v in raw.items() if v is not None})
        self.values = values

    def fail(self, key: str, why: str):
        raise CheckpointError(f"{self.source}: key {(self.prefix + key)!r}: {why}.")

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def _typed(self, key, default, ok, what):
        value = self.values.get(key, _REQUIRED)
        if value is _REQUIRED:
            if default is _REQUIRED:
                raise CheckpointError(
                    f"{self.source}: missing required key {(self.prefix + key)!r} ({what})."
                )
            return default
        if not ok(value):
            self.fail(key, f"expected {what}, got {value!r}")
        return value

    def int(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, default, lambda v: type(v) is int, "an integer")

    def float(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._typed(key, default, lambda v: type(v) in (int, float), "a number")
        return float(value) if value is not None else None

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, default, lambda v: type(v) is bool, "true or false")

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, default, lambda v: type(v) is str, "a string")


def _read_rope(r: _Reader) -> tuple[RopeConfig, RopeConfig | None]:
    """(global RoPE, local RoPE for sliding layers or None) from either config style."""
    params = r.get("rope_parameters")
    max_pos = r.int("max_position_embeddings", 8192)
    theta = r.float("rope_theta", 10000.0)
    local_theta = r.float("rope_local_base_freq", None)  # older Gemma 3 configs
    local = None if local_theta is None else RopeConfig(theta=local_theta)
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):  # per layer type
        key = "rope_parameters."
        full = _rope_from(r, key + LAYER_TYPES[0], params.get(LAYER_TYPES[0]) or {}, theta, max_pos)
        if params.get(LAYER_TYPES[1]) is not None:
            local = _rope_from(r, key + LAYER_TYPES[1], params[LAYER_TYPES[1]], theta, max_pos)
        return full, local
    if isinstance(params, dict):
        return _rope_from(r, "rope_parameters", params, theta, max_pos), local
    return _rope_from(r, "rope_scaling", r.get("rope_scaling") or {}, theta, max_pos), local


def _rope_from(r: _Reader, key: str, d: Any, theta: float, max_pos: int) -> RopeConfig:
    if not isinstance(d, dict):
        r.fail(key, f"expected an object, got {d!r}")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ROPE_TYPES:
        r.fail(key, f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        r.fail(key, "partial RoPE (partial_rotary_factor) is not supported")

    def num(name: str, default: Any = _REQUIRED) -> float:
        value = d.get(name, default)
        if value is _REQUIRED or type(value) not in (int, float):
            r.fail(key, f"rope type {kind!r} needs a number {name!r}, got {d.get(name)!r}")
        return value

    theta = float(num("rope_theta", theta))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, type=kind, factor=float(num("factor")))
    if kind == "yarn":
        original = int(num("original_max_position_embeddings"))
        optional = {name: (None if d.get(name) is None else float(num(name)))
                    for name in ("mscale", "mscale_all_dim", "attention_factor")}
        return RopeConfig(
            theta=theta, type=kind, factor=float(num("factor", max_pos / original)),
            original_max_position_embeddings=original,
            beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
            truncate=bool(d.get("truncate", True)), **optional)
    return RopeConfig(
        theta=theta, type=kind, factor=float(num("factor")),
        low_freq_factor=float(num("low_freq_factor")),
        high_freq_factor=float(num("high_freq_factor")),
        original_max_position_embeddings=int(num("original_max_position_embeddings", max_pos)),
    )


def _read_sliding_windows(r: _Reader, num_layers: int) -> tuple[int | None, ...]:
    rule = r.traits.sliding
    if rule == "none":
        return (None,) * num_layers
    window = r.int("sliding_window", None)
    if window is not None and window < 1:
        r.fail("sliding_window", f"must be >= 1, got {window}")
    if rule == "qwen" and not r.bool("use_sliding_window", False):
        window = None
    if rule == "all" or window is None:
        return (window,) * num_layers
    types = r.get("layer_types")
    if types is None:
        if rule == "qwen":
            first = r.int("max_window_layers", num_layers)
            sliding = [i >= first for i in range(num_layers)]
        else:  # "pattern": every pattern-th layer is global
            pattern = r.int("sliding_window_pattern", r.int("_sliding_window_pattern", 6))
            sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        if not isinstance(types, list) or len(types) != num_layers:
            r.fail("layer_types", f"expected a list of {num_layers} entries, got {types!r}")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            r.fail("layer_types",
                   f"unknown layer type {bad[0]!r} (supported: {', '.join(LAYER_TYPES)})")
        sliding = [t == "sliding_attention" for t in types]
    return tuple(window if s else None for s in sliding)
