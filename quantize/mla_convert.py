"""GQA -> MLA: rewrite a Llama-family model's attention as DeepSeek-style latent attention.

Per layer, from the calibration covariance of the attention input x (Sigma = E[x x^T]):

1. RoPE on a subset of the key (RoRoPE). RoPE turns each frequency pair of every kv head
   by the same angle, so mixing the kv heads of one frequency pair with an orthogonal
   matrix U_f commutes with it. U_f is the PCA of that pair's keys across heads (from
   W_k Sigma W_k^T): mixed head 0 holds most of the pair's energy. The first `rope_heads`
   mixed heads keep RoPE and become the shared RoPE key k_pe; the rest lose it (the one
   approximation besides the rank; exact when rope_heads = num_kv_heads). Queries are
   mixed with the same U_f, so every query head now reads every mixed head.
2. Joint low rank of the rotation-free keys and the values. Z = [K_nope; V] = W_z x is
   factorised as Up @ Down by PCA of Z weighted by what an error costs: a key error by the
   queries that read it (sum over heads of E[q q^T] times the softmax scale^2), a value
   error by the output projection that reads it (sum over the group's heads of W_o^T W_o),
   the two parts balanced to equal weighted energy times `k_weight` (the stage picks it
   from a few values by held-out perplexity). At full rank Up @ Down = W_z exactly.
3. DeepSeek's layout: c_kv = kv_a_layernorm(Down x) with an RMSNorm transformers always
   applies. One more latent value, the constant M (a bias; zero weights, zero norm weight),
   makes the RMS of the latent constant (M / sqrt(rank + 1), to a relative 2^-24 since M is
   chosen 2^12 times the largest |Down x| any input can give), so the norm is linear; its
   weight undoes the division, and what rounding leaves is folded into kv_b_proj. The
   cached constant is 0 after the norm: the latent costs rank + 1 values.

The result is a DeepseekV3ForCausalLM (all layers dense via first_k_dense_replace,
q_lora_rank null, rope_interleave false, attention_bias true for that constant) when
rope_heads is 1, which transformers, vLLM and SGLang read; with more RoPE heads the shared
RoPE key is several kv-head-sized keys, which DeepSeek's config cannot say, and the
architecture is QserveMLAForCausalLM (ours only).

Biases (Qwen 2) are the last column of maps of x~ = [x; 1]: k and v biases become the
latent's and the RoPE key's (kv_a_proj_with_mqa's bias); DeepSeek's q_proj has none, so a
q bias takes the query path DeepSeek has for q compression, q_b(norm(q_a x)), made linear
by the same constant (q_lora_rank = heads x head_dim + 1).

Not convertible (MLAConversionError names why): per-head q/k norms (Qwen 3, Gemma 3: nonlinear in each head's key, so no linear
latent reproduces it), sliding-window layers (MLA layers here attend to the whole context),
logit soft-capping, RoPE scalings other than default / linear / llama3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..runtime.formats.errors import QserveError

CONVERTIBLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MARGIN_BITS = 12  # M = 2^(this) x the largest |Down x|: the norm is linear to ~2^-24


class MLAConversionError(QserveError, ValueError):
    """The source model cannot be converted as asked (names the field and what would work)."""


@dataclass(frozen=True)
class LayerFactors:
    """One layer's conversion before the rank is chosen (fp64)."""

    # maps of x~ = [x; 1] (the last column a bias):
    wq: torch.Tensor  # [H, P + n_nope, hidden+1]: per head [q_pe | q_nope], unscaled
    wk_pe: torch.Tensor  # [P, hidden + 1]: the RoPE key (P = rope_dim)
    wz: torch.Tensor  # [n_nope + Hkv*D, hidden + 1]: rotation-free keys, then values
    basis: torch.Tensor  # [n_z, n_z]: A^(1/2)-weighted principal directions, by energy
    energy: torch.Tensor  # [n_z]: their weighted energies, descending
    a_half: torch.Tensor  # [n_z, n_z]
    a_inv_half: torch.Tensor  # [n_z, n_z]
    rope_energy: float  # share of the keys' energy kept under RoPE
    x_bound: float  # the largest |x| the layer's input norm can give
    wq_source: torch.Tensor  # [H*D, hidden + 1]: the source's q_proj (for a q bias)
    q_mix: torch.Tensor  # [D, Hkv (j), H]: q'_{h,j,d} = q_mix[d, j, h] q_{h,d}
    order: torch.Tensor  # [Hkv*D] int64: mixed rows j*D + d, the RoPE key's first
    rope_dim: int  # P: RoPE key width
    rope_pairs: tuple[int, ...] | None  # the RoPE key's frequency pairs (None: rope heads)


