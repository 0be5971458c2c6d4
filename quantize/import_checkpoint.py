"""`qserve import`: adopt a compressed-tensors FP8 checkpoint made by another tool (e.g.
llm-compressor) as a qserve artifact, by writing its `qserve.json` manifest.

    check the scheme is one qserve serves -> check it was made from SOURCE (architecture)
    -> manifest: SOURCE as the reference, the tool's quantization_config as the recipe,
       every file's sha256 -> written atomically beside the files (nothing else changes)

The weights are used as they are: qserve, vLLM and SGLang read the same files. SOURCE is
the bf16 model the checkpoint was quantized from; `qserve eval` and `qserve compare` use it
as the reference.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.formats.artifact_reader import is_artifact
from ..runtime.formats.checkpoint import open_checkpoint
from ..runtime.formats.compressed_tensors import parse_quantization_config
from ..runtime.formats.errors import QserveError
from ..runtime.formats.manifest import Manifest
from ..runtime.formats.sources import resolve_source
from .pipeline import source_digest


def import_checkpoint(path: str | Path, source: str, force: bool = False) -> Manifest:
    """Write `path`/qserve.json for the compressed-tensors checkpoint at `path`, quantized
    from `source` (a built-in model name or a bf16 checkpoint). QserveError, with nothing
    written, when the checkpoint is not one qserve serves or does not match the source;
    an existing manifest is kept unless `force`."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise QserveError(f"{root}: no config.json; point at the directory of a "
                          "compressed-tensors checkpoint.")
    if is_artifact(root) and not force:
        raise QserveError(f"{root}: already a qserve artifact (qserve.json); pass --force "
                          "to write its manifest again.")
    ckpt = open_checkpoint(root)
    if "quantization_config" not in ckpt.config:
        raise QserveError(f"{root}/config.json: no quantization_config; this is not a "
                          "quantized checkpoint (quantize it with `qserve quantize`).")
    parse_quantization_config(ckpt.config, str(root / "config.json"))  # a scheme we serve
    src = resolve_source(source)
    ref = open_checkpoint(src.checkpoint_dir)
    if ref.architecture != ckpt.architecture:
        raise QserveError(f"{root}: a {ckpt.architecture} checkpoint, but {source} is "
                          f"{ref.architecture}; name the model it was quantized from.")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if ref.config.get(key) != ckpt.config.get(key):
            raise QserveError(f"{root}: {key} {ckpt.config.get(key)} differs from {source}'s "
                              f"{ref.config.get(key)}; name the model it was quantized from.")
    qc = ckpt.config["quantization_config"]
    manifest = Manifest(
        source={"spec": source, "architecture": ref.architecture,
                **source_digest(src.checkpoint_dir)},
        recipe={"imported": {"quant_method": qc.get("quant_method"),
                             "version": qc.get("version"), "quantization_config": qc}},
        calibration={},
        summary={"imported": True})
    manifest.record_files(root)
    manifest.write(root)
    return manifest


__all__ = ["import_checkpoint"]
