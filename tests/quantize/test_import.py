"""`qserve import`: a compressed-tensors checkpoint made elsewhere becomes an artifact (a
manifest beside the unchanged files), loads with the same logits as the artifact it was,
and bad input is refused with nothing written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qserve.quantize.import_checkpoint import import_checkpoint
from qserve.runtime.cli import main
from qserve.runtime.formats.errors import QserveError
from qserve.runtime.formats.manifest import MANIFEST_FILE, Manifest
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.loaded_model import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_gemma3  # noqa: E402


@pytest.fixture()
def foreign(tiny_fp8_artifact, tmp_path):
    """The tiny artifact's files without its manifest: what another tool writes."""
    out = tmp_path / "foreign"
    shutil.copytree(tiny_fp8_artifact, out)
    (out / MANIFEST_FILE).unlink()
    return out


def _logits(model, ids=(2, 17, 45, 99, 3, 250, 31, 7)):
    ids = torch.tensor(ids)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)),
                       DenseAttention())
        return model.compute_logits(hidden)


def _source(artifact) -> str:
    return str(artifact.parent / f"{artifact.name}-source")


def test_imported_checkpoint_loads_with_the_artifacts_logits(tiny_fp8_artifact, foreign):
    before = {p.name: p.read_bytes() for p in foreign.iterdir()}
    result = CliRunner().invoke(main, ["import", str(foreign), "--source",
                                       _source(tiny_fp8_artifact)])
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in foreign.iterdir() if p.name != MANIFEST_FILE} \
        == before  # only the manifest is added
    m = Manifest.read(foreign)
    assert m.source["spec"] == _source(tiny_fp8_artifact)
    assert m.source["sha256"] == Manifest.read(tiny_fp8_artifact).source["sha256"]
    assert m.recipe["imported"]["quant_method"] == "compressed-tensors"
    assert set(m.files) == set(before)
    assert torch.equal(_logits(load(str(foreign)).model),
                       _logits(load(str(tiny_fp8_artifact)).model))


def test_bad_input_is_refused_and_nothing_is_written(tiny_fp8_artifact, foreign, tmp_path):
    src = _source(tiny_fp8_artifact)
    with pytest.raises(QserveError, match="no config.json"):
        import_checkpoint(tmp_path, src)
    with pytest.raises(QserveError, match="no quantization_config"):
        import_checkpoint(src, src)
    gemma = write_tiny_gemma3(tmp_path / "gemma")
    with pytest.raises(QserveError, match="Gemma3ForCausalLM; name the model"):
        import_checkpoint(foreign, str(gemma))
    assert not (foreign / MANIFEST_FILE).exists()
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QserveError):
        import_checkpoint(foreign, src)
    assert not (foreign / MANIFEST_FILE).exists()
    with pytest.raises(QserveError, match="already a qserve artifact"):
        import_checkpoint(tiny_fp8_artifact, src)
