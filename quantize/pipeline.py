"""`qserve quantize`: source checkpoint + calibration text -> verified FP8 artifact.

    resolve source -> tokenizer -> calibration set -> block-by-block calibration
    -> tensors streamed into a temp dir -> config + manifest -> block-by-block check -> rename
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..calib.dataset import load_calibration_set
from .artifact_writer import DEFAULT_SHARD_BYTES, ArtifactWriter, move_into_place
from .calibrator import BlockwiseCalibrator, CalibrationSummary
from ..runtime.formats.checkpoint import open_checkpoint
from .compressed_tensors import build_quantization_config
from ..runtime.formats.manifest import Manifest, directory_digest
from .recipe import Recipe
from ..runtime.formats.sources import resolve_source
from .verifier import verify_artifact


@dataclass
class QuantizeReport:
    out_dir: Path
    summary: CalibrationSummary
    source_bytes: int  # bf16 reference checkpoint weights
    artifact_bytes: int  # artifact weights
    seconds: float
    calibration_digest: str
    num_samples: int
    seq_len: int
    budget: object | None = None  # quantize/budget.BudgetResult when a budget chose parts
    mla: object | None = None  # quantize/mla_stage.MLAReport when attention was converted
    dynamic_inputs: bool = False  # the recipe's activations.dynamic


def source_digest(ckpt_dir: Path) -> dict:
    """The GGUF file's sha256 for converted sources, else a digest of the HF files."""
    meta = ckpt_dir / "gguf_source.json"
    if meta.is_file():
        info = json.loads(meta.read_text())
        return {"kind": "gguf", "file": info.get("source_file"),
                "sha256": info.get("source_sha256")}
    names = [p.name for p in ckpt_dir.iterdir()
             if p.suffix in (".safetensors", ".json") and p.is_file()]
    return {"kind": "hf", "sha256": directory_digest(ckpt_dir, names)}


def _weights_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def calibration_dtype() -> torch.dtype:
    """The compute dtype of calibration on this CPU: bf16 where its matmuls are native
    (oneDNN bf16), fp32 elsewhere (AVX2, where bf16 matmuls are emulated and several times
    slower than fp32 at calibration shapes). From a bf16 source the weight scales, and the RTN
    weights, do not depend on it; activation and KV scales, and GPTQ's roundings through
    its Hessian, see the activations in this dtype."""
    from ..kernels.cpu_linear import bulk_matmul_dtype

    return bulk_matmul_dtype()


