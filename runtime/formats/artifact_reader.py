"""Open a qserve artifact: verify the manifest, parse the scheme, give lazy tensor access.

The runtime reads artifacts only through this module. An artifact is an HF checkpoint
directory (so `Checkpoint` reads its tensors) plus `quantization_config` in config.json
and the `qserve.json` manifest, whose digests are checked before anything is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import Checkpoint, open_checkpoint
from .compressed_tensors import QuantScheme, parse_quantization_config
from .manifest import MANIFEST_FILE, ArtifactError, Manifest


@dataclass
class Artifact:
    path: Path
    manifest: Manifest
    checkpoint: Checkpoint
    scheme: QuantScheme

    @property
    def digest(self) -> str:
        """Identity of the artifact: the manifest's file digests, hashed."""
        return manifest_digest(self.manifest)

    def kv_scales(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer index -> (k_scale, v_scale), fp32 [1] or [num_kv_heads]."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for name in self.checkpoint.tensor_names():
            if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                layer = int(name.split(".layers.")[1].split(".")[0])
                out.setdefault(layer, {})[name[-7:]] = self.checkpoint.tensor(name).float()
        return {i: (d["k_scale"], d["v_scale"]) for i, d in sorted(out.items())}


def manifest_digest(manifest: Manifest) -> str:
    """The artifact digest a manifest stands for: its file digests, hashed."""
    import hashlib

    h = hashlib.sha256()
    for name, d in sorted(manifest.files.items()):
        h.update(f"{name}:{d}\n".encode())
    return h.hexdigest()


def artifact_draft(path: str | Path) -> dict | None:
    """The artifact's draft for speculative decoding (manifest `draft` entry, paths made
    absolute), its files checked against the manifest; None when it has none."""
    from .draft_entry import read_draft

    return read_draft(Path(path))


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file()


def open_artifact(path: str | Path, verify: bool = True) -> Artifact:
    """Open and (by default) verify every file's sha256 against the manifest."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory.")
    manifest = Manifest.read(root)
    if verify:
        manifest.verify_files(root)
    ckpt = open_checkpoint(root)
    scheme = parse_quantization_config(ckpt.config, str(root / "config.json"))
    return Artifact(root, manifest, ckpt, scheme)


def artifact_identity(path: str | Path) -> dict | None:
    """What pins a served artifact, for /v1/models and gateway traces: the artifact digest
    and the sha256 of the gate report recorded for these very files (None when there is
    none, or it was made for other files); None when `path` is not an artifact."""
    if not is_artifact(path):
        return None
    manifest = Manifest.read(Path(path))     # the manifest alone: the files were verified
    digest = manifest_digest(manifest)       # when the model was loaded
    rec = manifest.eval or {}
    same = rec.get("artifact_digest") == digest
    return {"artifact_digest": digest,
            "gate_report_digest": rec.get("report_sha256") if same else None,
            "gates_passed": bool(rec.get("passed")) if same else None}
