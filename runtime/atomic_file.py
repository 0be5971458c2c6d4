"""Files written whole or not at all: a reader (or a crash) sees the old file or the new
one, never a part.

    write_text_atomic(path, text)          # str -> path
    write_json_atomic(path, data)          # JSON-serialisable -> path (indent 1)

Both write a uniquely named temp file beside `path` (so two processes writing the same
path never share one), flush and fsync it, rename it over `path`, and remove it if
anything fails on the way. Missing parent folders are made.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json_atomic(path: str | Path, data, indent: int = 1, default=None) -> Path:
    """Write `data` as JSON (a trailing newline) to `path` atomically; `default` as
    json.dumps takes it, for values JSON has no type for."""
    return write_text_atomic(path, json.dumps(data, indent=indent, default=default) + "\n")
