"""FP8 remedies that act on where the error is made: Hadamard rotations and the first token.

    python -m qserve.runtime.benchmark.fp8_remedies [--source smollm2-135m] [--threads 1]
        [--tokens 4096] [--calib-rows 32] [--row-len 512] [--weights gptq|rtn] [--seed 0]

Prints a markdown table: variant -> token perplexity change vs the source -> mean
next-token KL(source || variant) x 1e-3 (full vocabulary), on the first `--tokens`
predicted tokens of the held-out text (evals/golden/heldout_text.jsonl; each document cut
into rows of `--row-len` tokens, each row a sequence from position 0).

Everything is simulated in process in fp32 (the source's bf16 weights upcast exactly):
- FP8 weights: E4M3 with one minmax scale per output channel, rounded by GPTQ (block 128,
  dampening 0.01, as the default recipe; Hessians from one pass of the unquantized model,
  not block by block) or to nearest (`--weights rtn`);
- FP8 activations: one static per-tensor scale per linear input (minmax);
- FP8 KV: K (after RoPE) and V quantize-dequantized with one k and one v scale per layer;
the values the runtime's Fp8Linear and Fp8KVAttention compute with. Static scales are calibrated on
`--calib-rows` x 512 tokens of the bundled calibration corpus (never the held-out text),
on the weight-quantized model where weights are FP8, separately for every model variant
(a rotation changes the activations). The LM head stays unquantized (the default recipe's
ignore list).

Remedies:
- KV Hadamard: K rotated per head after RoPE by the orthonormal Sylvester Hadamard H of
  head_dim (64), q rotated alike so q.k is unchanged (an online rotation); V rotated by
  folding H into v_proj's output rows and o_proj's input columns (offline).
- Residual Hadamard (QuaRot-style): RMSNorm weights folded into the following linears,
  the residual stream rotated by Q = diag(random signs) H / sqrt(576) (SmolLM2's hidden
  size), H the Kronecker product H12 x H12 x H4 (Paley's order-12 matrix and Sylvester's:
  a full Hadamard matrix of order 576, not block-diagonal), folded into the embedding,
  o_proj / down_proj outputs, q/k/v/gate/up inputs and the (untied) LM head; optionally
  an online Hadamard of order 1536 (H12 x H128) on down_proj's input, its inverse folded
  into down_proj's weight.
- First token: static scales calibrated without position 0 of each row (its massive
  activations set minmax), and optionally position 0's K/V and/or linear inputs left
  unquantized at run time.
Each transform is checked to leave the fp32 model's logits unchanged (asserts), as is
the per-head K rotation. About 20 minutes on one thread for the default sizes.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...calib.hessian import HessianAccumulator
from ...evals.golden_text import load_heldout_text
from ...kernels.fp8 import scale_from_amax, quantize_fp8_values
from ...quantize.gptq import gptq_fp8_shared
from ...quantize.pipeline import calibration_text
from ...quantize.recipe import Recipe
from ..attention import AttentionMetadata, DenseAttention
from ..loaded_model import load

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
            "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
CALIB_BATCH = 4  # calibration rows per forward pass
EXACT_ATOL = 2e-3  # largest |logit difference| a transform may make in fp32 (logits ~ 10-30)


# -- numerics -----------------------------------------------------------------------------
def qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..] fp32, scale fp32 broadcastable -> the fp32 value FP8 E4M3 hands back."""
    return quantize_fp8_values(x, scale) * scale


def _paley12() -> torch.Tensor:
    """Paley's construction I for q = 11: a Hadamard matrix of order 12 (entries +-1)."""
    q = 11
    residues = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if a in residues else -1 for a in range(1, q)]
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0] = 1, -1
    for i in range(q):
        for j in range(q):
            s[i + 1, j + 1] = chi[(j - i) % q]
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard(n: int) -> torch.Tensor:
    """[n, n] fp64 orthonormal Hadamard matrix for n = 12^a * 2^k (Kronecker products of
    Paley's H12 and Sylvester's H2)."""
    h, m = torch.ones(1, 1, dtype=torch.float64), n
    while m % 12 == 0 and m & (m - 1):  # divisible by 12 and not a power of two
        h, m = torch.kron(h, _paley12()), m // 12
    if m & (m - 1):
        raise ValueError(f"no Hadamard construction here for order {n}")
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while m > 1:
        h, m = torch.kron(h, h2), m // 2
    h = h / math.sqrt(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12), n
    assert torch.all((h * math.sqrt(n)).abs().sub(1).abs() < 1e-12), n  # entries +-1/sqrt(n)
    return h