def quantize(source: str, out_dir: str | Path, recipe: Recipe, calib: str | None = None,
             force: bool = False, dtype: torch.dtype | None = None,
             progress: Callable[[str], None] | None = None,
             shard_bytes: int = DEFAULT_SHARD_BYTES, draft=None) -> QuantizeReport:
    """Quantize `source` into an artifact at `out_dir`. dtype: the calibration's compute
    dtype (default: calibration_dtype() for this CPU), recorded in the manifest.

    Memory: one decoder block's weights, the calibration activations, the embedding and
    head, plus up to `shard_bytes` of finished tensors waiting to be written as a shard.
    """
    from ..runtime.tokenizer import Tokenizer

    if recipe.budget.enabled:
        return _quantize_to_budget(source, Path(out_dir), recipe, calib, force, dtype,
                                   progress or (lambda msg: None), shard_bytes, draft)
    t0 = time.perf_counter()
    dtype = dtype or calibration_dtype()
    progress = progress or (lambda msg: None)
    out = Path(out_dir)
    writer = ArtifactWriter(out, force=force, shard_bytes=shard_bytes)  # refuses an existing out_dir
    progress("loading source")
    src = resolve_source(source)
    ckpt = open_checkpoint(src.checkpoint_dir)
    tok = Tokenizer.from_dir(src.checkpoint_dir, ckpt.generation_config)
    params = recipe.calibration
    progress("tokenizing calibration data")
    calib_set, samples, add_bos = calibration_rows(tok, recipe, calib, params.num_samples,
                                                    params.seq_len, params.seed)

    ckpt_dir, scratch, mla = src.checkpoint_dir, None, None
    try:
        if recipe.mla.enabled:  # the converted model is the source from here on
            ckpt_dir, scratch, mla = _convert_to_mla(src.checkpoint_dir, ckpt.config, tok,
                                                     recipe, calib, out, progress)
            ckpt = open_checkpoint(ckpt_dir)
        with writer:
            calibrator = BlockwiseCalibrator(ckpt, recipe, dtype, progress=progress)
            summary = calibrator.run(samples, writer.add_tensors)
            writer.copy_from(ckpt_dir)
            config = dict(ckpt.config)
            if summary.lm_head_quantized and config.get("tie_word_embeddings", False):
                config["tie_word_embeddings"] = False  # the head now has its own FP8 weight
            config["quantization_config"] = build_quantization_config(
                recipe, summary.ignored_modules,
                [st.name for st in summary.linears if recipe.is_weight_only(st.name)])
            manifest = Manifest(
                source={"spec": source, "architecture": open_checkpoint(
                        src.checkpoint_dir).architecture if mla else ckpt.architecture,
                        **source_digest(src.checkpoint_dir)},
                recipe=recipe.to_dict(),
                calibration={"digest": calib_set.digest, "source": calib_set.source,
                             "num_samples": int(samples.shape[0]), "seq_len": int(samples.shape[1]),
                             "bos_prepended": add_bos, "compute_dtype": str(dtype).removeprefix("torch.")},
                summary={"quantized_linears": len(summary.quantized_modules),
                         "ignored": summary.ignored_modules,
                         "lm_head_quantized": summary.lm_head_quantized},
                mla=mla.to_dict() if mla else None,
            )
            complete = None
            if draft is not None:  # a quantize/draft.DraftSpec
                from .draft import prepare_draft

                def complete(tmp: Path) -> None:  # the target artifact is whole in tmp by now
                    manifest.draft = prepare_draft(draft, tmp, target_dir=src.checkpoint_dir,
                                                   recipe=recipe, calib=calib, dtype=dtype,
                                                   samples=samples, progress=progress)
            progress("verifying")
            path = writer.finish(config, manifest,
                                 verify=lambda d: verify_artifact(d, dtype, samples[0, :64]),
                                 complete=complete)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return QuantizeReport(path, summary, _weights_bytes(src.checkpoint_dir), _weights_bytes(path),
                          time.perf_counter() - t0, calib_set.digest, int(samples.shape[0]),
                          int(samples.shape[1]), mla=mla,
                          dynamic_inputs=recipe.activations.dynamic)


def _convert_to_mla(source_dir: Path, config: dict, tok, recipe: Recipe, calib, out: Path,
                    progress):
    """(the converted checkpoint's dir, the scratch dir holding it, the MLAReport)."""
    import tempfile

    from .mla_stage import convert_source

    m = recipe.mla
    cal_rows, held, model_rows = mla_rows(tok, config, recipe, calib, 4)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.mla-", dir=out.parent))
    try:
        report = convert_source(source_dir, m, cal_rows, held, scratch / "converted", progress,
                                model_rows)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return scratch / "converted", scratch, report


def mla_rows(tok, config: dict, recipe: Recipe, calib: str | None, heldout: int):
    """The MLA stage's rows of the calibration corpus, `recipe.mla`'s lengths and counts:
    (statistics' rows [num_samples, seq_len], held-out rows [heldout, seq_len] drawn first
    with the next seed, whole-model distillation rows [<= distill_model_rows,
    min(distill_model_seq_len, the model's context)] or None without that stage). No
    training row overlaps a held-out one's text, whatever its length."""
    m, seed = recipe.mla, recipe.calibration.seed
    held_set, held, _ = calibration_rows(tok, recipe, calib, heldout, m.seq_len, seed + 1)
    _, cal_rows, _ = calibration_rows(tok, recipe, calib, m.num_samples, m.seq_len, seed,
                                      avoid=held_set.spans)
    model_rows = None
    if m.distill_model_steps:  # long rows: the model must fit positions the gates read
        context = int(config.get("max_position_embeddings", 2048))
        _, model_rows, _ = calibration_rows(
            tok, recipe, calib, m.distill_model_rows, min(m.distill_model_seq_len, context),
            seed, avoid=held_set.spans, up_to=True)
    return cal_rows, held, model_rows


