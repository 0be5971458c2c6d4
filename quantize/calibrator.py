"""Block-by-block calibration and quantization of a checkpoint.

Only one decoder block's weights are in memory at a time, plus the calibration hidden
states ([N, L, hidden]) and the embedding / head, so peak memory grows with the largest
block, not with the model:

    hidden = embed(samples)
    for each block:
        load its weights from the checkpoint
        pass 1: run the samples through it, observing every linear's input and K/V
                (after k-norm and RoPE: what the cache stores); the block's output is
                not used, so its last linear's product is not computed
        freeze scales, quantize its weights to FP8 (or int8), swap in Fp8Linear
        pass 2: run the samples through the *quantized* block (FP8 K/V too) to get the
                next block's input, so later scales see the errors the runtime will see
        emit the block's tensors, drop its weights
    final norm -> observe the LM head input (if the head is quantized) -> emit the rest
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..calib.grids import weight_grid
from ..calib.hessian import HessianAccumulator, SharedInput, Tee
from ..calib.hooks import ActivationRecorder, ObservingAttention
from ..calib.observers import make_observer
from ..runtime.attention import AttentionMetadata, DenseAttention
from ..runtime.fp8_kv_attention import Fp8KVAttention
from ..runtime.layers.fp8_linear import Fp8Linear
from ..runtime.models.registry import get_model_class
from ..runtime.formats.checkpoint import Checkpoint
from ..runtime.formats.compressed_tensors import weight_tensors
from ..runtime.formats.errors import CheckpointError
from .gptq import gptq_shared
from .recipe import Recipe
from .smoothing import smooth_block

Emit = Callable[[dict[str, torch.Tensor]], None]


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps large freed blocks otherwise,
    and the process's footprint would grow block after block)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
@contextmanager
def _output_unused(linear: nn.Module | None):
    """Within: `linear` returns zeros instead of its product (its pre-hooks still see the
    input). For the statistics pass, whose block output is discarded: the block's last
    linear (down_proj) feeds only that output, so its product is never read. None: no-op."""
    if linear is None:
        yield
        return
    out_features = linear.out_features
    linear.forward = lambda x: x.new_zeros(*x.shape[:-1], out_features)
    try:
        yield
    finally:
        del linear.forward


@contextmanager
def _calibrating(block: nn.Module):
    """Within: modules with a `calibrating` switch (latent attention, experts) run the
    extra products their linears' statistics need (see those modules)."""
    switched = [m for m in block.modules() if hasattr(m, "calibrating")]
    for m in switched:
        m.calibrating = True
    try:
        yield
    finally:
        for m in switched:
            m.calibrating = False


# Linears that read the same input tensor in one forward, in call order (HF names).
SHARED_INPUT_GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
                       "gate_proj": "gate_up", "up_proj": "gate_up"}


def _by_shared_input(names, hessians: dict) -> list[list[str]]:
    """`names` in groups that share one Hessian accumulator (one input), in first-seen
    order; a linear without a Hessian is a group of its own."""
    groups: dict[object, list[str]] = {}
    for n in names:
        groups.setdefault(hessians[n][0] if n in hessians else n, []).append(n)
    return list(groups.values())


@dataclass
class LinearStat:
    name: str
    shape: tuple[int, int]
    input_scale: float | None  # None: weight-only (W8A16) or dynamic per-token inputs
    weight_scale_min: float
    weight_scale_max: float
    weight_only: bool = False  # W8A16: the input is not quantized


@dataclass
class CalibrationSummary:
    linears: list[LinearStat] = field(default_factory=list)
    kv_scales: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    quantized_modules: list[str] = field(default_factory=list)
    ignored_modules: list[str] = field(default_factory=list)
    lm_head_quantized: bool = False
    smoothing: dict[str, tuple[float, float]] = field(default_factory=dict)  # target -> s range