# -- simulated FP8 modules ----------------------------------------------------------------
class State:
    """What every simulated module of one model reads during a forward pass."""

    def __init__(self, h_head: torch.Tensor):
        self.h_head = h_head  # [D, D] fp32: the per-head Hadamard of K (and V)
        self.first: torch.Tensor | None = None  # [T] bool: rows at position 0 of a sequence
        self.record = False  # calibration: record amax of inputs, K and V
        self.hessians: dict[str, HessianAccumulator] | None = None  # GPTQ: E[x x^T] by input
        # run-time settings of the variant being measured
        self.acts = False
        self.keep_first_acts = False
        self.kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.keep_first_kv = False
        self.k_rot: torch.Tensor | None = None  # [D, D] fp32, q and k after RoPE
        # calibration records: name -> [amax at position 0, amax elsewhere]
        self.amax: dict[str, list[float]] = {}

    def note(self, key: str, x: torch.Tensor) -> None:  # x: [T, ...] fp32
        a = self.amax.setdefault(key, [0.0, 0.0])
        first = self.first
        a[0] = max(a[0], float(x[first].abs().max()) if first.any() else 0.0)
        a[1] = max(a[1], float(x[~first].abs().max()) if (~first).any() else 0.0)

    def scale(self, key: str, skip_first: bool) -> torch.Tensor:
        first, rest = self.amax[key]
        return scale_from_amax(rest if skip_first else max(first, rest)).reshape(1)


class SimLinear(nn.Module):
    """y = qdq(x R) W^T + b: W [out, in] fp32 (FP8 values times per-channel scales when the
    weights are FP8), R an optional online rotation [in, in] fp32, the input quantized with
    a static per-tensor scale when the variant quantizes activations."""

    def __init__(self, name: str, linear: nn.Linear, state: State,
                 rotate_in: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = linear.bias
        self.name, self.state, self.rotate_in = name, state, rotate_in
        layer, _, attr = name.partition(".")
        # q/k/v and gate/up read one input: its first reader accumulates the Hessian
        self.hessian_key = None if attr in ("k_proj", "v_proj", "up_proj") \
            else f"{layer}.{INPUT_OF[attr]}"
        self.input_scale: torch.Tensor | None = None  # [1] fp32, set per variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        st = self.state
        if self.rotate_in is not None:
            x = x @ self.rotate_in
        if st.record:
            st.note(self.name, x)
        if st.hessians is not None and self.hessian_key is not None:
            st.hessians.setdefault(self.hessian_key, HessianAccumulator(x.shape[-1])).observe(x)
        if st.acts:
            xq = qdq(x, self.input_scale)
            if st.keep_first_acts:
                xq[st.first] = x[st.first]
            x = xq
        return F.linear(x, self.weight, self.bias)


class SimAttention:
    """Dense attention whose K/V went through FP8 (per-layer static scales), with K (and q)
    optionally rotated per head after RoPE and position 0 optionally kept unquantized."""

    def __init__(self, state: State):
        self.inner, self.state = DenseAttention(), state

    def forward(self, spec, q, k, v, meta):  # q [T, H, D], k/v [T, Hkv, D] fp32
        st = self.state
        if st.k_rot is not None:
            q, k = q @ st.k_rot, k @ st.k_rot
        if st.record:
            st.note(f"{spec.layer_idx}.k", k)
            st.note(f"{spec.layer_idx}.v", v)
            if st.k_rot is None:  # K in the rotated basis too, from the same pass
                st.note(f"{spec.layer_idx}.k_rot", k @ st.h_head)
        scales = None if st.kv_scales is None else st.kv_scales.get(spec.layer_idx)
        if scales is not None:
            kq, vq = qdq(k, scales[0]), qdq(v, scales[1])
            if st.keep_first_kv:
                kq[st.first], vq[st.first] = k[st.first], v[st.first]
            k, v = kq, vq
        return self.inner.forward(spec, q, k, v, meta)


# -- model transforms (fp32, in place) ----------------------------------------------------
def fold_norms(model: nn.Module) -> None:
    """RMSNorm weights into the linears that read the norm's output; norms become 1."""
    def fold(norm, linears):
        for lin in linears:
            lin.weight.data = lin.weight.data * norm.weight.data  # [out, in] * [in]
        norm.weight.data = torch.ones_like(norm.weight.data)

    bb = model.model
    for layer in bb.layers:
        a, m = layer.self_attn, layer.mlp
        fold(layer.input_layernorm, (a.q_proj, a.k_proj, a.v_proj))
        fold(layer.post_attention_layernorm, (m.gate_proj, m.up_proj))
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.data.clone(), requires_grad=False)
    fold(bb.norm, (model.lm_head,))  # the LM head is untied from the embedding here


