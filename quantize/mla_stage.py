"""The `--mla` stage of `qserve quantize`: source checkpoint -> converted checkpoint.

    load the source (fp32) -> input covariances on calibration rows -> per-layer factors
    -> rank (given, or the smallest within the budget on held-out rows) -> convert
    -> [layer-local distillation] -> [whole-model distillation]
    -> a DeepseekV3-layout checkpoint in a scratch directory

FP8 calibration then runs on that checkpoint like on any other source. Perplexities here
are token perplexities of the converted model in fp32 (before FP8) on held-out rows of the
calibration corpus, relative to the source model on the same rows.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..runtime.formats.checkpoint import open_checkpoint
from ..runtime.models.loader import load_model
from .mla_convert import (MLAConversionError, build_converted, check_convertible,
                          choose_rope_slots, convert_state, converted_config, has_q_bias,
                          input_covariances, layer_factors, rope_pairs_of, rope_slot_scores)
from .mla_distill import distill_attention, distill_model, log_probs
from .recipe import MLAScheme

RANK_STEP = 16  # auto ranks are multiples of this minus one: the latent + constant align
# how much the rotation-free keys count against the values in the joint factorisation
# (mla_convert.layer_factors); the one with the lowest held-out perplexity is kept
K_WEIGHTS = (0.25, 1.0, 4.0)


@dataclass
class MLAReport:
    """What the stage chose and measured (the manifest's `mla` entry and the summary)."""

    rank: int
    rope_heads: int
    full_rank: int
    cache_values: int  # per token and layer: rank + 1 constant + RoPE key
    kv_bytes_per_token: int  # FP8 latent, all layers
    gqa_bf16_bytes_per_token: int  # the source's bf16 K/V, all layers
    ppl_increase: float  # converted (after distillation, if any) vs source, fp32
    ppl_increase_before_distill: float | None
    # after the layer-local stage, where the whole-model stage ran after it
    ppl_increase_after_layer_distill: float | None = None
    model_distill: dict | None = None  # mla_distill.ModelFit and its learning rate
    searched: list[tuple[int, float]] = field(default_factory=list)  # auto: (rank, increase)
    k_weight: float = 1.0
    k_weights_tried: list[tuple[float, float]] = field(default_factory=list)  # (weight, increase)
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    rope_select: str = "heads"  # MLAScheme.rope_select (the layers' rope_pairs where not heads)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"MLA: rank {self.rank} (+1 constant) of {self.full_rank}, RoPE key "
                 f"{self.cache_values - self.rank - 1} values"
                 + ("" if self.rope_select == "heads" else f" ({self.rope_select})")
                 + f": {self.kv_bytes_per_token} KV "
                 f"bytes/token in FP8 ({self.kv_bytes_per_token / self.gqa_bf16_bytes_per_token:.3f}x "
                 f"the bf16 GQA cache), token perplexity {self.ppl_increase:+.2%} vs the source"
                 + (f" ({self.ppl_increase_before_distill:+.2%} before distillation"
                    + (f", {self.ppl_increase_after_layer_distill:+.2%} after the layer-local "
                       "stage" if self.ppl_increase_after_layer_distill is not None else "")
                    + ")" if self.ppl_increase_before_distill is not None else "")]
        if self.model_distill:
            d = self.model_distill
            lines.append(f"  whole-model distillation: {d['steps']} steps over {d['rows']} rows "
                         f"of {d['row_tokens']} tokens, next-token KL {d['kl_before']:.4f} -> "
                         f"{d['kl_after']:.4f} nats")
        for r, inc in self.searched:
            lines.append(f"  searched rank {r}: {inc:+.2%}")
        if len(self.k_weights_tried) > 1:
            lines.append("  key weight " + ", ".join(f"{w:g}: {inc:+.2%}"
                                                     for w, inc in self.k_weights_tried)
                         + f" -> {self.k_weight:g}")
        return "\n".join(lines)


