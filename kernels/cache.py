"""Where qserve keeps what it builds and converts: QSERVE_CACHE, else ~/.cache/qserve.

The one place the cache root is resolved (kernels is the leaf package: every other
package may import it). Kernel libraries go to `native/`, converted checkpoints and
artifacts, eval references and bench reports to their own folders below the root.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("QSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qserve"