def rotate_residual(model: nn.Module, q: torch.Tensor) -> None:
    """Residual stream x -> x Q (q [hidden, hidden] fp32 orthonormal); norms folded first."""
    bb = model.model
    bb.embed_tokens.weight.data = bb.embed_tokens.weight.data @ q  # [vocab, hidden]
    for layer in bb.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            lin.weight.data = lin.weight.data @ q  # reads x Q
        for lin in (a.o_proj, m.down_proj):
            lin.weight.data = q.T @ lin.weight.data  # writes y Q
    model.lm_head.weight.data = model.lm_head.weight.data @ q


def rotate_v(model: nn.Module, h: torch.Tensor) -> None:
    """Each V head v -> v H (h [D, D]): into v_proj's rows and o_proj's input columns."""
    for layer in model.model.layers:
        a = layer.self_attn
        d = a.head_dim
        wv = a.v_proj.weight.data.view(a.num_kv_heads, d, -1)  # [Hkv, D, hidden]
        a.v_proj.weight.data = (h.T @ wv).reshape(a.num_kv_heads * d, -1)
        wo = a.o_proj.weight.data.view(-1, a.num_heads, d)  # [hidden, H, D]
        a.o_proj.weight.data = (wo @ h).reshape(-1, a.num_heads * d)


@dataclass(frozen=True)
class Config:
    """A model variant: what is folded in and whether the weights are FP8."""

    fold: bool = False  # RMSNorm weights folded into the linears (implied by rot)
    rot: bool = False  # residual stream rotated
    down_rot: bool = False  # online Hadamard on down_proj's input
    v_rot: bool = False  # V heads rotated (folded)
    fp8_w: bool = False

    @property
    def transformed(self) -> bool:
        return self.fold or self.rot or self.down_rot or self.v_rot


@dataclass(frozen=True)
class Variant:
    label: str
    cfg: Config
    acts: bool = False  # static FP8 linear inputs
    kv: bool = False  # FP8 KV
    k_rot: bool = False  # K (and q) rotated after RoPE
    skip_first: bool = False  # static scales calibrated without position 0
    keep_first_kv: bool = False  # position 0's K/V unquantized at run time
    keep_first_acts: bool = False  # position 0's linear inputs unquantized at run time