def position_nll(model, rows: torch.Tensor, attention=None) -> torch.Tensor:
    """[N, L-1] fp32 next-token negative log-likelihood (nats) at each position of rows
    [N, L], through `attention` (default: a fresh DenseAttention per row)."""
    with torch.no_grad():
        return torch.stack([-log_probs(model, r, attention)[:-1].gather(1, r[1:, None])[:, 0]
                            for r in rows])


def token_nll(model, rows: torch.Tensor, attention=None) -> float:
    """Mean next-token negative log-likelihood (nats) over rows [N, L], through
    `attention` (default: a fresh DenseAttention per row)."""
    nll = position_nll(model, rows, attention)
    return sum(float(r.sum()) for r in nll) / nll.numel()


def convert_source(source_dir: Path, scheme: MLAScheme, cal_rows: torch.Tensor,
                   heldout_rows: torch.Tensor, out_dir: Path,
                   progress: Callable[[str], None],
                   model_rows: torch.Tensor | None = None) -> MLAReport:
    """Write the converted checkpoint of `source_dir` to `out_dir` (which must not exist).
    cal_rows [N, L]: the first `scheme.num_samples` give the statistics and the layer-local
    distillation; model_rows [M, L'] (default: cal_rows) up to `scheme.distill_model_rows`
    the whole-model distillation; any row also in heldout_rows is dropped first (the
    caller keeps rows of other lengths off the held-out text: pipeline._convert_to_mla)."""
    t0 = time.perf_counter()
    cal_rows = rows_not_in(cal_rows, heldout_rows)
    if model_rows is None:
        model_rows = cal_rows
    elif model_rows.shape[1] == heldout_rows.shape[1]:
        model_rows = rows_not_in(model_rows, heldout_rows)
    train_rows = model_rows[:scheme.distill_model_rows]
    cal_rows = cal_rows[:scheme.num_samples]
    progress("mla: loading source")
    ckpt = open_checkpoint(source_dir)
    model = load_model(ckpt, torch.float32)
    cfg = model.config
    check_convertible(model, scheme.rope_heads, scheme.rank or None)
    progress("mla: input statistics")
    sigmas = input_covariances(model, cal_rows)
    slots = rope_slots(model, sigmas, scheme)
    factor_sets: dict[float, list] = {}

    def factors_for(k_weight: float) -> list:
        if k_weight not in factor_sets:
            factor_sets[k_weight] = [
                layer_factors(layer, s, cfg, scheme.rope_heads, k_weight, slot)
                for layer, s, slot in zip(model.backbone.layers, sigmas, slots)]
        return factor_sets[k_weight]

    full = factors_for(1.0)[0].wz.shape[0]
    base = token_nll(model, heldout_rows)

    def increase(m) -> float:
        return math.exp(token_nll(m, heldout_rows) - base) - 1

    def build(rank: int, k_weight: float = 1.0):
        factors = factors_for(k_weight)
        state, layers = convert_state(model, factors, rank)
        config = converted_config(ckpt.config, cfg, rank, scheme.rope_heads,
                                  has_q_bias(factors[0]), rope_pairs_of(factors))
        return build_converted(config, state, torch.float32), config, layers

    searched: list[tuple[int, float]] = []
    if scheme.auto:
        rank = _search_rank(lambda r: increase(build(r)[0]), full, scheme.budget, searched,
                            progress)
    else:
        rank = scheme.rank
    tried: list[tuple[float, float]] = []
    weights = K_WEIGHTS if scheme.rope_heads < cfg.num_kv_heads else (1.0,)
    best = None
    for k_weight in weights:  # the key/value balance, by held-out perplexity
        progress(f"mla: rank {rank}, key weight {k_weight}")
        built = build(rank, k_weight)
        known = dict(searched).get(rank) if k_weight == 1.0 else None
        inc_k = known if known is not None else increase(built[0])
        tried.append((k_weight, round(inc_k, 6)))
        if best is None or inc_k < best[0]:
            best = (inc_k, k_weight, built)
    inc, k_weight, (converted, config, layers) = best
    factor_sets.clear()
    before = after_layer = model_fit = None
    if scheme.distill_steps:
        before = inc
        fits = distill_attention(model, converted, cal_rows[:8], scheme.distill_steps,
                                 scheme.distill_lr, progress)
        for info, fit in zip(layers, fits):
            info.update(distill_before=round(fit.before, 5), distill_after=round(fit.after, 5))
        inc = increase(converted)
    if scheme.distill_model_steps:
        if before is None:
            before = inc
        else:
            after_layer = round(inc, 6)
        fit = distill_model(model, converted, train_rows, scheme.distill_model_steps,
                            scheme.distill_model_lr, progress)
        model_fit = {"steps": fit.steps, "rows": fit.rows, "lr": scheme.distill_model_lr,
                     "row_tokens": int(train_rows.shape[1]),
                     "kl_before": round(fit.kl_before, 6), "kl_after": round(fit.kl_after, 6)}
        inc = increase(converted)
    progress("mla: writing the converted checkpoint")
    _write_checkpoint(converted, config, source_dir, out_dir)
    values = rank + 1 + scheme.rope_heads * cfg.head_dim
    return MLAReport(
        rank=rank, rope_heads=scheme.rope_heads, full_rank=full, cache_values=values,
        kv_bytes_per_token=cfg.num_layers * values,
        gqa_bf16_bytes_per_token=cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2,
        ppl_increase=round(inc, 6),
        ppl_increase_before_distill=None if before is None else round(before, 6),
        ppl_increase_after_layer_distill=after_layer, model_distill=model_fit,
        searched=searched, k_weight=k_weight, k_weights_tried=tried, layers=layers,
        seconds=round(time.perf_counter() - t0, 1), rope_select=scheme.rope_select)


