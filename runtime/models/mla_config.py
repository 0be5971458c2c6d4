"""MLAConfig and MoEConfig: the DeepSeek-V2/V3 parts of a config.json, normalised.

DeepSeek's attention (MLA) caches one vector per token and layer, the latent `c_kv`
(`kv_lora_rank` values) followed by a RoPE key shared by all heads (`qk_rope_head_dim`);
its MLP layers from `first_k_dense_replace` on are mixtures of experts. Both are read
here into small frozen dataclasses that ModelConfig carries (`cfg.mla`, `cfg.moe`); for
an MLA model ModelConfig's `num_kv_heads` is 1 and `head_dim` is the cached vector's
width, so the KV cache code sizes its pools without knowing about MLA.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.rotary import RopeConfig, yarn_mscale

# Routing rules (transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int  # R: width of the cached latent c_kv
    qk_nope_head_dim: int  # per head: query/key dims without RoPE (keys from c_kv)
    qk_rope_head_dim: int  # P: the decoupled RoPE key, one for all heads
    v_head_dim: int
    rope_interleave: bool  # RoPE on interleaved pairs (DeepSeek checkpoints) vs halves
    softmax_scale: float  # (qk_nope + qk_rope) ** -0.5, times YaRN's mscale_all_dim ** 2
    # The RoPE key as this many equal keys, each rotated by the same RoPE table (a model
    # converted from GQA that keeps RoPE on several kv heads; DeepSeek's own: 1)
    rope_heads: int = 1
    # Per layer, the source frequency pair of each of the RoPE key's qk_rope_head_dim / 2
    # pairs, of a table for a rope_pair_dim-wide head (a GQA model converted with RoPE
    # kept on the pairs that carry position, quantize/mla_convert.py); None: DeepSeek's
    # own table of qk_rope_head_dim
    rope_pairs: tuple[tuple[int, ...], ...] | None = None
    rope_pair_dim: int = 0

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: c_kv then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # routed experts
    experts_per_token: int
    intermediate_size: int  # of each routed expert
    num_shared_experts: int  # one MLP of num_shared * intermediate_size, always applied
    first_dense_layers: int  # layers before this one use a dense MLP
    topk_method: str  # one of TOPK_METHODS; "noaux_tc" scores by sigmoid, the rest by softmax
    num_groups: int  # experts are routed within the best `topk_groups` of `num_groups`
    topk_groups: int
    norm_topk_prob: bool  # renormalise the chosen experts' weights to sum to 1
    routed_scaling_factor: float

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_dense_layers


def read_mla(r, rope: RopeConfig, interleave: bool | None) -> MLAConfig:
    """MLAConfig from a config reader (models/config.py's _Reader). interleave: None reads
    `rope_interleave` (default true, V3); a bool is the architecture's fixed layout (V2)."""
    q_lora = r.int("q_lora_rank", None)
    dims = {k: r.int(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                  "v_head_dim")}
    for key, value in [("q_lora_rank", q_lora), *dims.items()]:
        least = 0 if key == "qk_nope_head_dim" else 1  # 0: every key dimension has RoPE
        if value is not None and value < least:
            r.fail(key, f"must be an integer >= {least}, got {value}")
    if dims["qk_rope_head_dim"] % 2:
        r.fail("qk_rope_head_dim", f"{dims['qk_rope_head_dim']} is odd; RoPE needs pairs")
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    if rope.type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    if interleave is None:
        interleave = r.bool("rope_interleave", True)
    rope_heads = r.int("rope_heads", 1)
    if rope_heads < 1 or dims["qk_rope_head_dim"] % (2 * rope_heads):
        r.fail("rope_heads", f"{rope_heads} must be >= 1 and split qk_rope_head_dim="
               f"{dims['qk_rope_head_dim']} into keys of an even width")
    pairs, pair_dim = _rope_pairs(r, dims["qk_rope_head_dim"], rope_heads, interleave)
    return MLAConfig(q_lora_rank=q_lora, rope_interleave=interleave, softmax_scale=scale,
                     rope_heads=rope_heads, rope_pairs=pairs, rope_pair_dim=pair_dim, **dims)


def _rope_pairs(r, rope_dim: int, rope_heads: int, interleave: bool
                ) -> tuple[tuple[tuple[int, ...], ...] | None, int]:
    """`rope_pairs` (a list per layer of frequency-pair indices, rope_dim / 2 each) and
    `rope_pair_dim` (the head width whose RoPE table they index), checked."""
    pairs = r.get("rope_pairs", None)
    if pairs is None:
        return None, 0
    pair_dim = r.int("rope_pair_dim", None)
    if pair_dim is None or pair_dim < 2 or pair_dim % 2:
        r.fail("rope_pair_dim", f"must be an even integer >= 2 with rope_pairs, got {pair_dim}")
    if rope_heads != 1 or interleave:
        r.fail("rope_pairs", "needs rope_heads 1 and rope_interleave false (RoPE in halves)")
    n_layers = r.int("num_hidden_layers")
    ok = (isinstance(pairs, list) and len(pairs) == n_layers
          and all(isinstance(p, list) and len(p) == rope_dim // 2
                  and all(isinstance(i, int) and 0 <= i < pair_dim // 2 for i in p)
                  for p in pairs))
    if not ok:
        r.fail("rope_pairs", f"must be {n_layers} lists (one per layer) of "
               f"qk_rope_head_dim / 2 = {rope_dim // 2} pair indices in [0, {pair_dim // 2})")
    return tuple(tuple(p) for p in pairs), pair_dim


def read_moe(r, num_layers: int, topk_method_default: str) -> MoEConfig | None:
    """MoEConfig, or None where no layer is a mixture (no routed experts, or every layer
    before `first_k_dense_replace`)."""
    first_dense = r.int("first_k_dense_replace", 0)
    experts = r.int("n_routed_experts", None)
    if experts is None or first_dense >= num_layers:
        return None
    if r.get("moe_layer_freq", 1) != 1:
        r.fail("moe_layer_freq", "only 1 (every layer from first_k_dense_replace is a "
               "mixture of experts) is supported")
    method = r.str("topk_method", topk_method_default)
    if method not in TOPK_METHODS:
        r.fail("topk_method", f"{method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
    scoring = r.str("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax")
    if scoring != ("sigmoid" if method == "noaux_tc" else "softmax"):
        r.fail("scoring_func", f"{scoring!r} with topk_method {method!r} is not supported "
               "(noaux_tc scores by sigmoid, the others by softmax)")
    groups = r.int("n_group", None) or 1
    topk_groups = r.int("topk_group", None) or groups
    if method != "greedy":
        if experts % groups:
            r.fail("n_group", f"{groups} does not divide n_routed_experts={experts}")
        if not 1 <= topk_groups <= groups:
            r.fail("topk_group", f"must be between 1 and n_group={groups}, got {topk_groups}")
    top_k = r.int("num_experts_per_tok")
    if not 1 <= top_k <= experts:
        r.fail("num_experts_per_tok", f"must be between 1 and n_routed_experts={experts}, "
               f"got {top_k}")
    return MoEConfig(
        num_experts=experts, experts_per_token=top_k,
        intermediate_size=r.int("moe_intermediate_size"),
        num_shared_experts=r.int("n_shared_experts", None) or 0,
        first_dense_layers=first_dense, topk_method=method, num_groups=groups,
        topk_groups=topk_groups, norm_topk_prob=r.bool("norm_topk_prob", False),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0))