# -- running ------------------------------------------------------------------------------
class Sim:
    """A transformed copy of the source with its linears simulated, and its state."""

    def __init__(self, source: nn.Module, cfg: Config, q_res: torch.Tensor, h_head: torch.Tensor,
                 h_down: torch.Tensor, check_rows: torch.Tensor, check_logits: torch.Tensor):
        """q_res [hidden, hidden], h_head [D, D], h_down [inter, inter]: fp32 orthonormal;
        check_rows [L] int64 and check_logits [L, vocab] fp32: the source's logits."""
        self.state = State(h_head)
        self.attention = SimAttention(self.state)
        model = copy.deepcopy(source)
        if cfg.fold or cfg.rot:
            fold_norms(model)
        if cfg.rot:
            rotate_residual(model, q_res)
        if cfg.v_rot:
            rotate_v(model, h_head)
        if cfg.down_rot:
            for layer in model.model.layers:  # W H: reads (z H), z the MLP's inner activation
                layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data @ h_down
        for i, layer in enumerate(model.model.layers):
            for path in LINEARS:
                parent_name, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_name)
                rot = h_down if (cfg.down_rot and attr == "down_proj") else None
                setattr(parent, attr, SimLinear(f"{i}.{attr}", getattr(parent, attr),
                                                self.state, rot))
        self.model = model
        if cfg.transformed:  # the transform alone (no FP8) must not change the logits
            diff = (self.logits(check_rows) - check_logits).abs().max().item()
            print(f"exactness {cfg}: max |logit difference| {diff:.2e}", flush=True)
            assert diff < EXACT_ATOL, (cfg, diff)
        self.cfg = cfg
        self.linears = [m for m in model.modules() if isinstance(m, SimLinear)]

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """ids [T] int64 (sequences back to back) -> hidden [T, hidden] fp32."""
        meta = AttentionMetadata.from_lengths(lengths)
        first = torch.zeros(ids.shape[0], dtype=torch.bool)
        first[meta.query_start_loc[:-1]] = True
        self.state.first = first
        positions = torch.cat([torch.arange(n) for n in lengths])
        return self.model(ids, positions, meta, self.attention)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [L] -> [L, vocab] fp32
        return self.model.compute_logits(self.hidden(ids, [ids.shape[0]]))

    def _pass(self, rows: torch.Tensor) -> None:  # rows [N, L] int64
        for i in range(0, rows.shape[0], CALIB_BATCH):
            batch = rows[i:i + CALIB_BATCH]
            self.hidden(batch.reshape(-1), [batch.shape[1]] * batch.shape[0])

    def calibrate(self, rows: torch.Tensor, gptq: bool) -> None:
        """rows [N, L] int64. FP8 weights first (per output channel, minmax scales; GPTQ
        on Hessians of the unquantized model's inputs, or round to nearest), then the amax
        of every linear input, K and V on the model with those weights (fp32)."""
        st = self.state
        st.acts, st.kv_scales, st.k_rot = False, None, None
        if self.cfg.fp8_w:
            if gptq:
                st.hessians = {}
                self._pass(rows)
            groups: dict[str, list[SimLinear]] = {}
            for lin in self.linears:
                layer, _, attr = lin.name.partition(".")
                groups.setdefault(f"{layer}.{INPUT_OF[attr]}", []).append(lin)
            for key, lins in groups.items():
                ws = [lin.weight.data for lin in lins]  # each [out, in] fp32
                scales = [scale_from_amax(w.abs().amax(dim=1, keepdim=True))
                          for w in ws]  # each [out, 1]
                if gptq:
                    codes = gptq_fp8_shared(ws, st.hessians[key].hessian(), scales)
                    for lin, c, sc in zip(lins, codes, scales):
                        lin.weight.data = c.float() * sc
                else:
                    for lin, w, sc in zip(lins, ws, scales):
                        lin.weight.data = qdq(w, sc)
            st.hessians = None
        st.record = True
        self._pass(rows)
        st.record = False

    def set_variant(self, v: Variant) -> None:
        st = self.state
        st.acts, st.keep_first_acts = v.acts, v.keep_first_acts
        for lin in self.linears:
            lin.input_scale = st.scale(lin.name, v.skip_first) if v.acts else None
        layers = len(self.model.model.layers)
        kname = "k_rot" if v.k_rot else "k"
        st.kv_scales = None if not v.kv else {
            i: (st.scale(f"{i}.{kname}", v.skip_first), st.scale(f"{i}.v", v.skip_first))
            for i in range(layers)}
        st.keep_first_kv = v.keep_first_kv
        st.k_rot = st.h_head if v.k_rot else None


def heldout_rows(tok, tokens: int, row_len: int) -> list[torch.Tensor]:
    """The held-out documents (tokenized as the model sees them) cut into rows of at most
    row_len tokens, in order, until `tokens` tokens are predicted: list of [L] int64."""
    rows, left = [], tokens
    for text in load_heldout_text():
        ids = tok.encode(text, add_special_tokens=True)
        for s in range(0, len(ids), row_len):
            chunk = ids[s:s + row_len][:left + 1]
            if len(chunk) > 1:
                rows.append(torch.tensor(chunk, dtype=torch.int64))
                left -= len(chunk) - 1
            if left <= 0:
                return rows
    return rows


