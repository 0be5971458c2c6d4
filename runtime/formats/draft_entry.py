"""The draft entry of an artifact's manifest: a draft model's folder or a draft head's file,
checked against their recorded digests, and the speculative options they imply. Written
by quantize/draft.py; read by the loader and `qserve serve`."""

from __future__ import annotations

from pathlib import Path

from .manifest import MANIFEST_FILE, ArtifactError, Manifest, sha256_file


def read_draft(root: Path, manifest: Manifest | None = None) -> dict | None:
    """The manifest's draft entry with file paths made absolute, after checking every draft
    file's sha256 (ArtifactError naming the file otherwise). None without a draft."""
    manifest = manifest or Manifest.read(root)
    entry = getattr(manifest, "draft", None)
    if not entry:
        return None
    entry = dict(entry)
    if entry.get("kind") == "draft_model":
        path = root / entry["dir"]
        if sha256_file(path / MANIFEST_FILE) != entry["manifest_sha256"]:
            raise ArtifactError(f"{path / MANIFEST_FILE}: sha256 does not match the artifact's "
                                "manifest; the draft was changed. Re-run `qserve quantize`.")
        entry["path"] = str(path)
    head = entry.get("head")
    if head:
        path = root / head["file"]
        if not path.is_file() or sha256_file(path) != head["sha256"]:
            raise ArtifactError(f"{path}: missing or sha256 does not match the artifact's "
                                "manifest. Re-run `qserve quantize`.")
        entry["head"] = str(path)
    return entry


def speculative_options(entry: dict) -> tuple[str, int, dict]:
    """(proposer name, k, proposer options) of a `read_draft` entry."""
    opts = {}
    if entry["kind"] == "draft_model":
        opts["path"] = entry["path"]
    elif entry["kind"] == "early_exit":
        opts["num_layers"] = entry["num_layers"]
        if entry.get("head"):
            opts["head"] = entry["head"]
    elif entry["kind"] == "hidden_draft":
        opts["head"] = entry["head"]
    return entry["kind"], int(entry["num_speculative_tokens"]), opts

