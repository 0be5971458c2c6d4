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


def test_the_checkouts_root_does_not_shadow_another_kernels_package():
    """Python started in the checkout's root has the root on its path. The project's
    `kernels/` folder has no __init__.py, so it is only a namespace portion there and
    another distribution's regular `kernels` package (Hugging Face's, which transformers
    probes for) wins: transformers imports, and the bare name never resolves into the
    folder's modules."""
    code = ("import importlib.util; s = importlib.util.find_spec('kernels'); "
            "from transformers import AutoModelForCausalLM; "
            "print(s.origin if s is not None and s.origin else '')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    origin = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert not origin or (ROOT / "kernels") not in Path(origin).resolve().parents, origin
    assert not (ROOT / "kernels" / "__init__.py").exists()