def rope_slots(model, sigmas: list[torch.Tensor], scheme: MLAScheme
               ) -> list[list[tuple[int, int]] | None]:
    """Per layer, the (frequency pair, mixed head) slots that keep RoPE under
    `scheme.rope_select`, or None per layer for whole heads ("heads")."""
    cfg = model.config
    if scheme.rope_select == "heads":
        return [None] * cfg.num_layers
    scores = [rope_slot_scores(layer, s, cfg, scheme.rope_span)
              for layer, s in zip(model.backbone.layers, sigmas)]
    return choose_rope_slots(scores, scheme.rope_heads * cfg.head_dim // 2)


def rows_not_in(rows: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The rows [N, L] of `rows` that are not rows of `other` [M, L], in order: held-out
    text is drawn from the same corpus, and a row in both would be measured on what was
    fitted to it."""
    seen = {tuple(r) for r in other.tolist()}
    keep = [i for i, r in enumerate(rows.tolist()) if tuple(r) not in seen]
    return rows if len(keep) == rows.shape[0] else rows[keep]


def _search_rank(measure: Callable[[int], float], full: int, budget: float,
                 searched: list[tuple[int, float]], progress) -> int:
    """The smallest rank (a multiple of RANK_STEP minus 1, or full) within `budget`,
    by bisection (quality grows with the rank)."""
    candidates = [r for r in range(RANK_STEP - 1, full, RANK_STEP)] + [full]

    def ok(i: int) -> bool:
        progress(f"mla: trying rank {candidates[i]}")
        inc = measure(candidates[i])
        searched.append((candidates[i], round(inc, 6)))
        return inc <= budget

    if not ok(len(candidates) - 1):
        raise MLAConversionError(
            f"--mla auto: no rank meets mla.budget +{budget:.1%}: even the full rank {full} "
            f"measures {searched[-1][1]:+.2%} token perplexity (what dropping RoPE from the "
            "other kv heads costs). Raise --mla-budget above that, keep RoPE on more heads "
            "(--mla-rope-heads), or add distillation (--mla-distill STEPS) with a fixed rank.")
    lo, hi = 0, len(candidates) - 1  # candidates[hi] meets it
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    searched.sort()
    return candidates[hi]


def _write_checkpoint(model, config: dict, source_dir: Path, out_dir: Path) -> None:
    """config.json + model.safetensors (fp32) + the source's tokenizer files."""
    out_dir.mkdir(parents=True)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
             if not k.endswith("inv_freq")}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in source_dir.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copyfile(p, out_dir / p.name)
