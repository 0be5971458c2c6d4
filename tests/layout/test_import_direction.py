"""Imports point one way: kernels <- runtime <- calib <- quantize <- evals.

A package may import itself and any package before it in LAYERS, never one after it
(kernels is the leaf: it imports nothing else of qserve). The entry points, which compose
every stage, are the one exception by rule: the `qserve` command line (runtime/cli.py)
and the benchmarks (runtime/benchmark/). KNOWN_EXCEPTIONS lists any other wrong-way
import still to remove; the test fails on a new one, and on a listed one that is gone, so
the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "runtime", "calib", "quantize", "evals")
ENTRY_POINTS = ("runtime/cli.py", "runtime/benchmark/")  # may import every layer

# "importing file -> imported module" (module relative to the qserve package)
KNOWN_EXCEPTIONS: set[str] = set()


def _module_of(path: Path, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The qserve modules an import statement in `path` names (relative to qserve)."""
    parts = path.relative_to(ROOT).parts
    if isinstance(node, ast.Import):
        return [a.name[len("qserve."):] for a in node.names if a.name.startswith("qserve.")]
    if node.level > 0:
        base = list(parts[:-1])[:len(parts) - node.level]
        return [".".join(base + ([node.module] if node.module else []))]
    mod = node.module or ""
    return [mod[len("qserve."):]] if mod.startswith("qserve.") else []


def wrong_way_imports() -> set[str]:
    found = set()
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for module in _module_of(path, node):
                    top = module.split(".")[0]
                    rel = path.relative_to(ROOT).as_posix()
                    if rel.startswith(ENTRY_POINTS):
                        continue
                    if top in LAYERS and LAYERS.index(top) > LAYERS.index(layer):
                        found.add(f"{rel} -> {module}")
    return found


def test_no_new_import_runs_the_wrong_way():
    new = sorted(wrong_way_imports() - KNOWN_EXCEPTIONS)
    assert not new, ("imports against the layer order "
                     f"{' <- '.join(LAYERS)} (move the shared code down instead):\n"
                     + "\n".join(new))


def test_the_exception_list_only_lists_imports_that_exist():
    gone = sorted(KNOWN_EXCEPTIONS - wrong_way_imports())
    assert not gone, "fixed: remove from KNOWN_EXCEPTIONS:\n" + "\n".join(gone)


def test_kernels_is_the_leaf():
    assert not [e for e in KNOWN_EXCEPTIONS if e.startswith("kernels/")]


def test_a_wrong_way_import_is_found(tmp_path, monkeypatch):
    """The scan itself: a kernels module importing the runtime, and a runtime module
    importing evals, are reported; the CLI importing evals is not."""
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "kernels" / "bad.py").write_text("from ..runtime.engine import LLMEngine\n")
    (tmp_path / "runtime" / "server.py").write_text("from qserve.evals import gates\n")
    (tmp_path / "runtime" / "cli.py").write_text("from ..evals.gates import run_gates\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert wrong_way_imports() == {"kernels/bad.py -> runtime.engine",
                                   "runtime/server.py -> evals"}
