"""`qserve quantize`: source checkpoint + calibration text -> verified FP8 artifact.

    resolve source -> tokenizer -> calibration set -> block-by-block calibration
    -> tensors streamed into a temp dir -> config + manifest -> block-by-block check -> rename
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..calib.dataset import load_calibration_set
from .artifact_writer import DEFAULT_SHARD_BYTES, ArtifactWriter
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


def _source_digest(ckpt_dir: Path) -> dict:
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
    bos = tok.hf.token_to_id(tok.bos_token) if tok.bos_token else None
    add_bos = bos is not None and tok.encode("a", add_special_tokens=True)[:1] == [bos]
    seq_len = params.seq_len - (1 if add_bos else 0)  # room for BOS at each sample's start
    progress("tokenizing calibration data")
    calib_set = load_calibration_set(
        calib, lambda text: tok.encode(text, add_special_tokens=False),
        num_samples=params.num_samples, seq_len=seq_len, seed=params.seed,
        text_field=params.text_field, separator=tok.eos_token_ids[0] if tok.eos_token_ids else None)
    samples = calib_set.samples
    if add_bos:  # the model always sees BOS first at run time; calibrate the same way
        samples = torch.cat([torch.full((samples.shape[0], 1), bos, dtype=torch.int64), samples], 1)

    with writer:
        calibrator = BlockwiseCalibrator(ckpt, recipe, dtype, progress=progress)
        summary = calibrator.run(samples, writer.add_tensors)
        writer.copy_from(src.checkpoint_dir)
        config = dict(ckpt.config)
        if summary.lm_head_quantized and config.get("tie_word_embeddings", False):
            config["tie_word_embeddings"] = False  # the head now has its own FP8 weight
        config["quantization_config"] = build_quantization_config(
            recipe, summary.ignored_modules,
            [st.name for st in summary.linears if st.input_scale is None])
        manifest = Manifest(
            source={"spec": source, "architecture": ckpt.architecture,
                    **_source_digest(src.checkpoint_dir)},
            recipe=recipe.to_dict(),
            calibration={"digest": calib_set.digest, "source": calib_set.source,
                         "num_samples": int(samples.shape[0]), "seq_len": int(samples.shape[1]),
                         "bos_prepended": add_bos, "compute_dtype": str(dtype).removeprefix("torch.")},
            summary={"quantized_linears": len(summary.quantized_modules),
                     "ignored": summary.ignored_modules,
                     "lm_head_quantized": summary.lm_head_quantized},
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
    return QuantizeReport(path, summary, _weights_bytes(src.checkpoint_dir), _weights_bytes(path),
                          time.perf_counter() - t0, calib_set.digest, int(samples.shape[0]),
                          int(samples.shape[1]))


def format_report(r: QuantizeReport) -> str:
    """The summary table printed at the end of `qserve quantize`."""
    s = r.summary
    lines = [f"{'layer':<44} {'shape':>12} {'in_scale':>10} {'w_scale min..max':>22}"]
    in_scales = sorted(st.input_scale for st in s.linears if st.input_scale is not None)
    median = in_scales[len(in_scales) // 2] if in_scales else 0.0
    outliers = [st.name for st in s.linears
                if median and st.input_scale is not None and st.input_scale > 20 * median]
    for st in s.linears:
        flag = "  << outlier input" if st.name in outliers else ""
        in_scale = "bf16 in" if st.input_scale is None else f"{st.input_scale:.3e}"
        lines.append(f"{st.name:<44} {str(list(st.shape)):>12} {in_scale:>10} "
                     f"{st.weight_scale_min:>10.2e}..{st.weight_scale_max:<10.2e}{flag}")
    if s.kv_scales:
        ks = [x for k, _ in s.kv_scales.values() for x in k]
        vs = [x for _, v in s.kv_scales.values() for x in v]
        lines.append(f"KV cache scales over {len(s.kv_scales)} layers: k {min(ks):.3e}..{max(ks):.3e}, "
                     f"v {min(vs):.3e}..{max(vs):.3e}")
    for target, (lo, hi) in s.smoothing.items():
        lines.append(f"smoothing {target}: factors {lo:.3e}..{hi:.3e}")
    weight_only = sum(st.input_scale is None for st in s.linears)
    lines.append(f"quantized linears: {len(s.quantized_modules)}"
                 + (f" ({weight_only} weight-only, bf16 input)" if weight_only else "")
                 + "; kept in bf16: "
                 f"{', '.join(s.ignored_modules) or 'none'}; inputs > 20x median scale: "
                 f"{len(outliers)}")
    lines.append(f"weights: {r.source_bytes / 2**20:.1f} MiB source -> {r.artifact_bytes / 2**20:.1f} "
                 f"MiB artifact ({r.artifact_bytes / max(r.source_bytes, 1):.0%}); calibration "
                 f"{r.num_samples} x {r.seq_len} tokens; {r.seconds:.1f}s")
    lines.append(f"artifact: {r.out_dir}")
    return "\n".join(lines)
