"""A function compiled by inductor (torch.compile) on first use, run eagerly where it cannot be.

Inductor fuses chains of elementwise torch ops into one vectorised C++ loop; it needs a C++
compiler the first time a shape class is seen (the code is then cached on disk). Where
compiling fails (no compiler, unsupported platform) the eager function keeps serving,
slower: the failure is logged once per function, and QSERVE_REQUIRE_COMPILE=1 turns it
into an error (tests use it so a broken compile cannot pass as the eager path).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Graphs per function and shape class: e.g. the decode attention of a Gemma-style model
# needs 8 (q dtype x window x softcap x batch of one), dynamo's default limit. Raised once
# for the process: a per-call config patch costs time on every engine step.
_RECOMPILE_LIMIT = 64


def require_compile() -> bool:
    return os.environ.get("QSERVE_REQUIRE_COMPILE") == "1"


class CompiledOrEager:
    """fn compiled with `torch.compile(fn, dynamic=dynamic)` at the first call.

    `mark_dynamic`: (argument index, dim) pairs whose sizes vary call to call; they are
    marked so one graph serves them all (used with dynamic=False, where every other size
    is specialised). `fallback` (same signature, default fn) runs once compiling failed.
    """

    def __init__(self, fn: Callable, name: str, dynamic: bool = False,
                 mark_dynamic: tuple[tuple[int, int], ...] = (),
                 fallback: Callable | None = None) -> None:
        self.fn = fn
        self.fallback = fallback or fn  # what runs when compiling fails
        self.name = name
        self.dynamic = dynamic
        self.mark_dynamic = mark_dynamic
        self._compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.fallback(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=self.dynamic)
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
        for i, dim in self.mark_dynamic:
            torch._dynamo.maybe_mark_dynamic(args[i], dim)
        try:
            return self._compiled(*args)
        except Exception as exc:  # no C++ compiler, unsupported platform: keep serving
            if require_compile():
                raise
            self.failed = True
            log.warning("%s: torch.compile failed (%s: %s); running it eagerly (slower).",
                        self.name, type(exc).__name__, exc)
            return self.fallback(*args)


__all__ = ["CompiledOrEager", "require_compile"]
