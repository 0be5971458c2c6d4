"""`qserve.json`: the manifest that says what an artifact is and proves it is intact.

    format, format_version     what reads it
    source                     what was quantized: spec, architecture, sha256 digest
    recipe                     the validated recipe, as a dict
    calibration                calibration set digest, source, samples x seq_len
    files                      sha256 of every other file in the artifact
    versions                   qserve, torch, safetensors, ... at quantization time
    summary                    sizes, scale ranges, time (informational)
    eval                       the gate report, once `qserve eval` has passed it (later)
    draft                      the draft for speculative decoding and its files' sha256

The reader refuses an artifact whose files do not match (`verify_files`), naming the file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..atomic_file import write_text_atomic
from .errors import QserveError

MANIFEST_FILE = "qserve.json"
FORMAT = "qserve-fp8-artifact"
FORMAT_VERSION = 1
_CHUNK = 4 << 20


class ArtifactError(QserveError):
    """An artifact is missing, incomplete, tampered with, or of an unknown format."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def directory_digest(root: Path, names: list[str]) -> str:
    """One sha256 over (name, sha256(file)) for the named files of a directory."""
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode() + b"\0" + sha256_file(root / name).encode() + b"\n")
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    out = {}
    for pkg in ("qserve", "torch", "safetensors", "tokenizers", "gguf", "datasets", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


@dataclass
class Manifest:
    source: dict
    recipe: dict
    calibration: dict
    files: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=package_versions)
    summary: dict = field(default_factory=dict)
    eval: dict | None = None
    draft: dict | None = None  # speculative-decoding draft (quantize/draft.py), if any
    mla: dict | None = None  # GQA -> MLA conversion (quantize/mla_stage.py), if any
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def read(cls, root: Path) -> "Manifest":
        path = root / MANIFEST_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ArtifactError(f"{path}: missing; {root} is not a qserve artifact "
                                "(make one with `qserve quantize`).") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path}: not valid JSON ({e}).") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ArtifactError(f"{path}: not a qserve artifact manifest.")
        if data.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{path}: format version {data.get('format_version')} is not "
                                f"supported (this qserve reads version {FORMAT_VERSION}).")
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ArtifactError(f"{path}: incomplete manifest ({e}).") from None

    def write(self, root: Path) -> None:
        """Write atomically (temp file + rename)."""
        write_text_atomic(root / MANIFEST_FILE, self.to_json())

    def record_files(self, root: Path) -> None:
        self.files = {p.name: sha256_file(p) for p in sorted(root.iterdir())
                      if p.is_file() and p.name != MANIFEST_FILE}

    def verify_files(self, root: Path) -> None:
        """Raise ArtifactError naming the first file that is missing, extra or changed."""
        present = {p.name for p in root.iterdir() if p.is_file() and p.name != MANIFEST_FILE}
        for name, digest in sorted(self.files.items()):
            if name not in present:
                raise ArtifactError(f"{root / name}: listed in {MANIFEST_FILE} but missing.")
            if sha256_file(root / name) != digest:
                raise ArtifactError(f"{root / name}: sha256 does not match {MANIFEST_FILE}; "
                                    "the file was changed or corrupted. Re-run `qserve quantize`.")
        extra = sorted(n for n in present - set(self.files) if n.endswith((".safetensors", ".json")))
        if extra:
            raise ArtifactError(f"{root / extra[0]}: not listed in {MANIFEST_FILE}; refusing an "
                                "artifact with unaccounted weight or config files.")