def log_probs(model_logits) -> torch.Tensor:
    return F.log_softmax(model_logits[:-1].float(), dim=-1)  # [L - 1, vocab]: tokens 1..L-1


def measure(sim: Sim, rows: list[torch.Tensor], ref: list[torch.Tensor],
            ref_nll: float) -> tuple[float, float]:
    """(relative token perplexity change, mean KL(source || sim) per predicted token)."""
    kl, nll, n = 0.0, 0.0, 0
    for ids, lp_ref in zip(rows, ref):
        lp = log_probs(sim.logits(ids))
        kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
        nll -= float(lp.gather(1, ids[1:, None]).sum())
        n += ids.shape[0] - 1
    return math.expm1((nll - ref_nll) / n), kl / n


def variants() -> list[tuple[str, list[Variant]]]:
    o, ow = Config(), Config(fp8_w=True)
    v, vw = Config(v_rot=True), Config(v_rot=True, fp8_w=True)
    f, fw = Config(fold=True), Config(fold=True, fp8_w=True)
    r, rw = Config(rot=True), Config(rot=True, fp8_w=True)
    rd, rdw = Config(rot=True, down_rot=True), Config(rot=True, down_rot=True, fp8_w=True)
    allw = Config(rot=True, down_rot=True, v_rot=True, fp8_w=True)
    return [
        ("baseline", [
            Variant("(a) bf16 weights, FP8 KV", o, kv=True),
            Variant("FP8 weights only", ow),
            Variant("bf16 weights, FP8 static activations", o, acts=True),
            Variant("(b) FP8 weights + static activations", ow, acts=True),
            Variant("(c) all FP8: weights + activations + KV (default)", ow, acts=True,
                    kv=True)]),
        ("KV Hadamard (head_dim 64)", [
            Variant("bf16 weights, FP8 KV, K rotated (online, after RoPE)", o, kv=True,
                    k_rot=True),
            Variant("bf16 weights, FP8 KV, V rotated (folded)", v, kv=True),
            Variant("bf16 weights, FP8 KV, K and V rotated", v, kv=True, k_rot=True),
            Variant("all FP8, K and V rotated", vw, acts=True, kv=True, k_rot=True)]),
        ("residual Hadamard (576)", [
            Variant("bf16 weights + activations, norms folded, no rotation", f, acts=True),
            Variant("bf16 weights + activations, residual rotated", r, acts=True),
            Variant("bf16 weights + activations, residual + online down_proj rotated", rd,
                    acts=True),
            Variant("FP8 weights only, residual rotated", rw),
            Variant("weights + activations, norms folded, no rotation", fw, acts=True),
            Variant("weights + activations, residual rotated", rw, acts=True),
            Variant("weights + activations, residual + online down_proj rotated", rdw,
                    acts=True),
            Variant("all FP8, every rotation (residual, down_proj, K, V)", allw, acts=True,
                    kv=True, k_rot=True)]),
        ("first token", [
            Variant("bf16 weights, FP8 KV, scales without position 0", o, kv=True,
                    skip_first=True),
            Variant("same, position 0's K/V unquantized", o, kv=True, skip_first=True,
                    keep_first_kv=True),
            Variant("weights + activations, scales without position 0", ow, acts=True,
                    skip_first=True),
            Variant("same, position 0's linear inputs unquantized", ow, acts=True,
                    skip_first=True, keep_first_acts=True),
            Variant("all FP8, scales without position 0", ow, acts=True, kv=True,
                    skip_first=True),
            Variant("same, position 0's K/V unquantized", ow, acts=True, kv=True,
                    skip_first=True, keep_first_kv=True),
            Variant("same, position 0's K/V and linear inputs unquantized", ow, acts=True,
                    kv=True, skip_first=True, keep_first_kv=True, keep_first_acts=True),
            Variant("all FP8, every rotation, position 0 as above", allw, acts=True, kv=True,
                    k_rot=True, skip_first=True, keep_first_kv=True,
                    keep_first_acts=True)]),
    ]


