"""The pre-rename artifact check: block by block, same numbers as a full load, and it
refuses artifacts with missing tensors or broken scales."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.errors import CheckpointError, QserveError
from qserve.runtime.formats.manifest import Manifest
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.quantize.verifier import verify_artifact
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.fp8_kv_attention import Fp8KVAttention
from qserve.runtime.models.quantized_loader import load_quantized_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_gemma3, write_tiny_llama  # noqa: E402

SMALL = {"calibration": {"num_samples": 4, "seq_len": 64}, "ignore": []}  # FP8 head too


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def artifact(request, tmp_path_factory):
    write = {"llama": write_tiny_llama, "gemma3": write_tiny_gemma3}[request.param]
    src = write(tmp_path_factory.mktemp("src") / "tiny")
    out = tmp_path_factory.mktemp("art") / "a"
    quantize(str(src), out, recipe_from_dict(SMALL), dtype=torch.float32)
    return out


def _ids(n=24, seed=0):
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed))


def test_blockwise_check_matches_full_load(artifact):
    ids = _ids()
    qm = load_quantized_model(open_artifact(artifact), torch.float32)
    with torch.inference_mode():
        hidden = qm.model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)),
                          Fp8KVAttention(DenseAttention(), qm.kv_scales))
        full = qm.model.compute_logits(hidden[-1:])
    got = verify_artifact(artifact, torch.float32, ids)
    torch.testing.assert_close(got, full, rtol=0, atol=0)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy an artifact, edit its tensors, and re-record the manifest digests (as a buggy
    writer would have written them)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    m = Manifest.read(dst)
    m.record_files(dst)
    m.write(dst)
    return dst


def test_missing_block_tensor_refused(artifact, tmp_path):
    bad = _rewrite(artifact, tmp_path / "bad",
                   lambda t: t.pop("model.layers.1.mlp.up_proj.input_scale"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj"):
        verify_artifact(bad, torch.float32, _ids())


def test_broken_scale_refused(artifact, tmp_path):
    def corrupt(t):
        t["model.layers.0.self_attn.o_proj.weight_scale"][:] = float("nan")

    bad = _rewrite(artifact, tmp_path / "bad", corrupt)
    with pytest.raises(QserveError, match="non-finite logits"):
        verify_artifact(bad, torch.float32, _ids())
