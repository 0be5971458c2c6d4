"""Decode steps of a Llama or Gemma 3 FP8 artifact on CPU as a loop of C calls, no torch ops.

    decoder = NativeDecoder.build(model, kv_cache, decode_impl)  # None where it cannot run
    hidden = decoder.forward(input_ids, positions, meta)  # [T, hidden] bf16, or None

A decode step of a few sequences spends more time in Python and torch's per-op dispatch
(~20 ops per layer, each with its dispatch cost) than in its kernels. This runs the same layer, with
the same kernels and roundings, as one C call per step of the layer:

    x = rms_norm(h)                      csrc/rms_norm_cpu.c
    qkv = fp8_linear(x)                  csrc/fp8_gemv_cpu.c (E4M3 weight bytes)
    q, k = q_norm(q), k_norm(k)          (Gemma 3: per head)
    q, k = rope(q), rope(k)              csrc/rotary_cpu.c (the layer's RoPE: global/local)
    store k, v in the paged cache        csrc/kv_store_cpu.c
    a = bf16(paged_attention(q))         csrc/paged_attention_cpu.c, csrc/elementwise_cpu.c
    h = h + [norm](fp8_linear(a))        (o_proj; Gemma 3 norms its output)
    x = rms_norm(h)
    h = h + [norm](fp8_linear(act(g) * u))   (gate|up, then down; SiLU or GELU-tanh)

with the scratch buffers of a step allocated once, and every weight's pointer and scale
read once at build. The result equals the module path's up to the ops that are not
bit-identical there either: the activation's exp/tanh (elementwise_cpu.c) and the norms'
sum order.

`build` returns None unless the model is a Llama (RMSNorm, SiLU, no biases, no soft-caps)
or a Gemma 3 (its four norms, q/k norms, GELU-tanh, embedding scale, local RoPE), every
linear is a packed Fp8Linear with its E4M3 bytes (EngineConfig.keep_fp8_weights), the K/V
pools are FP8 or bf16 and every C library builds. `forward` returns None (the caller runs
the modules) for steps of more than `native_fp8_gemv.max_rows()` tokens (MAX_ROWS with AMX
or AVX512-BF16; any number with AVX2, so there prefill and decode steps take the same
per-row sums whatever the batch) or with padding slots.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ...kernels import native_attention as attention_lib
from ...kernels import native_fp8_gemv, native_kv_store, native_norm, native_rotary
from ...kernels.kv_store import as_fp8_view, check_scale, is_fp8_pool
from ...kernels.native_build import cached_library
from ...kernels.paged_attention import kernel_scales
from ..layers.fp8_linear import Fp8Linear
from ..layers.norm import GemmaRMSNorm, RMSNorm
from .gemma3 import Gemma3DecoderLayer, Gemma3TextModel
from .llama import LlamaDecoderLayer, LlamaModel

# backbone class -> (its layer class, its norm class and the C norm kind, activations)
FAMILIES = {
    LlamaModel: (LlamaDecoderLayer, RMSNorm, "llama", {"silu": 0, "swish": 0}),
    Gemma3TextModel: (Gemma3DecoderLayer, GemmaRMSNorm, "gemma",
                      {"gelu_pytorch_tanh": 1, "gelu_new": 1}),
}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


# csrc/elementwise_cpu.c with its functions' signatures set, or None
_elementwise = cached_library("elementwise_cpu", {
    "qserve_add_bf16": ([_P, _P, _I64], None),
    "qserve_act_mul_bf16": ([_P, _I64, _I64, ctypes.c_int, _P], None),
    "qserve_round_bf16": ([_P, _I64, _P], None),
})


@dataclass(frozen=True)
class _Linear:
    weight: int  # E4M3 bytes in the kernel's tile layout (native_fp8_gemv.PackedFp8Weight)
    out_features: int
    input_scale: float
    out_scale: int  # fp32 [out] or [1]
    scale_len: int

    @classmethod
    def of(cls, m) -> "_Linear | None":
        if not isinstance(m, Fp8Linear) or m._cpu_fp8 is None or m.bias is not None:
            return None
        return cls(m._cpu_fp8.data.data_ptr(), m.out_features, m._input_scale_value,
                   m.out_scale.data_ptr(), m.out_scale.numel())


@dataclass(frozen=True)
class _Layer:
    # norms: bf16 weight pointers, 0 where the family has none
    in_norm: int  # before attention
    q_norm: int  # per head, before RoPE (Gemma 3)
    k_norm: int
    attn_out_norm: int  # on attention's output (Gemma 3)
    mlp_in_norm: int  # before the MLP
    mlp_out_norm: int  # on the MLP's output (Gemma 3)
    eps: float
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    rope: str  # "global" | "local": the step's RoPE table this layer uses
    k_pool: int
    v_pool: int
    store_scales: tuple[int, int, int]  # k_scale, v_scale fp32 [1|Hkv] (FP8), their length
    qk_scale: int  # fp32 [Hkv]: k_scale * softmax scale (FP8) or the softmax scale
    v_scale: int  # fp32 [Hkv]
    window: int  # 0: full causal
    group: int  # the KV group whose block tables and slots the layer uses


class NativeDecoder:
    def __init__(self, model, kv_cache, layers: list[_Layer], keep: list[torch.Tensor],
                 norm_kind: int, act: int):
        cfg = model.config
        self.norm_kind, self.act = norm_kind, act
        self.model, self.kv_cache, self.layers = model, kv_cache, layers
        self._keep = keep  # tensors the pointers above point into
        self.hidden = cfg.hidden_size
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inter = cfg.intermediate_size
        pools = kv_cache.layer(0)
        self.pool_kind = attention_lib.POOL_KINDS[as_fp8_view(pools.k_pool).dtype]
        self.store_kind = native_kv_store.POOL_KINDS[pools.k_pool.dtype]
        self.final_norm = model.backbone.norm
        self.gemv = native_fp8_gemv._library().qserve_fp8_gemv_bf16
        self.max_rows = native_fp8_gemv.max_rows()  # tokens a step may have to run here
        self.norm = native_norm._library().qserve_rms_norm_bf16
        self.rope = native_rotary._library().qserve_rotary_bf16
        self.store = native_kv_store._library().qserve_store_kv
        self.attend = attention_lib._library().qserve_paged_attention_cpu
        ew = _elementwise()
        self.add, self.act_mul, self.round = (ew.qserve_add_bf16, ew.qserve_act_mul_bf16,
                                              ew.qserve_round_bf16)

    @classmethod
    def build(cls, model, kv_cache, decode_impl: str | None) -> "NativeDecoder | None":
        if decode_impl not in (None, "native"):
            return None
        backbone = getattr(model, "backbone", None)
        cfg = getattr(model, "config", None)
        family = FAMILIES.get(type(backbone))
        if family is None or cfg is None:
            return None
        layer_cls, norm_cls, norm_kind, acts = family
        if (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.hidden_act not in acts
                or cfg.attn_logit_softcap):
            return None
        if cfg.qk_norm != (layer_cls is Gemma3DecoderLayer):
            return None  # q/k norms only where this decoder applies them
        libs = (native_fp8_gemv._library(), native_norm._library(), native_rotary._library(),
                native_kv_store._library(), attention_lib._library(), _elementwise())
        if any(lib is None for lib in libs):
            return None
        if not _norm_ok(backbone.norm, norm_cls):
            return None
        layers, keep = [], []
        for layer in backbone.layers:
            built = cls._layer(layer, layer_cls, norm_cls, kv_cache, keep)
            if built is None:
                return None
            layers.append(built)
        return cls(model, kv_cache, layers, keep, native_norm.NORM_KINDS[norm_kind],
                   acts[cfg.hidden_act])

    @staticmethod
    def _layer(layer, layer_cls, norm_cls, kv_cache, keep) -> _Layer | None:
        if type(layer) is not layer_cls:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        gemma = layer_cls is Gemma3DecoderLayer
        norms = [layer.input_layernorm, attn.q_norm, attn.k_norm,
                 layer.post_attention_layernorm if gemma else None,
                 layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
                 layer.post_feedforward_layernorm if gemma else None]
        if any(n is not None and not _norm_ok(n, norm_cls) for n in norms):
            return None
        linears = [_Linear.of(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                             mlp.down_proj)]
        if any(lin is None for lin in linears):
            return None
        spec = attn.spec
        if spec.logit_softcap is not None:
            return None
        kv = kv_cache.layer(spec.layer_idx)
        k_pool, v_pool = kv.k_pool, kv.v_pool
        if (k_pool.dtype not in native_kv_store.POOL_KINDS
                or as_fp8_view(k_pool).dtype not in attention_lib.POOL_KINDS
                or not (k_pool.is_contiguous() and v_pool.is_contiguous())):
            return None
        hkv, fp8 = k_pool.shape[2], is_fp8_pool(k_pool)
        # the scales as the module path checks them (kv_store) and as its kernels take them
        ks = check_scale("k_scale", kv.k_scale, fp8, hkv)
        vs = check_scale("v_scale", kv.v_scale, fp8, hkv)
        qk, v_attn = kernel_scales(ks, vs, spec.scale, hkv)
        store_scales = (0, 0, 1)
        if fp8:
            ks, vs = ks.contiguous(), vs.contiguous()
            store_scales = (ks.data_ptr(), vs.data_ptr(), ks.numel())
            keep += [ks, vs]
        keep += [qk, v_attn]
        ptrs = [0 if n is None else n.weight.data_ptr() for n in norms]
        return _Layer(*ptrs, float(layer.input_layernorm.eps), *linears, layer.rope_kind,
                      k_pool.data_ptr(), v_pool.data_ptr(), store_scales, qk.data_ptr(),
                      v_attn.data_ptr(), spec.sliding_window or 0,
                      kv_cache.group_of(spec.layer_idx))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                taps: dict[int, torch.Tensor | None] | None = None
                ) -> torch.Tensor | None:  # [T] int64 x2 -> [T, hidden] bf16
        """`taps`: layer index -> filled with a copy of the residual stream after that
        layer [T, hidden] bf16 (what a draft head reads)."""
        t = input_ids.shape[0]
        if t > self.max_rows or not hasattr(meta, "plan"):
            return None
        pools = self.kv_cache.layer(0).k_pool
        plans = [meta.for_group(g).plan(t, pools.shape[0], pools.shape[1])
                 for g in range(self.kv_cache.groups.num_groups)]
        if any(p.store_rows is not None for p in plans):  # padding slots: the module path
            return None  # skips them
        h, ropes = self.model.backbone.embed(input_ids, positions)  # [T, hidden] bf16
        h = h.contiguous()
        tabs = {kind: (c.contiguous(), s.contiguous()) for kind, (c, s) in ropes.items()}
        rope_ptrs = {kind: (c.data_ptr(), s.data_ptr()) for kind, (c, s) in tabs.items()}
        plan = plans[0]
        qsl, lens = plan.query_start_loc.contiguous(), plan.seq_lens.contiguous()
        # per KV group: its block tables [B, max_blocks] int32 and the new tokens' slots [T]
        tabs_slots = [(p.block_tables.contiguous(), p.store_slots.contiguous()) for p in plans]
        group_ptrs = [(bt.data_ptr(), sl.data_ptr(), bt.shape[1]) for bt, sl in tabs_slots]
        hq, hkv, d, hidden, inter = self.hq, self.hkv, self.d, self.hidden, self.inter
        qkv_w = (hq + 2 * hkv) * d
        bf = torch.bfloat16
        x = torch.empty(t, max(hidden, hq * d, inter), dtype=bf)  # norm / linear inputs
        qkv = torch.empty(t, qkv_w, dtype=bf)
        qn = torch.empty(t, qkv_w, dtype=bf)  # every head row of qkv under q_norm (Gemma 3)
        kn = torch.empty(t, qkv_w, dtype=bf)  # ... and under k_norm
        q = torch.empty(t, hq, d, dtype=bf)
        k = torch.empty(t, hkv, d, dtype=bf)
        att = torch.empty(t, hq * d, dtype=torch.float32)
        out = torch.empty(t, hidden, dtype=bf)
        gu = torch.empty(t, 2 * inter, dtype=bf)
        hp, xp, qkvp, qp, kp, qnp, knp, attp, outp, gup = (
            a.data_ptr() for a in (h, x, qkv, q, k, qn, kn, att, out, gu))
        qslp, lensp = qsl.data_ptr(), lens.data_ptr()
        nseq = lens.shape[0]
        threads = torch.get_num_threads()
        bs = pools.shape[1]
        gemv, norm, rope, store, attend = self.gemv, self.norm, self.rope, self.store, self.attend
        add, act_mul, rnd, kind = self.add, self.act_mul, self.round, self.norm_kind
        n = t * hidden

        def linear(lin: _Linear, xin: int, k_in: int, dst: int) -> None:
            if gemv(xin, t, k_in, k_in, lin.input_scale, lin.weight, lin.out_features,
                    lin.out_scale, lin.scale_len, dst, lin.out_features, threads):
                raise MemoryError("the native FP8 linear could not allocate its input buffer.")

        for index, L in enumerate(self.layers):
            cp, sp = rope_ptrs[L.rope]
            tp, slotp, tstride = group_ptrs[L.group]
            norm(hp, t, hidden, hidden, L.in_norm, L.eps, kind, xp, threads)
            linear(L.qkv, xp, hidden, qkvp)
            if L.q_norm:  # per head: two calls over all t * (hq + 2 hkv) head rows (one per
                # weight) instead of two per token; RoPE reads the q rows of one, k of the other
                norm(qkvp, t * qkv_w // d, d, d, L.q_norm, L.eps, kind, qnp, threads)
                norm(qkvp, t * qkv_w // d, d, d, L.k_norm, L.eps, kind, knp, threads)
                q_src, k_src, stride = qnp, knp + 2 * hq * d, qkv_w
            else:
                q_src, k_src, stride = qkvp, qkvp + 2 * hq * d, qkv_w
            rope(q_src, t, stride, hq, d, cp, sp, qp)
            rope(k_src, t, stride, hkv, d, cp, sp, kp)
            store(kp, hkv * d, qkvp + 2 * (hq + hkv) * d, qkv_w, t, hkv, d, slotp,
                  self.store_kind, L.store_scales[0] or None, L.store_scales[1] or None,
                  L.store_scales[2], L.k_pool, L.v_pool)
            if attend(qp, 1, L.qk_scale, hq, d, L.k_pool, L.v_pool, self.pool_kind, bs, hkv,
                      tp, tstride, qslp, lensp, None, nseq, L.window, 0.0, L.v_scale, attp,
                      threads):
                raise MemoryError("native attention could not allocate its score buffers.")
            rnd(attp, t * hq * d, xp)  # [T, hq * d] bf16, as the module path rounds it
            linear(L.o, xp, hq * d, outp)
            if L.attn_out_norm:
                norm(outp, t, hidden, hidden, L.attn_out_norm, L.eps, kind, xp, threads)
                add(hp, xp, n)
            else:
                add(hp, outp, n)
            norm(hp, t, hidden, hidden, L.mlp_in_norm, L.eps, kind, xp, threads)
            linear(L.gate_up, xp, hidden, gup)
            act_mul(gup, t, inter, self.act, xp)
            linear(L.down, xp, inter, outp)
            if L.mlp_out_norm:
                norm(outp, t, hidden, hidden, L.mlp_out_norm, L.eps, kind, xp, threads)
                add(hp, xp, n)
            else:
                add(hp, outp, n)
            if taps is not None and index in taps:
                taps[index] = h.clone()
        return native_norm.rms_norm_bf16(h, self.final_norm.weight, self.final_norm.eps,
                                         "llama" if kind == 0 else "gemma")


def _norm_ok(norm, norm_cls) -> bool:
    return (type(norm) is norm_cls and norm.weight.dtype == torch.bfloat16
            and norm.weight.is_contiguous())


__all__ = ["NativeDecoder"]
