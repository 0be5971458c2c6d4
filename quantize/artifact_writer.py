"""Write an artifact directory atomically: temp dir -> verify -> rename.

    with ArtifactWriter(out_dir, force=False) as w:
        w.add_tensors({...})            # any number of times; written in shards as they come
        w.copy_from(checkpoint_dir, TOKENIZER_FILES)
        w.finish(config, manifest, verify=fn)   # index, config, manifest, verify, rename

Tensors are flushed to a shard once `shard_bytes` accumulate, so quantizing block by
block never holds the whole model. Anything that interrupts before `finish` renames the
directory (an exception, Ctrl-C, a kill) leaves nothing at `out_dir`; a stale temp dir
from a killed run is removed by the next run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..runtime.formats.errors import QserveError
from ..runtime.formats.manifest import Manifest

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
DEFAULT_SHARD_BYTES = 1 << 30  # finished tensors held before a shard is written


class OutputExistsError(QserveError):
    pass


def _tmp_dir_for(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")


def _writer_alive(tmp: Path) -> bool:
    """True if the process that named this temp folder still runs (another quantize of
    the same output, on this machine): its folder must not be removed under it."""
    pid = tmp.name.rpartition("-")[2]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def move_into_place(done: Path, out_dir: Path) -> None:
    """Make the finished artifact directory `done` (on out_dir's filesystem, its data
    synced) appear at `out_dir` in one rename; an existing `out_dir` (--force) is swapped
    out first, then deleted."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(done, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(done, out_dir)


class ArtifactWriter:
    def __init__(self, out_dir: str | Path, force: bool = False,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not force:
            raise OutputExistsError(f"{self.out_dir}: already exists; choose another --out or "
                                    "pass --force to replace it.")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise OutputExistsError(f"{self.out_dir}: exists and is not a directory.")
        self.force = force
        self.shard_bytes = shard_bytes
        self.tmp = _tmp_dir_for(self.out_dir)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self._names: set[str] = set()
        self._done = False

    def __enter__(self) -> "ArtifactWriter":
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.parent.glob(f".{self.out_dir.name}.tmp-*"):
            if not _writer_alive(stale):  # left by a run that was killed
                shutil.rmtree(stale, ignore_errors=True)
        self.tmp.mkdir()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def add_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self._names:
                raise ValueError(f"tensor {name!r} written twice")
            self._names.add(name)
            self._pending[name] = t.detach().contiguous().cpu()
            self._pending_bytes += t.numel() * t.element_size()
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.tmp / f"shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append(sorted(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def copy_from(self, src_dir: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> list[str]:
        copied = []
        for name in names:
            if (src_dir / name).is_file():
                shutil.copyfile(src_dir / name, self.tmp / name)
                copied.append(name)
        return copied

    def _finalize_shards(self) -> None:
        self._flush()
        n = len(self._shards)
        if n == 0:
            raise ValueError("an artifact needs at least one tensor")
        if n == 1:
            os.replace(self.tmp / "shard-00000.safetensors", self.tmp / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp / f"shard-{i:05d}.safetensors", self.tmp / final)
            weight_map.update({name: final for name in names})
        (self.tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                      indent=2) + "\n")

    def finish(self, config: dict, manifest: Manifest,
               verify: Callable[[Path], None] | None = None,
               complete: Callable[[Path], None] | None = None) -> Path:
        """Write config + manifest, run `verify(tmp_dir)`, then `complete(tmp_dir)` (it may
        add files under subdirectories and change `manifest`, which is then written again:
        the temp dir is a whole, loadable artifact by then), then move into place."""
        self._finalize_shards()
        (self.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        manifest.record_files(self.tmp)
        manifest.write(self.tmp)
        if verify is not None:
            verify(self.tmp)
        if complete is not None:
            complete(self.tmp)
            manifest.write(self.tmp)
        for p in self.tmp.iterdir():  # data on disk before the rename makes it visible
            p.chmod(0o755 if p.is_dir() else 0o644)  # a draft/ directory stays traversable
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        move_into_place(self.tmp, self.out_dir)
        self._done = True
        return self.out_dir