@dataclass
class MLAConversion:
    """What convert() chose: per layer rank and energies (for the manifest and table)."""

    rank: int
    rope_heads: int
    full_rank: int  # rotation-free key + value width: the rank at which it is exact
    layers: list[dict] = field(default_factory=list)

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: rank + the constant + the RoPE key."""
        return self.rank + 1 + self.layers[0]["rope_dim"] if self.layers else 0


def check_convertible(model: nn.Module, rope_heads: int, rank: int | None) -> None:
    cfg = model.config
    arch = cfg.architecture
    if arch not in CONVERTIBLE:
        why = {"Qwen3ForCausalLM": "per-head q/k norms (nonlinear in each head's key)",
               "Gemma3ForCausalLM": "per-head q/k norms and sliding-window layers",
               "Gemma3ForConditionalGeneration": "per-head q/k norms and sliding-window "
                                                 "layers"}.get(arch, "an attention MLA "
                                                                     "conversion does not know")
        raise MLAConversionError(
            f"--mla cannot convert {arch}: it has {why}. Convertible architectures: "
            f"{', '.join(CONVERTIBLE)} (without q/k norms or sliding windows).")
    for what, bad in (("sliding-window layers (sliding_window)", any(cfg.sliding_windows)),
                      ("attention logit soft-capping", cfg.attn_logit_softcap is not None),
                      ("q/k norms", cfg.qk_norm)):
        if bad:
            raise MLAConversionError(f"--mla cannot convert this {arch}: it has {what}, which "
                                     "DeepSeek-style latent attention cannot express.")
    if cfg.rope.type not in ("default", "linear", "llama3"):
        raise MLAConversionError(f"--mla: RoPE type {cfg.rope.type!r} is not convertible "
                                 "(default, linear and llama3 are).")
    if not 1 <= rope_heads <= cfg.num_kv_heads:
        raise MLAConversionError(f"--mla-rope-heads must be between 1 and the model's "
                                 f"{cfg.num_kv_heads} kv heads, got {rope_heads}.")
    full = (2 * cfg.num_kv_heads - rope_heads) * cfg.head_dim
    if rank is not None and not 1 <= rank <= full:
        raise MLAConversionError(
            f"--mla {rank}: the rank must be between 1 and {full}, the width of the "
            f"rotation-free keys and values ({cfg.num_kv_heads - rope_heads} x "
            f"{cfg.head_dim} + {cfg.num_kv_heads} x {cfg.head_dim}) at "
            f"--mla-rope-heads {rope_heads}.")


@torch.no_grad()
def input_covariances(model: nn.Module, rows: torch.Tensor, batch_rows: int = 4
                      ) -> list[torch.Tensor]:
    """E[x~ x~^T] [hidden + 1, hidden + 1] fp64 of every layer's attention input over
    `rows` [N, L] int64 (the source model run on whole sequences), x~ = [x; 1], so that
    projections with biases are linear maps of x~ (their bias the last column)."""
    from ..runtime.attention import AttentionMetadata, DenseAttention

    layers = model.backbone.layers
    hidden = model.config.hidden_size
    sums = [torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64) for _ in layers]
    count = [0]

    def hook(i):
        def pre(module, args):
            x = args[0].float()  # [T, hidden]
            x = torch.cat((x, torch.ones(x.shape[0], 1, dtype=x.dtype)), dim=1)
            sums[i].add_((x.T @ x).double())  # fp32 product per batch, fp64 sum
        return pre

    handles = [layer.self_attn.register_forward_pre_hook(hook(i))
               for i, layer in enumerate(layers)]
    try:
        n, seq_len = rows.shape
        for s in range(0, n, batch_rows):
            chunk = rows[s:s + batch_rows]
            meta = AttentionMetadata.from_lengths([seq_len] * chunk.shape[0])
            positions = torch.arange(seq_len).repeat(chunk.shape[0])
            model(chunk.reshape(-1), positions, meta, DenseAttention())
            count[0] += chunk.numel()
    finally:
        for h in handles:
            h.remove()
    return [s / count[0] for s in sums]


def _augmented(linear: nn.Linear) -> torch.Tensor:
    """[out, in + 1] fp64: the weight, then the bias (zeros without one)."""
    w = linear.weight.double()
    b = linear.bias.double() if linear.bias is not None else torch.zeros(w.shape[0],
                                                                          dtype=torch.float64)
    return torch.cat((w, b[:, None]), dim=1)


def _sqrt_and_inverse(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals, vecs = torch.linalg.eigh(a)
    vals = vals.clamp_min(vals.max() * 1e-12)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


def _pair_mixing(wk: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per frequency pair f, the PCA across kv heads of the keys (k_f, k_{f+D/2}):
    (mix [D/2, j, g], row j the j-th direction; energies [D/2, j], descending).
    wk [Hkv, D, hidden + 1]."""
    half = wk.shape[1] // 2
    pairs = torch.stack((wk[:, :half], wk[:, half:]))  # [2, Hkv, D/2, hidden]
    proj = torch.einsum("cgfk,kl->cgfl", pairs, sigma)
    cov = torch.einsum("cgfl,chfl->fgh", proj, pairs)  # [D/2, Hkv, Hkv]
    vals, vecs = torch.linalg.eigh(cov)  # ascending
    return vecs.flip(-1).transpose(1, 2), vals.flip(-1)


