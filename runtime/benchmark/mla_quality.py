"""GQA -> MLA conversion quality against KV size (quantize/mla_convert.py), no FP8.

    python -m qserve.runtime.benchmark.mla_quality [--source smollm2-135m]
        [--ranks 320,255,191,127,95,63] [--rope-heads 1,2] [--rope-select heads,pairs]
        [--k-weights 1] [--distill 127:120[:150]] [--out docs/mla-bench.json]

For each (rope heads, rank): KV bytes per token of the FP8 latent cache (rank + 1 constant
+ RoPE key, one byte each, all layers) against the source's bf16 K/V, the relative change
of token perplexity against the source on held-out rows of the calibration corpus (fp32,
both models), and greedy agreement with the source: the share of positions where the
converted model's top-1 token equals the source's greedy continuation, and of prompts
whose whole greedy continuation is identical. `--distill RANK:STEPS` adds rows for that
rank converted as `qserve quantize --mla RANK --mla-distill STEPS` does (key weight chosen
from 0.25 / 1 / 4, then layer-local distillation; rope heads 1, or
`--distill-rope-heads`); `RANK:STEPS:MODEL_STEPS` also runs whole-model distillation as `--mla-distill-model MODEL_STEPS` does: one row
after both stages, with the perplexity before and after the layer-local stage in it. The
other rows use the `--k-weights` given (default 1); the source is factorised once per
rope heads, RoPE selection (`mla.rope_select`; the --distill row takes the last one) and
key weight, ranks are truncations.

`--gate-text N` also measures every row on N windows of `--gate-window` tokens (default
2,048, the gates' rolling window) of the gates' held-out text (other topics than the
calibration corpus's), overall and by position in the window: where a converted model's
loss grows with the distance attention has to look back. `--distill-model-len L` trains
whole-model distillation on rows of L tokens (the recipe key `mla.distill_model_seq_len`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ...evals.agreement import agreement, reference_continuations
from ...quantize.mla_convert import (build_converted, check_convertible, convert_state,
                                     converted_config, has_q_bias, input_covariances,
                                     layer_factors, rope_pairs_of)
from ...quantize.mla_stage import convert_source, position_nll, rope_slots, token_nll
from ...quantize.pipeline import mla_rows
from ...quantize.recipe import MLAScheme, Recipe
from ..atomic_file import write_json_atomic
from ..attention import AttentionMetadata, DenseAttention
from ..formats.checkpoint import open_checkpoint
from ..formats.sources import resolve_source
from ..models.loader import load_model
from ..tokenizer import Tokenizer


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.mla_quality")
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--ranks", default="320,255,191,127,95,63")
    ap.add_argument("--rope-heads", default="1,2")
    ap.add_argument("--rope-select", default="heads",
                    help="comma-separated: heads, pairs (as mla.rope_select)")
    ap.add_argument("--rope-span", type=int, default=MLAScheme().rope_span)
    ap.add_argument("--k-weights", default="1",
                    help="comma-separated key weights of the joint factorisation (rows)")
    ap.add_argument("--distill", default=None, metavar="RANK:STEPS[:MODEL_STEPS]")
    ap.add_argument("--distill-lr", type=float, default=MLAScheme().distill_lr)
    ap.add_argument("--distill-model-lr", type=float, default=MLAScheme().distill_model_lr)
    ap.add_argument("--distill-model-rows", type=int, default=MLAScheme().distill_model_rows)
    ap.add_argument("--distill-model-len", type=int, default=MLAScheme().distill_model_seq_len)
    ap.add_argument("--distill-rope-heads", type=int, default=1,
                    help="RoPE heads of the --distill row (as --mla-rope-heads)")
    ap.add_argument("--gate-text", type=int, default=0, metavar="N",
                    help="also measure on N windows of the gates' held-out text")
    ap.add_argument("--gate-window", type=int, default=2048)
    ap.add_argument("--fp8-scales", type=int, default=None, metavar="RANK",
                    help="also: the FP8 latent at RANK with one scale for c_kv and the RoPE "
                         "key vs one scale each (token perplexity vs the fp32 latent)")
    ap.add_argument("--samples", type=int, default=16, help="calibration rows (covariances)")
    ap.add_argument("--heldout", type=int, default=4, help="held-out rows (perplexity)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8, help="agreement prompts (64 tokens)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    src = resolve_source(a.source)
    ckpt = open_checkpoint(src.checkpoint_dir)
    model = load_model(ckpt, torch.float32)
    cfg = model.config
    model_steps = int(a.distill.split(":")[2]) if a.distill and a.distill.count(":") == 2 else 0
    tok = Tokenizer.from_dir(src.checkpoint_dir, ckpt.generation_config)
    # drawn as `qserve quantize` draws them (the prompts are held-out rows too)
    rows_recipe = Recipe(mla=MLAScheme(
        num_samples=a.samples, seq_len=a.seq_len, distill_model_steps=model_steps,
        distill_model_rows=a.distill_model_rows, distill_model_seq_len=a.distill_model_len))
    cal, held, model_rows = mla_rows(tok, ckpt.config, rows_recipe, None, a.heldout + a.prompts)
    held, prompt_rows = held[:a.heldout], held[a.heldout:]
    gate = _gate_windows(tok, a.gate_text, a.gate_window)  # [N, W]
    gate_base = position_nll(model, gate) if gate.shape[0] else None
    prompts = [r[:64].tolist() for r in prompt_rows]
    base = token_nll(model, held)
    ref = reference_continuations(model, prompts, a.tokens)
    sigmas = input_covariances(model, cal[:a.samples])
    gqa_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    rows = []

    def measure(converted, rank, rope_heads, distill_steps=0, model_steps=0, select="heads",
                k_weight=1.0):
        import math

        agree = agreement(converted, prompts, ref)
        values = rank + 1 + rope_heads * cfg.head_dim
        row = {"rope_heads": rope_heads, "rope_select": select, "k_weight": k_weight,
               "rank": rank, "distill_steps": distill_steps,
               "distill_model_steps": model_steps,
               "kv_bytes_per_token": cfg.num_layers * values,
               "vs_bf16_gqa": round(cfg.num_layers * values / gqa_bytes, 4),
               "ppl_increase": round(math.exp(token_nll(converted, held) - base) - 1, 4),
               "token_agreement": round(agree.token_agreement, 4),
               "sequences_identical": round(agree.sequences_identical, 4)}
        if gate.shape[0]:
            diff = position_nll(converted, gate) - gate_base  # [N, W-1]
            row["gate_text_ppl_increase"] = round(math.exp(float(diff.mean())) - 1, 4)
            row["gate_text_by_position"] = {
                f"{lo}-{hi}": round(math.exp(float(diff[:, lo:hi].mean())) - 1, 4)
                for lo, hi in _buckets(diff.shape[1])}
        row["elapsed_s"] = round(time.perf_counter() - t0)
        rows.append(row)
        print(json.dumps(row), flush=True)

    def build(factors, rank, rope_heads):
        state, _ = convert_state(model, factors, rank)
        config = converted_config(ckpt.config, cfg, rank, rope_heads, has_q_bias(factors[0]),
                                  rope_pairs_of(factors))
        return build_converted(config, state, torch.float32)

    selects = [x.strip() for x in a.rope_select.split(",") if x.strip()]
    for rope_heads in _ints(a.rope_heads):
        check_convertible(model, rope_heads, None)
        for select in selects:
            slots = rope_slots(model, sigmas, MLAScheme(rope_heads=rope_heads,
                                                        rope_select=select,
                                                        rope_span=a.rope_span))
            for k_weight in (float(x) for x in a.k_weights.split(",")):
                factors = [layer_factors(layer, s, cfg, rope_heads, k_weight, slot)
                           for layer, s, slot in zip(model.backbone.layers, sigmas, slots)]
                full = factors[0].wz.shape[0]
                for rank in _ints(a.ranks):
                    if rank <= full:
                        measure(build(factors, rank, rope_heads), rank, rope_heads,
                                select=select, k_weight=k_weight)
    if a.distill:  # what `qserve quantize --mla RANK --mla-distill STEPS` converts
        import tempfile

        rank, steps = (int(x) for x in a.distill.split(":")[:2])
        with tempfile.TemporaryDirectory() as tmp:
            report = convert_source(src.checkpoint_dir, MLAScheme(
                rank=rank, rope_heads=a.distill_rope_heads, rope_select=selects[-1],
                rope_span=a.rope_span, distill_steps=steps, distill_lr=a.distill_lr,
                distill_model_steps=model_steps, distill_model_lr=a.distill_model_lr,
                distill_model_rows=a.distill_model_rows,
                distill_model_seq_len=a.distill_model_len), cal, held,
                Path(tmp) / "converted", lambda msg: None, model_rows)
            converted = load_model(open_checkpoint(Path(tmp) / "converted"), torch.float32)
        print(report.table(), flush=True)
        measure(converted, rank, a.distill_rope_heads, steps, model_steps, selects[-1],
                report.k_weight)
        rows[-1].update(k_weight=report.k_weight, seconds=report.seconds,
                        ppl_increase_before_distill=report.ppl_increase_before_distill,
                        ppl_increase_after_layer_distill=report.ppl_increase_after_layer_distill,
                        model_distill=report.model_distill)
    if a.fp8_scales:
        factors = [layer_factors(layer, s, cfg, 1)
                   for layer, s in zip(model.backbone.layers, sigmas)]
        for line in _fp8_scales(build(factors, a.fp8_scales, 1), a.fp8_scales + 1, cal[:4],
                                held):
            print(line, flush=True)
    print(f"\nsource {a.source}: {cfg.num_layers} layers, {cfg.num_kv_heads} kv heads x "
          f"{cfg.head_dim}; bf16 GQA cache {gqa_bytes} B/token, FP8 GQA {gqa_bytes // 2}; "
          f"held-out {a.heldout} x {a.seq_len} tokens, {len(prompts)} prompts x {a.tokens} "
          f"greedy tokens; {a.threads} threads, {time.perf_counter() - t0:.0f}s")
    print("| RoPE heads (select) | rank | distill steps (layer / model) | KV B/token (FP8 latent) | "
          "vs bf16 GQA | token ppl vs source | greedy token agreement | identical continuations |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rope_heads']} ({r['rope_select']}) | {r['rank']} | {r['distill_steps']} / "
              f"{r['distill_model_steps']} | "
              f"{r['kv_bytes_per_token']} | {r['vs_bf16_gqa']:.3f}x | {r['ppl_increase']:+.1%} | "
              f"{r['token_agreement']:.1%} | {r['sequences_identical']:.0%} |")
    if gate.shape[0]:
        print(f"\ngates' held-out text, {gate.shape[0]} windows x {gate.shape[1]} tokens: token "
              "ppl vs source, overall and by position in the window")
        for r in rows:
            by = ", ".join(f"{k}: {v:+.1%}" for k, v in r["gate_text_by_position"].items())
            print(f"  rope {r['rope_heads']} {r['rope_select']} key weight {r['k_weight']} "
                  f"rank {r['rank']} distill {r['distill_steps']} / "
                  f"{r['distill_model_steps']}: {r['gate_text_ppl_increase']:+.1%} ({by})")
    if a.out:
        write_json_atomic(a.out, {"source": a.source, "rows": rows}, indent=2)
    return 0


def _gate_windows(tok, count: int, window: int) -> torch.Tensor:
    """[count, window] int64: consecutive windows of the gates' held-out documents (each
    tokenized on its own, BOS first where the tokenizer adds it), in file order."""
    from ...evals.golden_text import load_heldout_text

    out: list[list[int]] = []
    for text in load_heldout_text() if count else []:
        ids = tok.encode(text, add_special_tokens=True)
        out += [ids[s:s + window] for s in range(0, len(ids) - window + 1, window)]
    if len(out) < count:
        raise SystemExit(f"--gate-text {count}: the held-out text has {len(out)} windows of "
                         f"{window} tokens; ask for fewer or a shorter --gate-window.")
    return torch.tensor(out[:count], dtype=torch.int64).reshape(count, window)


def _buckets(n: int) -> list[tuple[int, int]]:
    """Position ranges [lo, hi) of n scored positions: 0-128, 128-512, then doublings."""
    edges = [0, 128] + [e for e in (512, 1024, 2048, 4096, 8192) if e < n] + [n]
    edges = sorted({min(e, n) for e in edges})
    return list(zip(edges, edges[1:]))


class _LatentAmax:
    """Records per layer the largest |c_kv| and |RoPE key| of the cached vectors."""

    def __init__(self, latent: int):
        self.latent, self.amax = latent, {}

    def forward(self, spec, q, k, v, meta):
        a = self.amax.setdefault(spec.layer_idx, [0.0, 0.0])
        a[0] = max(a[0], float(k[..., :self.latent].abs().max()))
        a[1] = max(a[1], float(k[..., self.latent:].abs().max()))
        return DenseAttention().forward(spec, q, k, v, meta)


class _Fp8Latent:
    """The cached vector through FP8 with static scales from the recorded maxima: one for
    the whole vector, or one for c_kv and one for the RoPE key."""

    def __init__(self, observed: _LatentAmax, per_part: bool):
        self.observed, self.per_part = observed, per_part

    def forward(self, spec, q, k, v, meta):
        from ...kernels.fp8 import FP8_MAX, quantize_fp8

        a_c, a_pe = self.observed.amax[spec.layer_idx]
        n = self.observed.latent
        if self.per_part:
            scale = torch.cat((torch.full((n,), a_c / FP8_MAX),
                               torch.full((k.shape[-1] - n,), a_pe / FP8_MAX)))
        else:
            scale = torch.full((k.shape[-1],), max(a_c, a_pe) / FP8_MAX)
        kq = (quantize_fp8(k, scale).float() * scale).to(k.dtype)
        return DenseAttention().forward(spec, q, kq, kq, meta)


def _fp8_scales(converted, latent: int, cal: torch.Tensor, held: torch.Tensor) -> list[str]:
    import math

    observed = _LatentAmax(latent)
    with torch.no_grad():
        for r in cal:
            converted(r, torch.arange(r.numel()), AttentionMetadata.from_lengths([r.numel()]),
                      observed)
    ratios = [observed.amax[i][0] / observed.amax[i][1] for i in sorted(observed.amax)]
    fp32 = _nll_through(converted, held, lambda spec, q, k, v, meta:
                        DenseAttention().forward(spec, q, k, v, meta))
    lines = [f"FP8 latent, rank {latent - 1}: max|c_kv| / max|RoPE key| per layer "
             f"{min(ratios):.2f}..{max(ratios):.2f}"]
    for name, per_part in (("one scale", False), ("a scale each", True)):
        nll = _nll_through(converted, held, _Fp8Latent(observed, per_part).forward)
        lines.append(f"  {name}: token perplexity {math.exp(nll - fp32) - 1:+.2%} vs the fp32 "
                     "latent")
    return lines


class _Backend:
    """An attention backend from a forward function; not DenseAttention, so the model
    takes the absorbed (cached) form."""

    def __init__(self, forward):
        self.forward = forward


def _nll_through(model, rows, forward) -> float:
    return token_nll(model, rows, _Backend(forward))


if __name__ == "__main__":
    raise SystemExit(main())
