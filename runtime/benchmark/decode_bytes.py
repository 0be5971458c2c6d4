"""What a decode step reads from an artifact's weights, counted from its safetensors headers.

    python -m qserve.runtime.benchmark.decode_bytes ARTIFACT [ARTIFACT ...]

A decode step of a dense model reads every weight once (however many sequences it
carries) except the token embedding, of which it reads one row per token; where the LM
head is the embedding (`tie_word_embeddings` and no tensor of its own) the step reads the
embedding whole as the head. Scales and biases count as stored. The KV cache's bytes per
token of context come from the engine (`KVCacheSpec.bytes_per_token`, printed by
`python -m qserve.runtime.benchmark.step`); this counts weights only, which is what a
recipe changes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from ..formats.checkpoint import open_checkpoint
from ..formats.errors import CheckpointError

_ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
               "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
EMBEDDING_SUFFIX = "embed_tokens.weight"


@dataclass(frozen=True)
class WeightBytes:
    """An artifact's weights split by how a decode step reads them (bytes)."""

    per_step: int    # read once a step: every linear, norm, scale and the LM head
    embedding: int   # the token embedding table (one row a token unless it is the head)
    total: int       # every stored tensor


def weight_bytes(artifact: str | Path) -> WeightBytes:
    """Count `artifact`'s tensors by dtype and shape from the safetensors headers (no
    tensor is read). Raises CheckpointError for a directory that is not a checkpoint."""
    ckpt = open_checkpoint(artifact)
    sizes: dict[str, int] = {}
    for path in ckpt.files():
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if ckpt.weight_map.get(name) != path:
                    continue
                sl = f.get_slice(name)
                dtype = sl.get_dtype()
                if dtype not in _ITEM_BYTES:
                    raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, "
                                          f"which this count does not know.")
                n = 1
                for d in sl.get_shape():
                    n *= d
                sizes[name] = n * _ITEM_BYTES[dtype]
    embedding = sum(b for n, b in sizes.items() if n.endswith(EMBEDDING_SUFFIX))
    tied = ckpt.config.get("tie_word_embeddings", False) and not any(
        n.endswith("lm_head.weight") for n in sizes)
    total = sum(sizes.values())
    per_step = total if tied else total - embedding
    return WeightBytes(per_step=per_step, embedding=embedding, total=total)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    args = ap.parse_args(argv)
    mib = 2**20
    for a in args.artifacts:
        try:
            w = weight_bytes(a)
        except CheckpointError as e:
            raise SystemExit(f"decode_bytes: {e}") from None
        print(f"{a}: {w.per_step / mib:.1f} MiB of weights read a decode step; embedding "
              f"{w.embedding / mib:.1f} MiB; all tensors {w.total / mib:.1f} MiB")


if __name__ == "__main__":
    main()
