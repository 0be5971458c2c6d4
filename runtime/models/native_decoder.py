"""Decode steps of an FP8 artifact on CPU as straight-line C calls, generated from the
model's own layer definition.

    decoder = NativeDecoder.build(model, kv_cache, decode_impl)  # None where it cannot run
    hidden = decoder.forward(input_ids, positions, meta)  # [T, hidden] bf16, or None
    print(decoder.source)  # the step's C calls, one per line

A decode step of a few sequences spends more time in Python and torch's per-op dispatch
(~20 ops per layer, each with its dispatch cost) than in its kernels; routing each op
through a registered torch op costs more still (docs/kernels.md, measured). So this path
runs the layers as C calls, and takes their structure from the modules rather than
restating it: each decoder layer's `forward` is traced with torch.fx at build (leaf
modules kept whole) and lowered node by node through `LOWERINGS`:

    RMSNorm / GemmaRMSNorm   csrc/rms_norm_cpu.c                     (`NORM_KINDS`)
    SelfAttention            fp8_linear(qkv) [q/k norms] rope, store K/V, paged attention,
                             bf16 round, fp8_linear(o)   csrc/fp8_gemv_cpu.c, rotary_cpu.c,
                             kv_store_cpu.c, paged_attention_cpu.c, elementwise_cpu.c
    MLAAttention             latent attention (DeepSeek-V3, converted Llama-family models) in
                             its absorbed form: q and kv_a linears, the latent (normed c_kv,
                             RoPE key) stored once, per-head bf16 W_UK into the query,
                             multi-query paged attention over the latent, per-head W_UV,
                             o linear (`_MlaAttentionOp`)
    GatedMLP                 fp8_linear(gate|up), act(gate) * up, fp8_linear(down) (`ACT_KINDS`)
    MoE                      the module itself, in torch (`_ModuleOp`): the step program stops
                             before it, the module maps its input buffer to its output
                             buffer, and the program goes on (routing picks rows per expert
                             at run time, which straight-line calls cannot)
    a + b                    in place into the operand no later node reads

so Llama's pre-norm block, Gemma 3's four-norm sandwich and DeepSeek's dense and
mixture-of-experts blocks come out of their forwards,
and a layer written another way lowers the same way or is refused (the modules run). The
lowered layers become one step program per model (kernels/native_step_program.py), every
weight pointer and scale a literal, the step's sizes and scratch pointers named values: a
step is then one ctypes call that makes the ~14 C calls per layer back to back (one
ctypes call each cost SmolLM2 ~1 ms per decode step). The backbone's loop (embed, layers in
order with their RoPE kind, final norm) is LlamaModel.forward's, checked by identity. The
result equals the module path's up to the ops that are not bit-identical there either:
the activation's exp/tanh (elementwise_cpu.c), the norms' sum order and, in latent
attention, the per-head up-projections' sum order (bf16_gemv_cpu.c against torch's bmm).

`build` returns None unless every layer lowers (each linear a packed Fp8Linear with its
E4M3 bytes, or for W8A8 int8 its int8 bands (csrc/int8_gemm_cpu.c), and a bf16 bias or
none, or a PackedLinear with its small-batch bf16 rows; no soft-caps, bf16 norm weights; latent attention with one RoPE key if its pairs interleave),
the K/V pools are FP8 or bf16 and every C library builds.
`forward` returns None (the caller runs the modules) for steps of more than `max_rows`
tokens (runtime/layers/packing.c_kernel_rows: every step when the engine is
batch-invariant, its default, so prefill and decode rows take the same per-row sums
whatever the batch; else the rows one pass over the weights serves, MAX_ROWS with AMX or
AVX512-BF16 and wherever a layer has bf16 linears, any number with AVX2) or with padding
slots.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

from ...kernels import native_attention as attention_lib
from ...kernels import native_bf16_gemv, native_kv_store, native_norm
from ...kernels.kv_store import as_fp8_view, check_scale, is_fp8_pool
from ...kernels.native_step_program import Call, StepFailed, StepProgram, V
from ...kernels.paged_attention import kernel_scales
from ..layers.fp8_linear import Fp8Linear
from ..layers.mla_attention import MLAAttention
from ..layers.mlp import GatedMLP
from ..layers.moe import MoE
from ..layers.norm import GemmaRMSNorm, RMSNorm
from ..layers.packing import PackedLinear, c_kernel_rows, runs_invariant
from ..layers.rotary import apply_rotary, apply_rotary_interleaved
from ..layers.self_attention import SelfAttention
from .llama import LlamaModel

NORM_KINDS = {RMSNorm: "llama", GemmaRMSNorm: "gemma"}  # norm class -> native_norm kind
ACT_KINDS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}  # C act_mul kind



@dataclass(frozen=True)
class _Dims:
    hidden: int
    inter: int
    hq: int
    hkv: int
    d: int

    @property
    def qkv_width(self) -> int:
        return (self.hq + 2 * self.hkv) * self.d


# Each op emits its C calls (kernels/native_step_program.Call), its pointers and scales as
# literals. The step's values the calls read (V): t, threads (the step's rows and threads);
# the buffers vN; the scratch pointers x, qkv, qn, kn, q, k, att, gu; cos_KIND/sin_KIND
# (RoPE tables); qsl, lens, nseq, block_size, and tables_G/slots_G/stride_G per KV group G
# (NativeDecoder.forward passes them all).

@dataclass(frozen=True)
class _Linear:
    weight: int  # E4M3 (or int8) bytes in the kernel's tile layout (PackedFp8Weight)
    in_features: int
    out_features: int
    input_scale: float | None  # None: weight-only (W8A16), the input is not quantized
    out_scale: int  # fp32 [out] or [1]
    scale_len: int
    bias: int  # bf16 [out], added to the bf16 output as Fp8Linear does (Qwen 2); 0: none
    codes: str = "e4m3"  # "int8": int8 weight codes (weight-only)
    int8_inputs: bool = False  # W8A8 int8: inputs quantized per row (csrc/int8_gemm_cpu.c)

    @classmethod
    def of(cls, m: Fp8Linear) -> "_Linear | None":
        bias = m.bias
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return None
        if m.int8_inputs:
            if m.c_int8_weight is None:
                return None
            return cls(m.c_int8_weight.data.data_ptr(), m.in_features, m.out_features, None,
                       m.out_scale.data_ptr(), m.out_scale.numel(),
                       0 if bias is None else bias.data_ptr(), "int8", int8_inputs=True)
        if m.c_weight is None:
            return None
        return cls(m.c_weight.data.data_ptr(), m.in_features, m.out_features,
                   None if m.weight_only else m.c_input_scale, m.out_scale.data_ptr(),
                   m.out_scale.numel(), 0 if bias is None else bias.data_ptr(),
                   m.c_weight.codes)

    def emit(self, src: str, dst: str) -> list[Call]:  # [T, in] -> [T, out] bf16
        k, n = self.in_features, self.out_features
        args = dict(x=V(src), m=V("t"), k=k, x_stride=k, packed=self.weight, n=n,
                    scale=self.out_scale, scale_len=self.scale_len, out=V(dst), out_stride=n,
                    num_threads=V("threads"))
        if self.int8_inputs:
            calls = [Call.named("int8_gemm", fails="linear", **args)]
        elif self.input_scale is None:
            kernel = "int8_gemv_wonly" if self.codes == "int8" else "fp8_gemv_wonly"
            calls = [Call.named(kernel, fails="linear", **args)]
        else:
            calls = [Call.named("fp8_gemv", fails="linear", input_scale=self.input_scale,
                                **args)]
        if self.bias:
            calls.append(Call.named("add_rows", x=V(dst), b=self.bias, rows=V("t"), n=n))
        return calls


@dataclass(frozen=True)
class _Bf16Linear:
    """A bf16 linear inside a layer (a part a quality budget kept in bf16): the small-batch
    C kernel on its bf16 rows (csrc/bf16_gemv_cpu.c), as PackedLinear runs it for as many
    rows."""
    weight: int  # bf16 in the kernel's tile layout (native_bf16_gemv.PackedBf16Weight)
    in_features: int
    out_features: int
    bias: int  # fp32 [out], added before the output's bf16 rounding; 0: none

    @classmethod
    def of(cls, m: PackedLinear) -> "_Bf16Linear | None":
        if m.rows is None:
            return None
        return cls(m.rows.data.data_ptr(), m.in_features, m.out_features,
                   0 if m.bias_f32 is None else m.bias_f32.data_ptr())

    def emit(self, src: str, dst: str) -> list[Call]:  # [T, in] -> [T, out] bf16
        k, n = self.in_features, self.out_features
        return [Call.named("bf16_gemv", fails="linear", x=V(src), m=V("t"), k=k, x_stride=k,
                           packed=self.weight, n=n, bias=self.bias or None, out=V(dst),
                           out_stride=n, num_threads=V("threads"))]


# linear module class -> its C op, or None (not lowerable)
LINEAR_LOWERINGS: dict[type, Callable] = {Fp8Linear: _Linear.of, PackedLinear: _Bf16Linear.of}


def _linear(m) -> "_Linear | _Bf16Linear | None":
    lower = LINEAR_LOWERINGS.get(type(m))
    return None if lower is None else lower(m)


@dataclass(frozen=True)
class _NormOp:
    weight: int  # bf16 [dim]
    eps: float
    kind: int  # native_norm.NORM_KINDS value

    @classmethod
    def of(cls, m) -> "_NormOp | None":
        kind = NORM_KINDS.get(type(m))
        if kind is None or m.weight.dtype != torch.bfloat16 or not m.weight.is_contiguous():
            return None
        return cls(m.weight.data_ptr(), float(m.eps), native_norm.NORM_KINDS[kind])

    def call(self, src: str, rows: V, dim: int, dst: str, stride: int | None = None) -> Call:
        # [rows, dim] (source rows `stride` apart, default dim) -> [rows, dim] contiguous
        return Call.named("rms_norm", x=V(src), rows=rows, stride=stride or dim, dim=dim,
                          w=self.weight, eps=self.eps, kind=self.kind, out=V(dst),
                          num_threads=V("threads"))

    def emit(self, src: str, dst: str, dims: _Dims) -> list[Call]:  # [T, hidden] -> same
        return [self.call(src, V("t"), dims.hidden, dst)]


@dataclass(frozen=True)
class _AttentionOp:
    qkv: "_Linear | _Bf16Linear"
    o: "_Linear | _Bf16Linear"
    q_norm: _NormOp | None  # per head, before RoPE (Gemma 3, Qwen 3)
    k_norm: _NormOp | None
    rope: str  # "global" | "local": the step's RoPE table the layer uses
    k_pool: int
    v_pool: int
    store_kind: int  # native_kv_store.POOL_KINDS value of the pools' dtype
    pool_kind: int  # native_attention.POOL_KINDS value of their FP8 view
    store_scales: tuple[int, int, int]  # k_scale, v_scale fp32 [1|Hkv] (FP8), their length
    qk_scale: int  # fp32 [Hkv]: k_scale * softmax scale (FP8) or the softmax scale
    v_scale: int  # fp32 [Hkv]
    window: int  # 0: full causal
    group: int  # the KV group whose block tables and slots the layer uses
    keep: tuple = field(default=(), compare=False, repr=False)  # tensors pointed into

    @property
    def linears(self) -> tuple:
        return self.qkv, self.o

    def emit(self, src: str, dst: str, dims: _Dims) -> list[Call]:  # [T, hidden] -> same
        hq, hkv, d, w = dims.hq, dims.hkv, dims.d, dims.qkv_width
        calls = self.qkv.emit(src, "qkv")
        q_src, k_src = V("qkv"), V("qkv", add=2 * hq * d)  # byte offsets into bf16 rows
        if self.q_norm is not None:  # per head: two calls over all t * (hq + 2 hkv) head rows
            # (one per weight) instead of two per token; RoPE reads q of one, k of the other
            rows = V("t", w // d)
            calls += [self.q_norm.call("qkv", rows, d, "qn"),
                      self.k_norm.call("qkv", rows, d, "kn")]
            q_src, k_src = V("qn"), V("kn", add=2 * hq * d)
        g, (ks, vs, n) = self.group, self.store_scales
        cos, sin = V(f"cos_{self.rope}"), V(f"sin_{self.rope}")
        t, tables = V("t"), V(f"tables_{g}")
        return calls + [
            Call.named("rotary", x=q_src, tokens=t, token_stride=w, heads=hq, dim=d, cos=cos,
                       sin=sin, out=V("q")),
            Call.named("rotary", x=k_src, tokens=t, token_stride=w, heads=hkv, dim=d, cos=cos,
                       sin=sin, out=V("k")),
            Call.named("store_kv", k=V("k"), k_stride=hkv * d,
                       v=V("qkv", add=2 * (hq + hkv) * d), v_stride=w, tokens=t, hkv=hkv, d=d,
                       slots=V(f"slots_{g}"), kind=self.store_kind, k_scale=ks or None,
                       v_scale=vs or None, scale_len=n, k_pool=self.k_pool,
                       v_pool=self.v_pool),
            Call.named("attention", fails="attention", q=V("q"), q_kind=1,
                       qk_scale=self.qk_scale, hq=hq, d=d, k_pool=self.k_pool,
                       v_pool=self.v_pool, kind=self.pool_kind, bs=V("block_size"), hkv=hkv,
                       tables=tables, table_stride=V(f"stride_{g}"), q_start=V("qsl"),
                       seq_lens=V("lens"), skip=None, num_seqs=V("nseq"), window=self.window,
                       softcap=0.0, v_scale=self.v_scale, out=V("att"),
                       num_threads=V("threads"), dv=d),
            # [T, hq * d] bf16, as the module path rounds it
            Call.named("round", x=V("att"), n=V("t", hq * d), out=V("x")),
        ] + self.o.emit("x", dst)


@dataclass(frozen=True)
class _MlaAttentionOp:
    """MLAAttention in its absorbed form (runtime/layers/mla_attention.py
    `_absorbed_attention`, the form the engine's caching backends run): multi-query
    attention of H heads over one cached vector per token, [c_kv ; k_pe] (R + P values).

        q = q_proj(x) or q_b(norm(q_a(x)))         [T, H, N + P]
        kv = kv_a(x)                               [T, R + P]
        latent = [norm(kv[:, :R]) ; rope(kv[:, R:])]  -> stored (one pool, K = V)
        qf[:, h] = [q_nope,h W_UK,h ; rope(q_pe,h)] [T, H, R + P]   (bf16 linear per head)
        ctx = bf16(attention(qf, latent))[..., :R]  [T, H, R]
        x[:, h] = ctx[:, h] W_UV,h                  [T, H, V]       (bf16 linear per head)
        out = o_proj(x)

    The RoPE parts are gathered into contiguous rows, rotated, and put back with
    copy_rows; the per-head up-projections are the bf16 linear kernel on strided rows, all
    heads of one in one call (bf16_gemv_heads: the heads spread over the threads).
    RoPE on interleaved pairs (DeepSeek's checkpoints) is RoPE on halves of the rows with
    their pairs split (evens, then odds: the layout the modules return), so the gathers
    split them (deinterleave_rows) and the same rotary kernel follows."""
    q: tuple  # (q_proj,) or (q_a_proj, q_a_layernorm, q_b_proj): linears and a _NormOp
    kv_a: "_Linear | _Bf16Linear"
    kv_norm: _NormOp
    o: "_Linear | _Bf16Linear"
    w_uk: int  # int64 [H]: per head the address of packed bf16 [R, N] (W_UK,h transposed)
    w_uv: int  # int64 [H]: per head the address of packed bf16 [V, R] (W_UV,h)
    heads: int
    nope: int  # N
    rope_dim: int  # P
    v_dim: int  # V
    rank: int  # R
    rope_heads: int  # the RoPE key as this many keys of one table
    interleave: bool  # RoPE on interleaved pairs (then rope_heads is 1)
    q_lora: int  # q_a's width, 0 without query compression
    rope: str
    pool: int  # the latent pool, read as K and V
    store_kind: int
    pool_kind: int
    store_scale: tuple[int, int]  # k_scale fp32 (FP8, 0 otherwise), its length
    qk_scale: int
    v_scale: int
    group: int
    keep: tuple = field(default=(), compare=False, repr=False)

    @property
    def linears(self) -> tuple:  # the per-head up-projections are not among them
        return tuple(x for x in self.q if not isinstance(x, _NormOp)) + (self.kv_a, self.o)

    def scratch(self) -> dict[str, tuple[int, torch.dtype]]:
        """Buffers the calls use: name -> (columns per token, dtype)."""
        h, n, p, r = self.heads, self.nope, self.rope_dim, self.rank
        cw, bf = r + p, torch.bfloat16
        out = {"mla_q": (h * (n + p), bf), "mla_kv": (cw, bf), "mla_cn": (r, bf),
               "mla_kp": (p, bf), "mla_lat": (cw, bf), "mla_qpe": (h * p, bf),
               "mla_qper": (h * p, bf), "mla_qf": (h * cw, bf),
               "mla_att": (h * cw, torch.float32), "mla_ctx": (h * cw, bf),
               "mla_x": (h * self.v_dim, bf)}
        if self.interleave:
            out["mla_kpd"] = (p, bf)
        if self.q_lora:
            out.update(mla_qa=(self.q_lora, bf), mla_qan=(self.q_lora, bf))
        return out

    def emit(self, src: str, dst: str, dims: _Dims) -> list[Call]:  # [T, hidden] -> same
        h, n, p, r, vd = self.heads, self.nope, self.rope_dim, self.rank, self.v_dim
        cw, qw, rd = r + p, h * (n + p), p // self.rope_heads
        t, cos, sin = V("t"), V(f"cos_{self.rope}"), V(f"sin_{self.rope}")
        g, (ks, n_scales) = self.group, self.store_scale
        if self.q_lora:
            q_a, q_norm, q_b = self.q
            calls = (q_a.emit(src, "mla_qa") + [q_norm.call("mla_qa", t, self.q_lora, "mla_qan")]
                     + q_b.emit("mla_qan", "mla_q"))
        else:
            calls = self.q[0].emit(src, "mla_q")
        gather = "deinterleave_rows" if self.interleave else "copy_rows"
        calls += self.kv_a.emit(src, "mla_kv") + [
            # the latent: normed c_kv, then the rotated RoPE key
            self.kv_norm.call("mla_kv", t, r, "mla_cn", stride=cw),
            Call.named("copy_rows", src=V("mla_cn"), rows=t, src_stride=r, width=r,
                       dst=V("mla_lat"), dst_stride=cw),
        ]
        k_pe = (V("mla_kv", add=2 * r), cw)  # the RoPE key's rows as the rotary kernel reads
        if self.interleave:  # its pairs split first
            calls.append(Call.named(gather, src=k_pe[0], rows=t, src_stride=cw, width=p,
                                    dst=V("mla_kpd"), dst_stride=p))
            k_pe = (V("mla_kpd"), p)
        calls += [
            Call.named("rotary", x=k_pe[0], tokens=t, token_stride=k_pe[1],
                       heads=self.rope_heads, dim=rd, cos=cos, sin=sin, out=V("mla_kp")),
            Call.named("copy_rows", src=V("mla_kp"), rows=t, src_stride=p, width=p,
                       dst=V("mla_lat", add=2 * r), dst_stride=cw),
            Call.named("store_kv", k=V("mla_lat"), k_stride=cw, v=V("mla_lat"), v_stride=cw,
                       tokens=t, hkv=1, d=cw, slots=V(f"slots_{g}"), kind=self.store_kind,
                       k_scale=ks or None, v_scale=ks or None, scale_len=n_scales,
                       k_pool=self.pool, v_pool=self.pool),
            # the queries' RoPE parts: gathered [T * H, P], rotated, placed after each
            # head's latent query
            Call.named(gather, src=V("mla_q", add=2 * n), rows=V("t", h), src_stride=n + p,
                       width=p, dst=V("mla_qpe"), dst_stride=p),
            Call.named("rotary", x=V("mla_qpe"), tokens=t, token_stride=h * p,
                       heads=h * self.rope_heads, dim=rd, cos=cos, sin=sin, out=V("mla_qper")),
            Call.named("copy_rows", src=V("mla_qper"), rows=V("t", h), src_stride=p, width=p,
                       dst=V("mla_qf", add=2 * r), dst_stride=cw),
        ]
        calls += [Call.named("bf16_gemv_heads", fails="linear", x=V("mla_q"), m=t, k=n,
                             x_stride=qw, x_head=n + p, packed=self.w_uk, n=r, out=V("mla_qf"),
                             out_stride=h * cw, out_head=cw, heads=h, num_threads=V("threads"))]
        calls += [
            # values: the latent's first R columns (dv), not the RoPE key
            Call.named("attention", fails="attention", q=V("mla_qf"), q_kind=1,
                       qk_scale=self.qk_scale, hq=h, d=cw, k_pool=self.pool, v_pool=self.pool,
                       kind=self.pool_kind, bs=V("block_size"), hkv=1, tables=V(f"tables_{g}"),
                       table_stride=V(f"stride_{g}"), q_start=V("qsl"), seq_lens=V("lens"),
                       skip=None, num_seqs=V("nseq"), window=0, softcap=0.0,
                       v_scale=self.v_scale, out=V("mla_att"), num_threads=V("threads"), dv=r),
            # as the modules round
            Call.named("round", x=V("mla_att"), n=V("t", h * cw), out=V("mla_ctx")),
        ]
        calls += [Call.named("bf16_gemv_heads", fails="linear", x=V("mla_ctx"), m=t, k=r,
                             x_stride=h * cw, x_head=cw, packed=self.w_uv, n=vd, out=V("mla_x"),
                             out_stride=h * vd, out_head=vd, heads=h, num_threads=V("threads"))]
        return calls + self.o.emit("mla_x", dst)


@dataclass(frozen=True)
class _MlpOp:
    gate_up: "_Linear | _Bf16Linear"
    down: "_Linear | _Bf16Linear"
    act: int  # ACT_KINDS value

    @property
    def linears(self) -> tuple:
        return self.gate_up, self.down

    def emit(self, src: str, dst: str, dims: _Dims) -> list[Call]:  # [T, hidden] -> same
        return (self.gate_up.emit(src, "gu")
                + [Call.named("act_mul", gu=V("gu"), rows=V("t"), n=dims.inter, act=self.act,
                              out=V("x"), num_threads=V("threads"))]
                + self.down.emit("x", dst))


class _AddOp:
    @staticmethod
    def emit(src: str, dst: str, dims: _Dims) -> list[Call]:  # dst = bf16(dst + src)
        return [Call.named("add", x=V(dst), y=V(src), n=V("t", dims.hidden))]


# ---------------------------------------------------------------- lowering leaf modules
def _lower_norm(m, layer, kv_cache):
    return _NormOp.of(m)


@dataclass(frozen=True)
class _PoolArgs:
    """A layer's K/V pools and scales as the C store and attention take them."""
    k_pool: int
    v_pool: int
    store_kind: int  # native_kv_store.POOL_KINDS value of the pools' dtype
    pool_kind: int  # native_attention.POOL_KINDS value of their FP8 view
    store_scales: tuple[int, int, int]  # k_scale, v_scale fp32 [1|Hkv] (FP8), their length
    qk_scale: int  # fp32 [Hkv]
    v_scale: int  # fp32 [Hkv]
    group: int
    keep: tuple  # the tensors pointed into

    @classmethod
    def of(cls, spec, kv_cache) -> "_PoolArgs | None":
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
        return cls(k_pool.data_ptr(), v_pool.data_ptr(),
                   native_kv_store.POOL_KINDS[k_pool.dtype],
                   attention_lib.POOL_KINDS[as_fp8_view(k_pool).dtype], store_scales,
                   qk.data_ptr(), v_attn.data_ptr(), kv_cache.group_of(spec.layer_idx),
                   (qk, v_attn, ks, vs))


def _lower_attention(m: SelfAttention, layer, kv_cache) -> _AttentionOp | None:
    qkv, o = _linear(m.qkv_proj), _linear(m.o_proj)
    spec = m.spec
    if qkv is None or o is None or spec.logit_softcap is not None:
        return None
    q_norm = k_norm = None
    if m.q_norm is not None:
        q_norm, k_norm = _NormOp.of(m.q_norm), _NormOp.of(m.k_norm)
        if q_norm is None or k_norm is None:
            return None
    pools = _PoolArgs.of(spec, kv_cache)
    if pools is None:
        return None
    return _AttentionOp(qkv, o, q_norm, k_norm, layer.rope_kind, pools.k_pool, pools.v_pool,
                        pools.store_kind, pools.pool_kind, pools.store_scales, pools.qk_scale,
                        pools.v_scale, spec.sliding_window or 0, pools.group, keep=pools.keep)


def _lower_mla_attention(m: MLAAttention, layer, kv_cache) -> _MlaAttentionOp | None:
    interleave = m.rotate is apply_rotary_interleaved
    if m.rotate not in (apply_rotary, apply_rotary_interleaved) or m.spec.logit_softcap \
            is not None or (interleave and m.rope_heads != 1):
        return None  # interleaved pairs over several RoPE keys: no model has them
    if hasattr(m, "q_proj"):
        q = (_linear(m.q_proj),)
        q_lora = 0
    else:
        q = (_linear(m.q_a_proj), _NormOp.of(m.q_a_layernorm), _linear(m.q_b_proj))
        q_lora = m.q_a_proj.out_features
    kv_a, kv_norm = _linear(m.kv_a_proj_with_mqa), _NormOp.of(m.kv_a_layernorm)
    o = _linear(m.o_proj)
    pools = _PoolArgs.of(m.spec, kv_cache)
    if any(x is None for x in (*q, kv_a, kv_norm, o, pools)) or pools.k_pool != pools.v_pool:
        return None
    w_uk, w_uv_t = m.absorbed()  # [H, N, R], [H, R, V] in the model dtype
    if w_uk.dtype != torch.bfloat16:
        return None
    uk = [native_bf16_gemv.pack_bf16_weight(w.t().contiguous()) for w in w_uk]  # [R, N]
    uv = [native_bf16_gemv.pack_bf16_weight(w.t().contiguous()) for w in w_uv_t]  # [V, R]
    # int64 [H] each: the heads' packed weights' addresses, as bf16_gemv_heads reads them
    uk_at, uv_at = (torch.tensor([w.data.data_ptr() for w in ws], dtype=torch.int64)
                    for ws in (uk, uv))
    return _MlaAttentionOp(
        q, kv_a, kv_norm, o, uk_at.data_ptr(), uv_at.data_ptr(), m.num_heads, m.nope,
        m.rope_dim, m.v_dim, m.rank, m.rope_heads, interleave, q_lora, layer.rope_kind,
        pools.k_pool, pools.store_kind, pools.pool_kind, pools.store_scales[::2],
        pools.qk_scale, pools.v_scale, pools.group,
        keep=pools.keep + tuple(uk) + tuple(uv) + (uk_at, uv_at))


def _lower_mlp(m: GatedMLP, layer, kv_cache) -> _MlpOp | None:
    gate_up, down = _linear(m.gate_up_proj), _linear(m.down_proj)
    if gate_up is None or down is None or m.act not in ACT_KINDS:
        return None
    return _MlpOp(gate_up, down, ACT_KINDS[m.act])


@dataclass(frozen=True)
class _ModuleOp:
    """A leaf module run by torch between two stretches of the step program: no C calls
    of its own; NativeDecoder.forward stops the program where it stands."""
    module: torch.nn.Module
    name: str  # for the listing

    @staticmethod
    def emit(src: str, dst: str, dims: _Dims) -> list[Call]:
        return []

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:  # [T, hidden] bf16 -> out
        out.copy_(self.module(x))


def _lower_module(m: torch.nn.Module, layer, kv_cache) -> _ModuleOp:
    name = next((n for n, sub in layer.named_modules() if sub is m), type(m).__name__)
    return _ModuleOp(m, name)


# leaf module class -> (module, its decoder layer, kv_cache) -> an op, or None (not lowerable)
LOWERINGS: dict[type, Callable] = {
    RMSNorm: _lower_norm,
    GemmaRMSNorm: _lower_norm,
    SelfAttention: _lower_attention,
    MLAAttention: _lower_mla_attention,
    GatedMLP: _lower_mlp,
    MoE: _lower_module,
}
ATTENTION_OPS = (_AttentionOp, _MlaAttentionOp)  # ops that take (x, rope, meta, attn)


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return type(m) in LOWERINGS or super().is_leaf_module(m, qualname)


def _graph(layer: torch.nn.Module) -> fx.Graph | None:
    """The layer's forward as a graph over its leaf modules. Traced per layer, not per
    class: a forward may branch on the layer's own attributes."""
    try:
        return _LeafTracer().trace(layer)
    except Exception:  # data-dependent control flow etc.: not lowerable, the modules run
        return None


# a layer program: (op, source buffer, destination buffer); buffer 0 is the residual stream
Program = list[tuple[object, int, int]]


def lower_layer(layer: torch.nn.Module, kv_cache) -> tuple[Program, int] | None:
    """The layer's forward as C ops over numbered [T, hidden] buffers, and how many buffers
    it uses; None if some node has no lowering. The forward must take (hidden, rope, meta,
    attn) and return the residual stream."""
    graph = _graph(layer)
    if graph is None:
        return None
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 4:
        return None
    env = {inputs[0]: 0}  # node -> the buffer holding its value
    program: Program = []
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            if env.get(node.args[0]) != 0:
                return None  # the layer must return the residual stream it was given
            return program, max(env.values()) + 1
        if node.kwargs or not node.args or node.args[0] not in env:
            return None
        if node.op == "call_module":
            module = layer.get_submodule(node.target)
            extra = tuple(node.args[1:])
            if extra not in ((), tuple(inputs[1:])):  # attention takes (x, rope, meta, attn)
                return None
            lower = LOWERINGS.get(type(module))  # a leaf torch module has none
            op = None if lower is None else lower(module, layer, kv_cache)
            if op is None or (extra != ()) != isinstance(op, ATTENTION_OPS):
                return None
            env[node] = max(env.values()) + 1
            program.append((op, env[node.args[0]], env[node]))
        elif node.op == "call_function" and node.target in (operator.add, torch.add):
            if len(node.args) != 2 or node.args[1] not in env:
                return None
            a, b = node.args
            # in place into an operand no later node reads (sums are exact either way round)
            into = next((x for x in (a, b) if all(order[u] <= order[node] for u in x.users)),
                        None)
            if into is None:
                return None
            program.append((_AddOp, env[b if into is a else a], env[into]))
            env[node] = env[into]
        else:
            return None
    return None


# a module the program stops for: (the calls before it, the op, source, destination buffer)
Stop = tuple[int, _ModuleOp, int, int]


def _calls(programs: list[Program], dims: _Dims
           ) -> tuple[list[Call], list[int], list[Stop]]:
    """Every layer's C calls in order, after which call each layer ends, and the modules
    torch runs between them."""
    calls, ends, stops = [], [], []
    for program in programs:
        for op, src, dst in program:
            if isinstance(op, _ModuleOp):
                stops.append((len(calls), op, src, dst))
            calls += op.emit(f"v{src}", f"v{dst}", dims)
        ends.append(len(calls))
    return calls, ends, stops


class NativeDecoder:
    def __init__(self, model, kv_cache, programs: list[Program], num_buffers: int,
                 batch_invariant: bool = True):
        cfg = model.config
        self.model, self.kv_cache, self.programs = model, kv_cache, programs
        self.num_buffers = num_buffers
        self.dims = _Dims(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim)
        self.rope_kinds = tuple(sorted({op.rope for p in programs for op, _, _ in p
                                        if isinstance(op, ATTENTION_OPS)}))
        self.scratch: dict[str, tuple[int, torch.dtype]] = {}  # ops' own buffers: the widest
        for op in (op for p in programs for op, _, _ in p if hasattr(op, "scratch")):
            for name, (cols, dtype) in op.scratch().items():
                cols = max(cols, self.scratch.get(name, (0, dtype))[0])
                self.scratch[name] = (cols, dtype)
        self.final_norm = model.backbone.norm
        calls, self.layer_ends, self.stops = _calls(programs, self.dims)
        # tokens a step may have to run here (latent attention's small per-head bf16
        # up-projections run at any rows)
        bf16 = any(isinstance(x, _Bf16Linear) for p in programs for op, _, _ in p
                   for x in getattr(op, "linears", ()))
        invariant = runs_invariant(model, batch_invariant)
        self.max_rows = min(c_kernel_rows(invariant),
                            c_kernel_rows(invariant, bf16=True) if bf16 else sys.maxsize)
        self.program = StepProgram.build(calls)  # one C call runs them all

    @property
    def source(self) -> str:
        """The step's C calls, one per line, a comment before each layer."""
        stops: dict[int, list[str]] = {}
        for i, op, src, dst in self.stops:
            stops.setdefault(i, []).append(f"torch: {op.name}(v{src}) -> v{dst}")
        lines, start = [], 0
        for index, end in enumerate(self.layer_ends):
            lines.append(f"# layer {index}")
            for i, call in enumerate(self.program.calls[start:end], start):
                lines += stops.get(i, []) + [str(call)]
            start = end
        return "\n".join(lines + stops.get(start, [])) + "\n"

    @classmethod
    def build(cls, model, kv_cache, decode_impl: str | None,
              batch_invariant: bool = True) -> "NativeDecoder | None":
        if decode_impl not in (None, "native"):
            return None
        backbone = getattr(model, "backbone", None)
        if (getattr(model, "config", None) is None or not isinstance(backbone, LlamaModel)
                or type(backbone).forward is not LlamaModel.forward):
            return None  # the backbone loop below is LlamaModel.forward's
        if _NormOp.of(backbone.norm) is None:
            return None
        programs, num_buffers = [], 1
        for layer in backbone.layers:
            lowered = lower_layer(layer, kv_cache)
            if lowered is None:
                return None
            programs.append(lowered[0])
            num_buffers = max(num_buffers, lowered[1])
        decoder = cls(model, kv_cache, programs, num_buffers, batch_invariant)
        return decoder if decoder.program is not None else None  # a library did not build

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
        dims, bf = self.dims, torch.bfloat16
        keep = {  # every tensor the step's pointers point into, alive until it returns
            "x": torch.empty(t, max(dims.hq * dims.d, dims.inter), dtype=bf),  # o/down input
            "qkv": torch.empty(t, dims.qkv_width, dtype=bf),
            "qn": torch.empty(t, dims.qkv_width, dtype=bf),  # every head row under q_norm
            "kn": torch.empty(t, dims.qkv_width, dtype=bf),  # ... and under k_norm
            "q": torch.empty(t, dims.hq, dims.d, dtype=bf),
            "k": torch.empty(t, dims.hkv, dims.d, dtype=bf),
            "att": torch.empty(t, dims.hq * dims.d, dtype=torch.float32),
            "gu": torch.empty(t, 2 * dims.inter, dtype=bf),
            "qsl": plans[0].query_start_loc.contiguous(),
            "lens": plans[0].seq_lens.contiguous()}
        keep.update({name: torch.empty(t, cols, dtype=dtype)
                     for name, (cols, dtype) in self.scratch.items()})
        for kind in self.rope_kinds:
            keep[f"cos_{kind}"], keep[f"sin_{kind}"] = (a.contiguous() for a in ropes[kind])
        for g, plan in enumerate(plans):  # per KV group: block tables [B, max] int64, slots [T]
            keep[f"tables_{g}"] = plan.block_tables.contiguous()
            keep[f"slots_{g}"] = plan.store_slots.contiguous()
        values = {name: a.data_ptr() for name, a in keep.items()}
        values.update({f"stride_{g}": p.block_tables.shape[1] for g, p in enumerate(plans)})
        buffers = [h] + [torch.empty(t, dims.hidden, dtype=bf)
                         for _ in range(self.num_buffers - 1)]
        values.update({f"v{i}": v.data_ptr() for i, v in enumerate(buffers)})
        values.update(t=t, threads=torch.get_num_threads(), nseq=keep["lens"].shape[0],
                      block_size=pools.shape[1])
        # where the program stops: before a torch module, after a tapped layer (a copy of
        # the residual stream, buffer 0, which no module writes), at the end
        taps = taps or {}
        pauses = sorted({i for i, *_ in self.stops} | {self.layer_ends[k] for k in taps}
                        | {len(self.program.calls)})
        start = 0
        try:
            for at in pauses:
                if at > start:
                    self.program.run(values, start, at)
                    start = at
                for _, op, src, dst in (s for s in self.stops if s[0] == at):
                    op.run(buffers[src], buffers[dst])
                for k in (k for k in taps if self.layer_ends[k] == at):
                    taps[k] = h.clone()
        except StepFailed as e:
            raise MemoryError(str(e)) from None
        norm = self.final_norm
        return native_norm.rms_norm_bf16(h, norm.weight, norm.eps, NORM_KINDS[type(norm)])


__all__ = ["NativeDecoder", "lower_layer", "LOWERINGS"]
