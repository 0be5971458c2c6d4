"""Convert a GGUF file into a bf16 HF checkpoint directory (the reference checkpoint).

    convert_gguf("model.gguf", "out/")             -> Path("out/")
    reference_checkpoint("model.gguf", cache_root)  -> cache_root/<name>-<sha256[:16]>/

The directory holds config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, generation_config.json and gguf_source.json (the source file's
name, size, sha256 and the converter version). `checkpoint.open_checkpoint` reads it.

Writes are atomic: everything goes into a temporary directory beside the target, which
is renamed into place only once complete. An interrupted run leaves nothing at the
target (at worst a `.<name>.tmp-*` directory beside it, which `reference_checkpoint`
removes once it is old).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file

from ..atomic_file import write_json_atomic
from .errors import CheckpointError
from .gguf_reader import GGUFFile, open_gguf
from .gguf_tokenizer import build_tokenizer_files
from .manifest import sha256_file  # noqa: F401  (re-exported for callers of this module)

# Bump when the output of a conversion changes; cached checkpoints of another version
# are converted again.
CONVERTER_VERSION = 2  # 2: Qwen2's tokenizer composes text (NFC) first
SOURCE_FILE = "gguf_source.json"
DIGEST_SIDECAR = "gguf-digests.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", SOURCE_FILE)
_STALE_TMP_SECONDS = 3600.0



def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_checkpoint(g: GGUFFile, directory: Path, digest: str) -> None:
    """Write every file of the checkpoint into `directory` (which exists and is empty)."""
    config = g.hf_config()
    tokenizer = build_tokenizer_files(g)  # before the slow part, so bad metadata fails fast
    tensors = dict(g.iter_hf_tensors(config))  # name -> bf16, [out, in]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_json(directory / "config.json", config)
    tokenizer.write(directory)
    _write_json(
        directory / SOURCE_FILE,
        {
            "source_file": g.path.name,
            "source_size": g.path.stat().st_size,
            "source_sha256": digest,
            "gguf_architecture": g.architecture,
            "converter_version": CONVERTER_VERSION,
        },
    )
    _fsync_tree(directory)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False, digest: str | None = None
) -> Path:
    """Convert a GGUF file into a bf16 HF checkpoint directory at `out_dir`, atomically.

    `out_dir` must not exist unless `overwrite` is set. `digest` is the file's sha256 if
    the caller already has it. Returns `out_dir`. Raises CheckpointError on bad input.
    """
    src = Path(gguf_path)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(
            f"{out}: already exists. Remove it, choose another directory, or pass overwrite=True."
        )
    g = open_gguf(src)  # validates before anything is made on disk
    if digest is None:
        digest = sha256_file(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_checkpoint(g, tmp, digest)
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished `tmp` to `out`; with overwrite, the old `out` goes after."""
    old = None
    if overwrite and out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(out, old)
    os.rename(tmp, out)  # fails if `out` appeared meanwhile (non-empty dir or file)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- the cache ----------------------------------------------------------------------------


def _safe_name(path: Path) -> str:
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"


def file_digest(path: Path, cache_root: Path) -> str:
    """sha256 of `path`, remembered by (resolved path, size, mtime) in a sidecar JSON."""
    st = path.stat()
    key = str(path.resolve())
    sidecar = cache_root / DIGEST_SIDECAR
    try:
        known = json.loads(sidecar.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    digest = sha256_file(path)
    known[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        write_json_atomic(sidecar, known)
    except OSError:
        pass  # the sidecar only saves time
    return digest


def _is_complete(directory: Path, digest: str) -> bool:
    if not all((directory / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        source = json.loads((directory / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(source, dict)
        and source.get("source_sha256") == digest
        and source.get("converter_version") == CONVERTER_VERSION
    )


def _remove_stale_tmp(cache_root: Path) -> None:
    now = time.time()
    for p in cache_root.glob(".*.tmp-*"):
        try:
            if p.is_dir() and now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def reference_checkpoint(gguf_path: str | Path, cache_root: Path) -> Path:
    """The bf16 HF checkpoint of a GGUF file, converted once into
    `cache_root/<name>-<sha256[:16]>` and reused while the file's content is the same."""
    src = Path(gguf_path)
    if not src.is_file():
        open_gguf(src)  # raises the same error a conversion would
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    digest = file_digest(src, cache_root)
    target = cache_root / f"{_safe_name(src)}-{digest[:16]}"
    if _is_complete(target, digest):
        return target
    _remove_stale_tmp(cache_root)
    try:
        return convert_gguf(src, target, overwrite=target.exists(), digest=digest)
    except OSError:
        # another process may have published the same conversion first
        if _is_complete(target, digest):
            return target
        raise
