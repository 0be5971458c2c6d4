"""The install exposes only `qserve.*`: no bare `runtime`, `kernels`, ... import names."""

import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["runtime", "kernels", "quantize", "calib", "evals"])
def test_no_bare_top_level_package(name, tmp_path):
    """None of the project's folders is importable by its bare name. Another distribution's
    package of that name is not the project's (transformers 5.25 installs Hugging Face's
    `kernels`): a name found must not resolve into the project's folder of that name."""
    code = (f"import importlib.util; s = importlib.util.find_spec({name!r}); "
            "print('' if s is None else s.origin or '')")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,  # cwd: not the repo
                       capture_output=True, text=True, check=True)
    origin = r.stdout.strip()
    assert not origin or (ROOT / name) not in Path(origin).resolve().parents, \
        f"a bare `{name}` package of this project is importable after install: {origin}"


def test_qserve_subpackages_import(tmp_path):
    code = ("import qserve.runtime.cli, qserve.kernels.fp8, qserve.quantize.pipeline, "
            "qserve.calib.observers, qserve.evals.perplexity")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
