"""Quantize a bf16 checkpoint with llm-compressor's FP8 static W8A8 scheme and an FP8 KV
cache scheme, on token rows given as a file (or its FP8_DYNAMIC preset): the anchor
qserve's own quantization is compared with (evals/compare_llmcompressor.py runs this).

Runs in llm-compressor's own environment (it pins its transformers and compressed-tensors;
qserve is not imported here):

    LLMC/bin/python llmcompressor_fp8.py --source BF16_DIR --rows ROWS.json --out OUT
        [--weights tensor|channel|dynamic]

ROWS.json: {"input_ids": [[int, ...], ...]}, the calibration rows (equal lengths, BOS first
where the model adds it) that qserve's quantize draws for the same model. --weights:
"tensor" is llm-compressor's FP8 preset (one scale per weight tensor); "channel" the same
with one scale per output channel, as qserve's default recipe. Both keep static per-tensor
input scales, static per-tensor k/v scales and the LM head in bf16. "dynamic" is the
FP8_DYNAMIC preset: per-channel weights, per-token input scales at run time, no KV scheme
(bf16 KV) and no calibration (the rows are not read), the layout vLLM's CPU build serves
and qserve's recipe `activations: {dynamic: true}` writes. OUT is written by
llm-compressor (save_compressed) with the tokenizer; the script refuses an existing OUT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def scheme(weights: str) -> dict:
    """compressed-tensors config group for FP8 weights (`weights` strategy) and static
    per-tensor FP8 inputs on every Linear."""
    return {"group_0": {"targets": ["Linear"],
                        "weights": {**FP8, "strategy": weights, "observer": "minmax"},
                        "input_activations": {**FP8, "strategy": "tensor",
                                              "observer": "minmax"}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="bf16 HF checkpoint directory")
    ap.add_argument("--rows", required=True, help="calibration token rows (JSON)")
    ap.add_argument("--out", required=True, help="output directory (must not exist)")
    ap.add_argument("--weights", choices=("tensor", "channel", "dynamic"), default="tensor")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"{out}: exists; choose a new output directory.", file=sys.stderr)
        return 2
    rows = json.loads(Path(args.rows).read_text())["input_ids"]
    if not rows or len({len(r) for r in rows}) != 1:
        print(f"{args.rows}: need a non-empty list of equal-length token rows.", file=sys.stderr)
        return 2

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    data = Dataset.from_dict({"input_ids": rows,
                              "attention_mask": [[1] * len(r) for r in rows]})
    kv = {**FP8, "strategy": "tensor"}
    if args.weights == "dynamic":
        recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    elif args.weights == "tensor":
        recipe = QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"],
                                      kv_cache_scheme=kv)
    else:
        recipe = QuantizationModifier(config_groups=scheme("channel"), ignore=["lm_head"],
                                      kv_cache_scheme=kv)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if args.weights == "dynamic":
        oneshot(model=model, recipe=recipe)  # nothing to calibrate
    else:
        oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(rows),
                max_seq_length=len(rows[0]), shuffle_calibration_samples=False,
                pipeline="sequential")
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    for name in ("generation_config.json",):
        if (Path(args.source) / name).is_file() and not (tmp / name).is_file():
            shutil.copy(Path(args.source) / name, tmp / name)
    tmp.rename(out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
