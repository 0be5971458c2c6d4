"""Imports point one way: kernels <- runtime <- calib <- quantize <- evals.

A package may import itself and any package before it in LAYERS, never one after it
(kernels is the leaf: it imports nothing else of qserve). KNOWN_EXCEPTIONS lists the
wrong-way imports that exist today (the CLI, which composes every stage and is still to
leave runtime/; the runtime reaching into quantize/ for the artifact reader and draft
heads and into evals/ for the serve-time gates); the test fails on any new one, and on a
listed one that is gone, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "runtime", "calib", "quantize", "evals")

# "importing file -> imported module" (module relative to the qserve package)
KNOWN_EXCEPTIONS = {
    "runtime/benchmark/kv.py -> evals.golden_text",
    "runtime/benchmark/step.py -> evals.golden_text",
    "runtime/benchmark/step.py -> quantize.artifact_reader",
    "runtime/benchmark/gpu_check_e2e.py -> quantize.artifact_reader",
    "runtime/capabilities.py -> quantize.pipeline",
    "runtime/cli.py -> calib.errors",
    "runtime/cli.py -> evals.agreement",
    "runtime/cli.py -> evals.gates",
    "runtime/cli.py -> evals.golden_text",
    "runtime/cli.py -> evals.perplexity",
    "runtime/cli.py -> evals.report",
    "runtime/cli.py -> evals.runner",
    "runtime/cli.py -> quantize.artifact_reader",
    "runtime/cli.py -> quantize.draft",
    "runtime/cli.py -> quantize.pipeline",
    "runtime/cli.py -> quantize.recipe",
    "runtime/loaded_model.py -> quantize.artifact_reader",
    "runtime/models/quantized_loader.py -> quantize.artifact_reader",
    "runtime/benchmark/spec.py -> quantize.artifact_reader",
    "runtime/spec/hidden_draft.py -> calib.fp8",
    "runtime/spec/options.py -> quantize.draft",
}


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
                    if top in LAYERS and LAYERS.index(top) > LAYERS.index(layer):
                        found.add(f"{path.relative_to(ROOT).as_posix()} -> {module}")
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
    """The scan itself: a kernels module importing the runtime is reported."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "bad.py").write_text("from ..runtime.engine import LLMEngine\n")
    for layer in LAYERS[1:]:
        (tmp_path / layer).mkdir()
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert wrong_way_imports() == {"kernels/bad.py -> runtime.engine"}
