"""Check a written artifact before it is renamed into place, in bounded memory.

    every file's sha256 against the manifest (streamed)
    -> embedding, final norm and head loaded as the runtime loads them
    -> one forward pass over a calibration sample, one decoder block in memory at a time
       (each block is loaded through the runtime's FP8 loader, run, and dropped)
    -> the logits must be finite

So every tensor of the artifact is read, shape-checked and used once, and peak memory is
the embedding + head + the largest block, like calibration itself, not the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.formats.artifact_reader import open_artifact
from ..runtime.formats.errors import QserveError


def verify_artifact(path: str | Path, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """ids: [L] int64 tokens for the check forward pass -> fp32 logits [1, vocab] of the
    last token. Raises ArtifactError /
    CheckpointError for a broken file set, QserveError for non-finite logits."""
    from ..runtime.attention import AttentionMetadata, DenseAttention
    from ..runtime.fp8_kv_attention import Fp8KVAttention
    from ..runtime.layers.fp8_linear import Fp8Linear
    from ..runtime.models.loader import build_on_meta
    from ..runtime.models.quantized_loader import load_part

    artifact = open_artifact(path)  # sha256 of every file
    ckpt = artifact.checkpoint
    model = build_on_meta(ckpt)
    backbone = model.backbone
    layer_prefix = f"{model.backbone_path}.layers."
    num_layers = len(backbone.layers)

    groups: dict[int | None, list[str]] = {}  # block index (None: outside blocks) -> names
    for name in ckpt.tensor_names():
        ours = model.param_name(name) or ""
        idx = ours[len(layer_prefix):].split(".")[0] if ours.startswith(layer_prefix) else ""
        key = int(idx) if idx.isdigit() and int(idx) < num_layers else None
        groups.setdefault(key, []).append(name)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: ckpt.tensor(n) for n in names}

    load_part(model, ckpt, read(groups.get(None, [])), dtype,
              scope=lambda n: not n.startswith(layer_prefix))
    if not isinstance(model.lm_head, Fp8Linear):
        model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device="cpu")

    attn = Fp8KVAttention(DenseAttention(), artifact.kv_scales())
    meta = AttentionMetadata.single(len(ids))
    with torch.inference_mode():
        hidden, ropes = backbone.embed(ids, torch.arange(len(ids)))
        for i in range(num_layers):
            prefix = f"{layer_prefix}{i}."
            load_part(model, ckpt, read(groups.get(i, [])), dtype,
                      scope=lambda n, p=prefix: n.startswith(p))
            block = backbone.layers[i]
            hidden = block(hidden, ropes[block.rope_kind], meta, attn)
            backbone.layers[i] = block.to("meta")  # drop this block's weights
            del block
        logits = model.compute_logits(backbone.norm(hidden[-1:]))  # [1, vocab] fp32
    if not bool(torch.isfinite(logits).all()):
        raise QserveError("the quantized artifact produced non-finite logits on reload; "
                          "nothing was written. Try another observer in the recipe.")
    return logits