def calibration_rows(tok, recipe: Recipe, calib: str | None, num_samples: int, seq_len: int,
                      seed: int, avoid=(), up_to: bool = False):
    """(the calibration set, its rows [N, seq_len] int64 with BOS first where the model
    adds it, whether it does): the model always sees BOS first at run time, so calibration
    and the budget's text do too. `avoid`, `up_to`: as `load_calibration_set`'s."""
    bos = tok.hf.token_to_id(tok.bos_token) if tok.bos_token else None
    add_bos = bos is not None and tok.encode("a", add_special_tokens=True)[:1] == [bos]
    calib_set = load_calibration_set(
        calib, lambda text: tok.encode(text, add_special_tokens=False), num_samples=num_samples,
        seq_len=seq_len - (1 if add_bos else 0), seed=seed,  # room for BOS at each start
        text_field=recipe.calibration.text_field,
        separator=tok.eos_token_ids[0] if tok.eos_token_ids else None, avoid=avoid, up_to=up_to)
    rows = calib_set.samples
    if add_bos:
        rows = torch.cat([torch.full((rows.shape[0], 1), bos, dtype=torch.int64), rows], 1)
    return calib_set, rows, add_bos


def calibration_text(source: str, recipe: Recipe, calib: str | None, num_samples: int,
                     seq_len: int, seed: int) -> tuple[torch.Tensor, int]:
    """([N, seq_len] int64 rows of the calibration corpus, as calibration draws them; the
    words they hold)."""
    from ..runtime.tokenizer import Tokenizer

    src = resolve_source(source)
    ckpt = open_checkpoint(src.checkpoint_dir)
    tok = Tokenizer.from_dir(src.checkpoint_dir, ckpt.generation_config)
    _, rows, add_bos = calibration_rows(tok, recipe, calib, num_samples, seq_len, seed)
    skip = 1 if add_bos else 0
    words = sum(len(tok.decode(r[skip:].tolist()).split()) for r in rows)
    return rows, max(words, 1)


