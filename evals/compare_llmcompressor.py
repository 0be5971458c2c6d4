"""qserve's FP8 artifact against llm-compressor's on the same bf16 checkpoint and the same
calibration tokens, and each read by the other side's reader.

    python -m qserve.evals.compare_llmcompressor --python LLMC/bin/python --work DIR
        [--model smollm2-135m] [--weights tensor,channel] [--qserve ARTIFACT] [--threads 2]

LLMC: a venv with llm-compressor (`python -m venv LLMC && LLMC/bin/pip install
torch==2.13.0 llmcompressor`: it pins its own transformers and compressed-tensors, so it
lives apart from qserve's). In DIR it writes the calibration rows qserve's quantize draws
for the model, runs evals/anchors/llmcompressor_fp8.py once per weight strategy (kept:
an existing output is reused; `dynamic` is llm-compressor's FP8_DYNAMIC preset, to compare
with a qserve artifact of the recipe `activations: {dynamic: true}` given as --qserve),
adopts each output with `qserve import`, and then reads
every artifact both ways: qserve's runtime (dense attention, the same path `qserve
compare` scores) and transformers + compressed-tensors (evals/anchors/transformers_logits.py)
on held-out rows, printing top-1 agreement and the largest logit difference between the
two readers, and each reader's top-1 agreement and KL against the bf16 model it reads
itself (compute in fp32: the readers' sums differ only in order, and a last-bit
difference that lands on an E4M3 rounding boundary moves that input one FP8 step, which
later layers carry on; so reader against reader is compared by quality, not bits).
Perplexity and greedy agreement against bf16 come from

    qserve compare MODEL QSERVE_ARTIFACT DIR/llmc-tensor DIR/llmc-channel --max-tokens N

(the page docs/quantization.md records both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from ..runtime.formats.sources import BUILTIN_MODELS

ANCHORS = Path(__file__).resolve().parent / "anchors"
HELD_ROWS = 16  # held-out documents, first 128 tokens of each


def _rows(model: str) -> tuple[list[list[int]], list[list[int]]]:
    """(the calibration rows qserve's quantize draws for built-in `model` under its
    built-in recipe, HELD_ROWS held-out rows of up to 128 tokens)."""
    from ..quantize.builtin_artifact import builtin_recipe
    from ..quantize.pipeline import calibration_text
    from ..runtime.formats.checkpoint import open_checkpoint
    from ..runtime.formats.sources import resolve_source
    from ..runtime.tokenizer import Tokenizer
    from .golden_text import load_heldout_text

    r = builtin_recipe(model)
    cal, _ = calibration_text(model, r, None, r.calibration.num_samples,
                              r.calibration.seq_len, r.calibration.seed)
    src = resolve_source(model)
    tok = Tokenizer.from_dir(src.checkpoint_dir, open_checkpoint(src.checkpoint_dir).generation_config)
    held = [tok.encode(t)[:128] for t in load_heldout_text()[:HELD_ROWS]]
    return cal.tolist(), held


def _qserve_logits(artifact: str, rows: list[list[int]]) -> list[torch.Tensor]:
    """fp32 compute (as transformers_logits.py's default), so the readers differ only in
    what they do with the quantized tensors."""
    from ..runtime.attention import AttentionMetadata, DenseAttention
    from ..runtime.loaded_model import load

    lm = load(artifact, torch.float32)
    out = []
    with torch.inference_mode():
        for r in rows:
            ids = torch.tensor(r)
            hidden = lm.model(ids, torch.arange(len(r)), AttentionMetadata.single(len(r)),
                              lm.attention(DenseAttention()))
            out.append(lm.model.compute_logits(hidden).float())
    return out


def _top1(a: list[torch.Tensor], b: list[torch.Tensor], total: int) -> float:
    return sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b)) / total


def _kl(p: list[torch.Tensor], q: list[torch.Tensor], total: int) -> float:
    """Mean over tokens of KL(softmax p || softmax q), fp64."""
    out = 0.0
    for x, y in zip(p, q):
        lp, lq = x.double().log_softmax(-1), y.double().log_softmax(-1)
        out += float((lp.exp() * (lp - lq)).sum())
    return out / total


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="python of the llm-compressor venv")
    ap.add_argument("--work", required=True, help="directory for rows and artifacts")
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(BUILTIN_MODELS),
                    help="a built-in model: qserve's side is its built-in artifact")
    ap.add_argument("--weights", default="tensor,channel",
                    help="llm-compressor variants, comma-separated: tensor, channel, dynamic")
    ap.add_argument("--qserve", default=None,
                    help="qserve's side (default: the model's built-in artifact)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    unknown = set(args.weights.split(",")) - {"tensor", "channel", "dynamic"}
    if unknown:
        ap.error(f"--weights: unknown variant(s) {sorted(unknown)}; use tensor, channel, dynamic")
    torch.set_num_threads(args.threads)
    from ..runtime.formats.artifact_reader import is_artifact
    from ..runtime.formats.sources import resolve_source
    from ..quantize.builtin_artifact import builtin_artifact
    from ..quantize.import_checkpoint import import_checkpoint

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cal, held = _rows(args.model)
    (work / "calibration_rows.json").write_text(json.dumps({"input_ids": cal}))
    (work / "heldout_rows.json").write_text(json.dumps({"input_ids": held}))
    source = str(resolve_source(args.model).checkpoint_dir)
    artifacts = {"qserve": args.qserve or builtin_artifact(args.model, print)}
    for w in args.weights.split(","):
        out = work / f"llmc-{w}"
        if not out.exists():
            _run([args.python, str(ANCHORS / "llmcompressor_fp8.py"), "--source", source,
                  "--rows", str(work / "calibration_rows.json"), "--out", str(out),
                  "--weights", w])
        if not is_artifact(out):
            import_checkpoint(out, args.model)
        artifacts[f"llm-compressor ({w} weights)"] = str(out)
    ref_tf = work / "tf-bf16.pt"
    _run([args.python, str(ANCHORS / "transformers_logits.py"), "--model", source,
          "--ids", str(work / "heldout_rows.json"), "--out", str(ref_tf)])
    ref = {"qserve": _qserve_logits(args.model, held),
           "transformers": torch.load(ref_tf)["logits"]}
    total = sum(len(r) for r in held)
    print(f"\n{len(held)} held-out rows, {total} tokens, fp32 compute; top-1 and mean KL "
          "(bf16 || artifact) against the bf16 model read by the same reader\n")
    print("| artifact | weights MiB | qserve: top-1, KL | transformers: top-1, KL "
          "| qserve vs transformers: top-1, max abs logit diff |")
    print("|---|---|---|---|---|")
    for name, path in artifacts.items():
        tf_out = work / f"tf-{Path(path).name}.pt"
        _run([args.python, str(ANCHORS / "transformers_logits.py"), "--model", path,
              "--ids", str(work / "heldout_rows.json"), "--out", str(tf_out)])
        got = {"qserve": _qserve_logits(path, held), "transformers": torch.load(tf_out)["logits"]}
        cells = [f"{_top1(got[r], ref[r], total):.1%}, {_kl(ref[r], got[r], total):.4f}"
                 for r in ("qserve", "transformers")]
        diff = max(float((a - b).abs().max()) for a, b in zip(got["qserve"], got["transformers"]))
        mib = sum(p.stat().st_size for p in Path(path).glob("*.safetensors")) / 2**20
        print(f"| {name} | {mib:.1f} | {cells[0]} | {cells[1]} | "
              f"{_top1(got['qserve'], got['transformers'], total):.1%}, {diff:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
