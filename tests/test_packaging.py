"""The install exposes only `qserve.*`: no bare `runtime`, `kernels`, ... import names."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("name", ["runtime", "kernels", "quantize", "calib", "evals"])
def test_no_bare_top_level_package(name, tmp_path):
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({name!r}) is None else 1)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path)  # cwd: not the repo
    assert r.returncode == 0, f"a bare `{name}` package is importable after install"


def test_qserve_subpackages_import(tmp_path):
    code = ("import qserve.runtime.cli, qserve.kernels.fp8, qserve.quantize.pipeline, "
            "qserve.calib.observers, qserve.evals.perplexity")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