def _quantize_to_budget(source, out: Path, recipe: Recipe, calib, force, dtype, progress,
                        shard_bytes, draft) -> QuantizeReport:
    """quantize/budget.py's search: quantize every part to FP8 into a scratch directory,
    measure, choose, then quantize the chosen recipe into `out` and measure that."""
    import shutil
    import tempfile
    from dataclasses import replace

    from ..runtime.decode_rate import decode_rates
    from ..runtime.layers.fp8_linear import Fp8Linear
    from .budget import BudgetSpec, chosen_recipe, enumerate_parts, search
    from .part_probe import PartProbe
    from .recipe import BudgetScheme

    t0 = time.perf_counter()
    b = recipe.budget
    plain = replace(recipe, budget=BudgetScheme())
    if out.exists() and not force:  # refuse now, not after the search
        ArtifactWriter(out, force=False)
    # other samples of the calibration corpus than calibration's (never the gates' text)
    rows, words = calibration_text(source, recipe, calib, b.num_samples, b.seq_len,
                                   recipe.calibration.seed + 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.budget-", dir=out.parent))
    try:
        progress("budget: quantizing the recipe as it is")
        base_report = quantize(source, scratch / "all-fp8", plain, calib, dtype=dtype,
                               progress=progress, shard_bytes=shard_bytes)
        probe = PartProbe(str(scratch / "all-fp8"), source, rows, words)
        model = probe.art.model
        quantized = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
        cfg = model.config
        kv_layers = sorted(probe.art.kv_scales)
        kv_cost = len(kv_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * b.kv_context
        parts = enumerate_parts(model, quantized, kv_layers, kv_cost)
        result = search(probe, parts, BudgetSpec(b.ppl, b.kl), progress)
        del probe, model
        progress("budget: timing the decode of the artifact as quantized")
        result.decode_base = decode_rates(str(scratch / "all-fp8"))
        if not result.chosen and draft is None:
            # the plain recipe meets the budget: the artifact quantizing it again would
            # write is this one (same recipe, same calibration), already measured
            progress("budget: met with every part as the recipe has it; keeping that artifact")
            move_into_place(scratch / "all-fp8", out)
            result.final, result.decode_final = result.base, result.decode_base
            report = replace(base_report, out_dir=out)
            _record_budget(out, recipe, result, rows, words)
            return replace(report, seconds=time.perf_counter() - t0, budget=result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    final = chosen_recipe(plain, result.chosen)
    progress("budget: quantizing the chosen recipe")
    report = quantize(source, out, final, calib, force, dtype, progress, shard_bytes, draft)
    # the budget measured on the artifact written (its calibration saw the chosen parts)
    final_m = PartProbe(str(report.out_dir), source, rows, words).measure()
    result.final = final_m
    progress("budget: timing the written artifact's decode")
    result.decode_final = decode_rates(str(report.out_dir))
    _record_budget(report.out_dir, recipe, result, rows, words)
    return replace(report, seconds=time.perf_counter() - t0, budget=result)


def _record_budget(out: Path, requested: Recipe, result, rows, words: int) -> None:
    """The budget's search and its measurement of the artifact at `out`, into its manifest.
    The manifest's `recipe` is the one quantized (the chosen parts, no budget); the recipe
    asked for, budget included, goes beside it, so a built-in recipe with a budget knows
    its artifact (quantize/builtin_artifact.made_with)."""
    manifest = Manifest.read(out)
    manifest.summary["budget"] = {**result.to_dict(), "requested_recipe": requested.to_dict(),
                                  "tokens": int(rows.numel()),
                                  "words": words,
                                  "artifact": {"kl": result.final.kl,
                                               "ppl_increase": result.final.ppl_increase}}
    manifest.write(out)


def format_report(r: QuantizeReport) -> str:
    """The summary table printed at the end of `qserve quantize`."""
    s = r.summary
    lines = [f"{'layer':<44} {'shape':>12} {'in_scale':>10} {'w_scale min..max':>22}"]
    in_scales = sorted(st.input_scale for st in s.linears if st.input_scale is not None)
    median = in_scales[len(in_scales) // 2] if in_scales else 0.0
    outliers = [st.name for st in s.linears
                if median and st.input_scale is not None and st.input_scale > 20 * median]
    unscaled = "per token" if r.dynamic_inputs else "bf16 in"  # a linear without input_scale
    for st in s.linears:
        flag = "  << outlier input" if st.name in outliers else ""
        in_scale = f"{st.input_scale:.3e}" if st.input_scale is not None else \
            "bf16 in" if st.weight_only else unscaled
        lines.append(f"{st.name:<44} {str(list(st.shape)):>12} {in_scale:>10} "
                     f"{st.weight_scale_min:>10.2e}..{st.weight_scale_max:<10.2e}{flag}")
    if s.kv_scales:
        ks = [x for k, _ in s.kv_scales.values() for x in k]
        vs = [x for _, v in s.kv_scales.values() for x in v]
        lines.append(f"KV cache scales over {len(s.kv_scales)} layers: k {min(ks):.3e}..{max(ks):.3e}, "
                     f"v {min(vs):.3e}..{max(vs):.3e}")
    for target, (lo, hi) in s.smoothing.items():
        lines.append(f"smoothing {target}: factors {lo:.3e}..{hi:.3e}")
    weight_only = sum(st.weight_only for st in s.linears)
    lines.append(f"quantized linears: {len(s.quantized_modules)}"
                 + (f" ({weight_only} weight-only, bf16 input)" if weight_only else "")
                 + (", dynamic per-token input scales" if r.dynamic_inputs else "")
                 + "; kept in bf16: "
                 f"{', '.join(s.ignored_modules) or 'none'}; inputs > 20x median scale: "
                 f"{len(outliers)}")
    if r.budget is not None:
        lines += r.budget.table()
    if r.mla is not None:
        lines.append(r.mla.table())
    lines.append(f"weights: {r.source_bytes / 2**20:.1f} MiB source -> {r.artifact_bytes / 2**20:.1f} "
                 f"MiB artifact ({r.artifact_bytes / max(r.source_bytes, 1):.0%}); calibration "
                 f"{r.num_samples} x {r.seq_len} tokens; {r.seconds:.1f}s")
    lines.append(f"artifact: {r.out_dir}")
    return "\n".join(lines)
