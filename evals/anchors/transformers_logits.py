"""Next-token logits of a checkpoint as transformers (+ compressed-tensors, for quantized
ones) computes them: the independent reader an artifact is checked against
(evals/compare_llmcompressor.py runs this). Runs in the environment that has
compressed-tensors (llm-compressor's); qserve is not imported here.

    PY llmcompressor_fp8.py ... ; PY transformers_logits.py --model DIR --ids IDS.json --out OUT.pt [--dtype fp32|bf16]

IDS.json: {"input_ids": [[int, ...], ...]}; OUT.pt: {"logits": [fp32 [T, V] per row],
"quantization": what transformers reports of the model's quantization}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    rows = json.loads(Path(args.ids).read_text())["input_ids"]
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    qc = getattr(model.config, "quantization_config", None)
    logits = []
    with torch.inference_mode():
        for r in rows:
            logits.append(model(torch.tensor([r])).logits[0].float())
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save({"logits": logits, "quantization": str(qc)[:2000]}, tmp)
    tmp.rename(out)
    print(f"wrote {out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