class BlockwiseCalibrator:
    def __init__(self, checkpoint: Checkpoint, recipe: Recipe, dtype: torch.dtype = torch.bfloat16,
                 batch_tokens: int = 4096, progress: Callable[[str], None] | None = None):
        self.ckpt = checkpoint
        self.recipe = recipe
        self.dtype = dtype
        self.batch_tokens = batch_tokens
        self.progress = progress or (lambda msg: None)
        config_path = str(checkpoint.path / "config.json")
        cls = get_model_class(checkpoint.architecture, config_path)
        self.cfg = cls.config_from_hf(checkpoint.config, config_path)
        with torch.device("meta"):
            self.model = cls(self.cfg)
        # our parameter name -> checkpoint tensor name
        self.names = {}
        for ck_name in checkpoint.tensor_names():
            ours = self.model.param_name(ck_name)
            if ours is not None:
                self.names[ours] = ck_name
        self.summary = CalibrationSummary()

    # -- weights in and out -------------------------------------------------------------
    def _materialize(self, module: nn.Module, prefix: str) -> None:
        """Load `module`'s parameters (named under `prefix`) from the checkpoint."""
        for name, param in list(module.named_parameters(recurse=True)):
            if not param.is_meta:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if full not in self.names:
                raise CheckpointError(f"{self.ckpt.path}: missing tensor {full!r} that "
                                      f"{type(self.model).__name__} needs.")
            t = self.ckpt.tensor(self.names[full]).to(self.dtype)
            if tuple(t.shape) != tuple(param.shape):
                raise CheckpointError(f"{self.ckpt.weight_map[self.names[full]]}: {full} has shape "
                                 f"{list(t.shape)}, expected {list(param.shape)}.")
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attr,
                    nn.Parameter(t, requires_grad=False))
        for sub in module.modules():
            if hasattr(sub, "reset_buffers"):
                sub.reset_buffers(device="cpu")

    def _grid(self, name: str):
        """The grid of linear `name`'s weight codes (calib/grids.py): fp8 | int8."""
        return weight_grid(self.recipe.weight_type(name))

    def _weight_scale(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """w [out, in] of linear `name` -> its scale on the weight grid (amax / 448 for
        FP8, / 127 for int8), fp32 [out, 1] (per channel) or [1] (per tensor)."""
        channel = self.recipe.weight_granularity(name) == "channel"
        obs = make_observer(self.recipe.weights.observer, dim=0 if channel else None,
                            grid=self._grid(name).name, **self.recipe.weights.observer_args)
        obs.observe(w)
        return obs.scale().reshape(-1, 1) if channel else obs.scale().reshape(1)

    def _weight_codes(self, linears: dict[str, nn.Linear], hessian: torch.Tensor | None
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (codes [out, in] float8_e4m3fn or int8, the grid's; scale) for linears
        that read one input: GPTQ runs once for all of them on their shared Hessian, else
        round-to-nearest. Linears that share an input share a grid (they are one layer's)."""
        ws = {n: lin.weight.detach() for n, lin in linears.items()}  # [out, in] compute dtype
        scales = {n: self._weight_scale(n, w) for n, w in ws.items()}
        grid = self._grid(next(iter(ws)))
        if hessian is None:
            return {n: (grid.quantize(w, scales[n]), scales[n]) for n, w in ws.items()}
        rs = self.recipe.weights
        codes = gptq_shared(list(ws.values()), hessian, list(scales.values()), grid,
                            rs.gptq_block_size, rs.gptq_dampening)
        return {n: (c, scales[n]) for n, c in zip(ws, codes)}

    def _quantize_linear(self, name: str, linear: nn.Linear, input_scale: torch.Tensor | None,
                         w_codes: torch.Tensor, w_scale: torch.Tensor,
                         ) -> tuple[Fp8Linear, dict[str, torch.Tensor]]:
        """The 8-bit module and artifact tensors of `linear` from its codes (E4M3, or int8:
        written pack-quantized when weight-only, as an int8 `weight` for W8A8 int8) and scales; input_scale None: weight-only (W8A16) or, with
        the recipe's dynamic activations, per-token input scales at run time; no input
        scale is written."""
        in_scale = None if input_scale is None else input_scale.reshape(1).float()
        bias = None if linear.bias is None else linear.bias.detach()
        weight_only = self.recipe.is_weight_only(name)
        tensors = {**weight_tensors(name, w_codes, int8_packed=weight_only),
                   f"{name}.weight_scale": w_scale.float()}
        if in_scale is not None:
            tensors[f"{name}.input_scale"] = in_scale
        if bias is not None:
            tensors[f"{name}.bias"] = bias.to(torch.bfloat16)
        self.summary.linears.append(LinearStat(
            name, tuple(linear.weight.shape), None if in_scale is None else float(in_scale),
            float(w_scale.min()), float(w_scale.max()), weight_only))
        self.summary.quantized_modules.append(name)
        dynamic = in_scale is None and not weight_only  # the recipe's dynamic activations
        return Fp8Linear(w_codes, w_scale, in_scale, bias, self.dtype, dynamic), tensors

    def _act_observer(self):
        act = self.recipe.activations
        return make_observer(act.observer, **act.observer_args)

    def _hessians(self, linears: dict[str, nn.Linear]) -> dict[str, tuple[SharedInput]]:
        """One Hessian per distinct input: q/k/v share one, gate/up share one."""
        if self.recipe.weights.algorithm != "gptq":
            return {}
        groups: dict[str, list[str]] = {}
        for name in linears:
            parent, _, leaf = name.rpartition(".")
            key = SHARED_INPUT_GROUPS.get(leaf)
            groups.setdefault(f"{parent}:{key}" if key else name, []).append(name)
        out = {}
        for members in groups.values():
            acc = HessianAccumulator(linears[members[0]].in_features)
            shared = SharedInput(acc, len(members))
            out.update({m: (shared,) for m in members})
        return out

    # -- running blocks -----------------------------------------------------------------
    def _batches(self, n: int, seq_len: int):
        per = max(1, self.batch_tokens // seq_len)
        for s in range(0, n, per):
            yield s, min(n, s + per)

    def _run_block(self, block, hidden: torch.Tensor, ropes, attn) -> torch.Tensor:
        """hidden [N, L, H] -> [N, L, H], in batches of whole samples."""
        n, seq_len, h = hidden.shape
        out = torch.empty_like(hidden)
        for s, e in self._batches(n, seq_len):
            meta = AttentionMetadata.from_lengths([seq_len] * (e - s))
            flat = hidden[s:e].reshape(-1, h)
            rope = tuple(r.repeat(e - s, 1) for r in ropes[block.rope_kind])
            out[s:e] = block(flat, rope, meta, attn).reshape(e - s, seq_len, h)
        return out

    @torch.inference_mode()
    def run(self, samples: torch.Tensor, emit: Emit) -> CalibrationSummary:
        """samples: [N, L] int64. Emits artifact tensors (HF names) block by block."""
        model, backbone = self.model, self.model.backbone
        bb = self.model.backbone_path
        n, seq_len = samples.shape
        self._materialize(backbone.embed_tokens, f"{bb}.embed_tokens")
        for sub in backbone.modules():  # rotary frequencies
            if hasattr(sub, "reset_buffers"):
                sub.reset_buffers(device="cpu")
        hidden = backbone.embed_tokens(samples)  # [N, L, H]
        if backbone.embedding_scale is not None:
            hidden = hidden * torch.tensor(backbone.embedding_scale).to(hidden.dtype)
        positions = torch.arange(seq_len)
        ropes = backbone.ropes(positions, self.dtype)

        param_dtype = getattr(model, "param_dtype", lambda name, dtype: dtype)
        kv_on = self.recipe.kv_cache.enabled
        kv_dim = 1 if self.recipe.kv_cache.granularity == "head" else None
        for i, block in enumerate(backbone.layers):
            prefix = f"{bb}.layers.{i}"
            self.progress(f"block {i + 1}/{len(backbone.layers)}")
            self._materialize(block, prefix)
            sm = self.recipe.smoothing
            if sm.enabled:  # before any statistics: everything below sees the smoothed block
                factors = smooth_block(block, lambda b=block, h=hidden: self._run_block(
                    b, h, ropes, DenseAttention()), sm.alpha, tuple(sm.targets))
                for t, s in factors.items():
                    lo, hi = self.summary.smoothing.get(t, (float("inf"), 0.0))
                    self.summary.smoothing[t] = (min(lo, float(s.min())), max(hi, float(s.max())))
            linears = {f"{prefix}.{m}": mod for m, mod in block.named_modules()
                       if isinstance(mod, nn.Linear)}
            quant = {k: v for k, v in linears.items() if not self.recipe.is_ignored(k)}
            self.summary.ignored_modules += sorted(set(linears) - set(quant))
            kv_factory = (lambda _: (make_observer(self.recipe.kv_cache.observer, dim=kv_dim,
                                                   **self.recipe.kv_cache.observer_args),
                                     make_observer(self.recipe.kv_cache.observer, dim=kv_dim,
                                                   **self.recipe.kv_cache.observer_args)))
            observing = ObservingAttention(DenseAttention(), kv_factory)
            act_obs = {name: self._act_observer() for name in quant  # static input scales
                       if self.recipe.has_static_input(name)}
            hess = self._hessians(quant)
            with ActivationRecorder(quant, lambda n, a=act_obs, h=hess: Tee(
                    *([a[n]] if n in a else []), *h.get(n, ()))), _calibrating(block), \
                    _output_unused(getattr(getattr(block, "mlp", None), "down_proj", None)):
                self._run_block(block, hidden, ropes, observing)  # pass 1: statistics
            tensors: dict[str, torch.Tensor] = {}
            codes = {}
            for members in _by_shared_input(quant, hess):
                shared = hess.get(members[0])
                codes.update(self._weight_codes({m: quant[m] for m in members},
                                                shared[0].inner.hessian() if shared else None))
            for name, linear in quant.items():
                in_scale = act_obs[name].scale() if name in act_obs else None
                fp8, ts = self._quantize_linear(name, linear, in_scale, *codes[name])
                parent, _, attr = name[len(prefix) + 1:].rpartition(".")
                setattr(block.get_submodule(parent), attr, fp8)
                tensors.update(ts)
            kv_scales = {}
            if kv_on:
                obs = observing.observers[i]
                k_s, v_s = obs.k.scale().reshape(-1), obs.v.scale().reshape(-1)  # [1] or [Hkv]
                kv_scales[i] = (k_s, v_s)
                tensors[f"{prefix}.self_attn.k_scale"] = k_s
                tensors[f"{prefix}.self_attn.v_scale"] = v_s
                self.summary.kv_scales[i] = (k_s.tolist(), v_s.tolist())
            last = i == len(backbone.layers) - 1
            if not last or not self.recipe.is_ignored("lm_head"):  # else nothing reads it
                attn2 = Fp8KVAttention(DenseAttention(), kv_scales)
                hidden = self._run_block(block, hidden, ropes, attn2)  # pass 2: quantized outputs
            for pname, p in block.named_parameters():  # norms and any ignored linears
                full = f"{prefix}.{pname}"
                if not any(full.startswith(q + ".") for q in quant):
                    tensors[full] = p.detach().to(param_dtype(full, torch.bfloat16))
            emit(tensors)
            backbone.layers[i] = block.to("meta")  # drop this block's weights
            del block, tensors, linears, quant, act_obs, hess, observing
            release_freed_memory()

        self._materialize(backbone.norm, f"{bb}.norm")
        tail = {f"{bb}.embed_tokens.weight": backbone.embed_tokens.weight.detach().to(torch.bfloat16),
                f"{bb}.norm.weight": backbone.norm.weight.detach().to(torch.bfloat16)}
        tied = self.cfg.tie_word_embeddings
        if self.recipe.is_ignored("lm_head"):
            self.summary.ignored_modules.append("lm_head")
            if not tied:
                self._materialize(model.lm_head, "lm_head")
                tail["lm_head.weight"] = model.lm_head.weight.detach().to(torch.bfloat16)
        else:
            self.progress("lm_head")
            head = model.lm_head
            if tied:
                head = nn.Linear(head.in_features, head.out_features, bias=False)
                head.weight = backbone.embed_tokens.weight
            else:
                self._materialize(head, "lm_head")
            normed = backbone.norm(hidden)  # [N, L, H]: the last block's quantized outputs
            obs = None
            if self.recipe.has_static_input("lm_head"):
                obs = self._act_observer()
                obs.observe(normed)
            h = None
            if self.recipe.weights.algorithm == "gptq":
                acc = HessianAccumulator(head.in_features)
                acc.observe(normed)
                h = acc.hessian()
            codes = self._weight_codes({"lm_head": head}, h)["lm_head"]
            in_scale = obs.scale() if obs is not None else None
            _, ts = self._quantize_linear("lm_head", head, in_scale, *codes)
            tail.update(ts)
            self.summary.lm_head_quantized = True
        emit(tail)
        return self.summary