def rope_slot_scores(layer: nn.Module, sigma: torch.Tensor, cfg, span: int) -> torch.Tensor:
    """[D/2, Hkv]: what dropping RoPE from mixed head j of frequency pair f costs, as
    E|q'|^2 E|k'|^2 (1 - sinc(theta_f span)): the energy of the pair's query and key in that
    direction times how far the rotation turns them over distances uniform in [0, span]
    (2D vectors at random angles: E[(q^T (R - I) k)^2] ~ |q|^2 |k|^2 (1 - cos)). Pairs
    that turn little within the span cost little; the fastest ones cost at any distance."""
    from ..runtime.layers.rotary import rope_inv_freq

    attn = layer.self_attn
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    half = d // 2
    wq = _augmented(attn.q_proj).view(h, d, -1)
    mix, k_energy = _pair_mixing(_augmented(attn.k_proj).view(hkv, d, -1), sigma)
    qp = torch.stack((wq[:, :half], wq[:, half:]))  # [2, H, D/2, hidden + 1]
    q_head = torch.einsum("chfk,kl,chfl->hf", qp, sigma, qp)  # [H, D/2]
    q_energy = torch.einsum("fjh,hf->fj", mix[:, :, torch.arange(h) // (h // hkv)] ** 2,
                            q_head)  # [D/2, j]: mixed query energy, all heads
    turn = rope_inv_freq(d, cfg.rope).double() * span  # [D/2]
    return q_energy * k_energy * (1 - torch.sin(turn) / turn)[:, None]


def choose_rope_slots(scores: list[torch.Tensor], count: int) -> list[list[tuple[int, int]]]:
    """Per layer, the `count` (pair f, mixed head j) slots with the highest
    rope_slot_scores [D/2, Hkv]: those keep RoPE. Sorted by (f, j). (One choice for all
    layers, a head count per pair by the layers' summed scores, measured worse than whole
    heads on SmolLM2: docs/mla.md.)"""
    chosen = []
    for s in scores:
        idx = s.flatten().topk(count).indices
        chosen.append(sorted((int(i) // s.shape[1], int(i) % s.shape[1]) for i in idx))
    return chosen


def layer_factors(layer: nn.Module, sigma: torch.Tensor, cfg, rope_heads: int,
                  k_weight: float = 1.0, slots: list[tuple[int, int]] | None = None
                  ) -> LayerFactors:
    """One layer's factors from its input second moment `sigma` [hidden + 1, hidden + 1].
    k_weight: how much the rotation-free keys' weighted energy counts against the values'
    in the joint factorisation (1: equal). slots: the (pair f, mixed head j) that keep
    RoPE, as one table of their frequencies in halves (choose_rope_slots); None: the first
    `rope_heads` mixed heads whole."""
    attn = layer.self_attn
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, half = h // hkv, d // 2
    # [out, hidden + 1]: the weight and the bias (0 without) as one map of x~ = [x; 1]
    wq = _augmented(attn.q_proj).view(h, d, -1)  # [H, D, hidden + 1]
    wk = _augmented(attn.k_proj).view(hkv, d, -1)
    wv = _augmented(attn.v_proj).view(hkv, d, -1)
    wo = attn.o_proj.weight.double()  # [hidden, H*D]
    # 1. per frequency pair f: PCA across kv heads of (k_f, k_f+D/2)
    mix, vals = _pair_mixing(wk, sigma)  # [D/2, j, g], [D/2, j]
    if slots is None:
        slots = [(f, j) for j in range(rope_heads) for f in range(half)]
        order = list(range(hkv * d))  # the first rope_heads mixed heads, each in halves
        pairs = None
    else:  # one table of the slots' frequencies: [x of each slot | y of each slot]
        pe = [j * d + f for f, j in slots] + [j * d + f + half for f, j in slots]
        order = pe + sorted(set(range(hkv * d)) - set(pe))
        pairs = tuple(f for f, _ in slots)
    order = torch.tensor(order)
    rope_dim = 2 * len(slots)
    rope_energy = float(sum(vals[f, j] for f, j in slots) / vals.sum().clamp_min(1e-30))
    mix_d = torch.cat((mix, mix), dim=0)  # [D, j, g]: dims f and f + D/2 share U_f
    wk_mixed = torch.einsum("djg,gdk->jdk", mix_d, wk)  # [Hkv (j), D, hidden]
    heads_group = torch.arange(h) // group
    # q'_{h,j,d} = U_d[j, g(h)] q_{h,d}
    wq_mixed = mix_d[:, :, heads_group].permute(2, 1, 0).unsqueeze(-1) * wq.unsqueeze(1)
    # wq_mixed: [H, Hkv (j), D, hidden]
    wq_new = wq_mixed.reshape(h, hkv * d, -1)[:, order]  # [q_pe | q_nope]
    hidden = wk.shape[-1]
    wk_all = wk_mixed.reshape(hkv * d, hidden)[order]
    wk_pe, wk_nope = wk_all[:rope_dim], wk_all[rope_dim:]
    n_nope = wk_nope.shape[0]
    wz = torch.cat((wk_nope, wv.reshape(hkv * d, hidden)))  # [n_z, hidden]
    # 2. error weights: keys by the queries reading them, values by o_proj
    q_nope = wq_new[:, rope_dim:]  # [H, n_nope, hidden]
    a_k = torch.einsum("hnk,kl,hml->nm", q_nope, sigma, q_nope) * cfg.attn_scale ** 2
    a_v = torch.zeros(hkv * d, hkv * d, dtype=torch.float64)
    for g in range(hkv):
        wo_g = wo[:, g * group * d:(g + 1) * group * d].reshape(-1, group, d)
        blk = torch.einsum("khd,khe->de", wo_g, wo_g)
        a_v[g * d:(g + 1) * d, g * d:(g + 1) * d] = blk
    sigma_z = wz @ sigma @ wz.T
    if n_nope:  # balance: the key part weighs k_weight times the value part in total
        e_k = float(torch.trace(a_k @ sigma_z[:n_nope, :n_nope]))
        e_v = float(torch.trace(a_v @ sigma_z[n_nope:, n_nope:]))
        a_k = a_k * (e_v / max(e_k, 1e-30)) * k_weight
    a = torch.block_diag(a_k, a_v) if n_nope else a_v
    a_half, a_inv_half = _sqrt_and_inverse(a)
    energy, basis = torch.linalg.eigh(a_half @ sigma_z @ a_half)
    norm_w = layer.input_layernorm.weight.double()
    return LayerFactors(
        wq=wq_new, wk_pe=wk_pe, wz=wz, basis=basis.flip(-1), energy=energy.flip(-1),
        wq_source=wq.reshape(h * d, -1), q_mix=mix_d[:, :, heads_group],
        a_half=a_half, a_inv_half=a_inv_half, rope_energy=rope_energy, order=order,
        rope_dim=rope_dim, rope_pairs=pairs,
        x_bound=math.sqrt(cfg.hidden_size) * float(norm_w.abs().max()))


def _bf16_exact(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.bfloat16))


def _linear_norm(w: torch.Tensor, x_bound: float) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, float]:
    """A projection w [n, hidden + 1] of x~ followed by DeepSeek's RMSNorm, made linear:
    (weight [n + 1, hidden], bias [n + 1], norm weight [n + 1], gamma) such that
    norm(weight x + bias) = [gamma * (w x~); 0]. The extra row is the constant M (bias),
    2^MARGIN_BITS times the largest |w x~| an input can give."""
    n, hidden = w.shape[0], w.shape[1] - 1
    bound = (float(torch.linalg.matrix_norm(w[:, :hidden], ord=2)) * x_bound
             + float(w[:, hidden].norm()))
    big = 2.0 ** (math.ceil(math.log2(max(bound, 1e-30))) + MARGIN_BITS)
    w_c = _bf16_exact(big / math.sqrt(n + 1))  # a weight every dtype holds exactly
    gamma = w_c * math.sqrt(n + 1) / big
    weight = torch.cat((w[:, :hidden], torch.zeros(1, hidden, dtype=w.dtype)))
    bias = torch.cat((w[:, hidden], torch.tensor([big], dtype=w.dtype)))
    norm = torch.full((n + 1,), w_c, dtype=torch.float64)
    norm[n] = 0.0
    return weight, bias, norm, gamma


def layer_tensors(f: LayerFactors, rank: int, cfg, prefix: str
                  ) -> tuple[dict[str, torch.Tensor], dict]:
    """The DeepSeek-layout tensors of one converted layer (fp32) and its summary."""
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rope_dim = f.rope_dim
    n_nope = hkv * d - rope_dim
    e_r = f.basis[:, :rank]
    down = e_r.T @ f.a_half @ f.wz  # [rank, hidden + 1]
    up = f.a_inv_half @ e_r  # [n_z, rank]
    # 3. the constant that makes kv_a_layernorm linear
    latent_w, latent_b, norm, gamma = _linear_norm(down, f.x_bound)
    up = torch.cat((up / gamma, torch.zeros(up.shape[0], 1, dtype=up.dtype)), dim=1)
    hidden = latent_w.shape[1]
    kv_a = torch.cat((latent_w, f.wk_pe[:, :hidden]))
    kv_a_bias = torch.cat((latent_b, f.wk_pe[:, hidden]))
    group = h // hkv
    uk = up[:n_nope]  # [n_nope, rank + 1], the same for every head
    kv_b = torch.cat([torch.cat((uk, up[n_nope + (i // group) * d:
                                       n_nope + (i // group + 1) * d])) for i in range(h)])
    q_scale = cfg.attn_scale / (n_nope + rope_dim) ** -0.5  # our softmax scale folded in
    a = f"{prefix}.self_attn."
    tensors = {a + "kv_a_proj_with_mqa.weight": kv_a, a + "kv_a_proj_with_mqa.bias": kv_a_bias,
               a + "kv_a_layernorm.weight": norm, a + "kv_b_proj.weight": kv_b}
    if has_q_bias(f):  # DeepSeek's q_proj has no bias: q_b(norm(q_a x~)), made linear
        q_a, q_a_bias, q_norm, q_gamma = _linear_norm(f.wq_source, f.x_bound)
        mix = f.q_mix.permute(2, 1, 0) * (q_scale / q_gamma)  # [H, Hkv (j), D]
        blocks = torch.zeros(h, hkv, d, h * d + 1, dtype=torch.float64)
        for i in range(h):  # q'_{h,j,d} reads q_{h,d} (column h*D + d)
            blocks[i, :, torch.arange(d), i * d + torch.arange(d)] = mix[i]
        blocks = blocks.reshape(h, hkv * d, -1)[:, f.order]  # [H, rope_dim + n_nope, H*D + 1]
        q_b = torch.cat((blocks[:, rope_dim:], blocks[:, :rope_dim]), dim=1).reshape(-1, h * d + 1)
        tensors.update({a + "q_a_proj.weight": q_a, a + "q_a_proj.bias": q_a_bias,
                        a + "q_a_layernorm.weight": q_norm, a + "q_b_proj.weight": q_b})
    else:
        wq = f.wq[..., :hidden] * q_scale  # [H, rope_dim + n_nope, hidden]
        q = torch.cat((wq[:, rope_dim:], wq[:, :rope_dim]), dim=1).reshape(-1, hidden)
        tensors[a + "q_proj.weight"] = q
    kept = float(f.energy[:rank].sum() / f.energy.sum().clamp_min(1e-30))
    info = {"rank": rank, "rope_dim": rope_dim, "latent_energy_kept": round(kept, 6),
            "rope_energy_kept": round(f.rope_energy, 6)}
    if f.rope_pairs is not None:
        info["rope_pairs"] = list(f.rope_pairs)
    return {k: v.float() for k, v in tensors.items()}, info


def rope_pairs_of(factors: list[LayerFactors]) -> list[list[int]] | None:
    """Per layer, the RoPE key's frequency pairs (converted_config's rope_pairs), or None
    when the layers kept RoPE on whole mixed heads."""
    if factors[0].rope_pairs is None:
        return None
    return [list(f.rope_pairs) for f in factors]


def has_q_bias(f: LayerFactors) -> bool:
    return bool(f.wq_source[:, -1].any())


def converted_config(source_config: dict, cfg, rank: int, rope_heads: int,
                     q_bias: bool = False, rope_pairs: list[list[int]] | None = None) -> dict:
    """The DeepseekV3-layout config.json of the converted model. q_bias: the source's
    q_proj has a bias, which goes through q_a_proj (q_lora_rank = heads x head_dim + 1).
    rope_pairs: per layer, the RoPE key's frequency pairs (then rope_heads is how many
    kv heads' worth of them there are)."""
    d, hkv = cfg.head_dim, cfg.num_kv_heads
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")
    out = {k: source_config[k] for k in keep if k in source_config}
    out.update({
        "architectures": ["DeepseekV3ForCausalLM" if rope_heads == 1 and rope_pairs is None
                          else "QserveMLAForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.num_heads * d + 1 if q_bias else None, "kv_lora_rank": rank + 1,
        "qk_rope_head_dim": rope_heads * d, "qk_nope_head_dim": (hkv - rope_heads) * d,
        "v_head_dim": d, "head_dim": rope_heads * d,
        "first_k_dense_replace": cfg.num_layers,  # every layer dense: no experts
        "rope_interleave": False, "attention_bias": True,
        "mla_conversion": {"source_architecture": cfg.architecture, "rank": rank,
                           "rope_heads": rope_heads},
    })
    if rope_pairs is not None:  # one table of the chosen pairs, a table per layer
        out.update(rope_pairs=[list(p) for p in rope_pairs], rope_pair_dim=d)
        out["mla_conversion"]["rope_select"] = "pairs"
    elif rope_heads > 1:
        out["rope_heads"] = rope_heads
    return out


def convert_state(model: nn.Module, factors: list[LayerFactors], rank: int
                  ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The converted model's whole state dict (HF names, fp32) and per-layer summaries."""
    cfg = model.config
    bb = model.backbone_path
    state: dict[str, torch.Tensor] = {}
    summary = []
    attn_names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for name, p in model.named_parameters():
        if ".self_attn." in name and name.split(".self_attn.")[1].split(".")[0] in attn_names[:3]:
            continue
        state[name] = p.detach().float()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i, f in enumerate(factors):
        tensors, info = layer_tensors(f, rank, cfg, f"{bb}.layers.{i}")
        state.update(tensors)
        state.setdefault(f"{bb}.layers.{i}.self_attn.o_proj.bias", torch.zeros(cfg.hidden_size))
        summary.append(info)
    return state, summary


def build_converted(config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype
                    ) -> nn.Module:
    """Our model for a converted config and state dict, in memory (for the rank search)."""
    from ..runtime.models.loader import finish_model
    from ..runtime.models.registry import get_model_class

    cls = get_model_class(config["architectures"][0])
    with torch.device("meta"):
        model = cls(cls.config_from_hf(config))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False,
                          assign=True)
    model.tie_weights()
    return finish_model(model)