def first_token_share(sim: Sim) -> str:
    """How much position 0 sets the minmax scales: amax with it / amax without it."""
    amax = sim.state.amax
    lin = {k: a[0] / max(a[1], 1e-30) for k, a in amax.items() if k.split(".")[1] not in
           ("k", "v", "k_rot")}
    kv = {k: a[0] / max(a[1], 1e-30) for k, a in amax.items() if k.split(".")[1] in ("k", "v")}
    top = sorted(lin.items(), key=lambda kv_: -kv_[1])[:4]
    return (f"position 0 sets the scale of {sum(r > 1 for r in lin.values())} of {len(lin)} "
            f"linear inputs (largest ratios: "
            + ", ".join(f"{k} {r:.1f}x" for k, r in top)
            + f"), of {sum(r > 1 for r in kv.values())} of {len(kv)} K/V scales "
            f"(largest {max(kv.values()):.2f}x)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens predicted")
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--calib-rows", type=int, default=32, help="calibration rows of 512")
    ap.add_argument("--seed", type=int, default=0, help="the residual rotation's signs")
    ap.add_argument("--weights", choices=("gptq", "rtn"), default="gptq",
                    help="FP8 weight rounding (the default recipe's is gptq)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    src = load(args.source, torch.float32)
    model = src.model.eval()
    cfg = model.config
    h_head = hadamard(cfg.head_dim).float()  # [D, D]
    signs = torch.randint(0, 2, (cfg.hidden_size,),
                          generator=torch.Generator().manual_seed(args.seed)) * 2 - 1
    q_res = (signs[:, None].double() * hadamard(cfg.hidden_size)).float()  # [hidden, hidden]
    h_down = hadamard(cfg.intermediate_size).float()  # [inter, inter]

    rows = heldout_rows(src.tokenizer, args.tokens, args.row_len)
    calib, _ = calibration_text(args.source, Recipe(), None, args.calib_rows, 512, 0)
    with torch.inference_mode():
        ref = [log_probs(model.compute_logits(
            model(ids, torch.arange(ids.shape[0]), AttentionMetadata.single(ids.shape[0]),
                  DenseAttention()))) for ids in rows]
    ref_nll = -sum(float(lp.gather(1, ids[1:, None]).sum()) for lp, ids in zip(ref, rows))
    n_tok = sum(ids.shape[0] - 1 for ids in rows)
    print(f"{args.source}: {n_tok} held-out tokens in {len(rows)} rows, source token "
          f"perplexity {math.exp(ref_nll / n_tok):.4f}; calibration {calib.shape[0]} x "
          f"{calib.shape[1]} tokens", flush=True)
    check = rows[0][:256]
    with torch.inference_mode():
        check_logits = model.compute_logits(
            model(check, torch.arange(check.shape[0]), AttentionMetadata.single(check.shape[0]),
                  DenseAttention()))

    groups = variants()
    results: dict[Variant, tuple[float, float]] = {}
    configs = list(dict.fromkeys(v.cfg for _, vs in groups for v in vs))
    for c in configs:
        sim = Sim(model, c, q_res, h_head, h_down, check, check_logits)
        if c == Config():  # K rotation after RoPE alone must not change the logits either
            sim.set_variant(Variant("", c, k_rot=True))
            diff = (sim.logits(check) - check_logits).abs().max().item()
            print(f"exactness K rotation: max |logit difference| {diff:.2e}", flush=True)
            assert diff < EXACT_ATOL, diff
        sim.calibrate(calib, args.weights == "gptq")
        if c == Config(fp8_w=True):
            print(first_token_share(sim), flush=True)
        for _, vs in groups:
            for v in vs:
                if v.cfg == c:
                    sim.set_variant(v)
                    results[v] = measure(sim, rows, ref, ref_nll)
                    print(f"  {v.label}: {results[v][0]:+.2%}, KL {results[v][1] * 1e3:.2f}e-3 "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del sim

    print(f"\n{args.source}, first {n_tok} held-out tokens, calibration {calib.shape[0]} x "
          f"{calib.shape[1]}, {time.perf_counter() - t0:.0f} s\n")
    print("| variant | ppl vs bf16 | KL x 1e-3 |\n|---|---|---|")
    for name, vs in groups:
        print(f"| **{name}** | | |")
        for v in vs:
            ppl, kl = results[v]
            print(f"| {v.label} | {ppl:+.2%} | {kl * 1e3:.2f} |")


if __name__ == "__main__":
    main()
