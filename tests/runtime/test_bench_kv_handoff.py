"""The KV hand-off benchmark on tiny FP8 artifacts: what it reports is what travels (K and
V for GQA, the latent once for MLA), and the imported blocks are all of the prompt's."""

import sys
from pathlib import Path

import pytest
import torch

from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.benchmark.kv_handoff import main, measure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_deepseek, write_tiny_llama  # noqa: E402

RECIPE = {"calibration": {"num_samples": 4, "seq_len": 64}}


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_the_reported_bytes_are_the_kv_that_travels(tmp_path, arch):
    torch.set_num_threads(1)
    if arch == "llama":  # 2 layers, 2 kv heads of 16: K and V
        src, per_layer = write_tiny_llama(tmp_path / "src"), 2 * 2 * 16
    else:  # 3 layers, latent 32 + RoPE key 8, once
        src, per_layer = write_tiny_deepseek(tmp_path / "src", 3), 32 + 8
    quantize(str(src), tmp_path / "art", recipe_from_dict(RECIPE), dtype=torch.float32)
    r = measure(str(tmp_path / "art"), prompt_len=40, reps=1, transport="socket")
    layers = 2 if arch == "llama" else 3
    assert r["kv_dtype"] == "fp8" and r["latent"] == (arch == "deepseek")
    assert r["kv_tokens"] == 39  # all but the last prompt token: 2 full blocks and a tail
    assert r["payload_bytes"] == 39 * layers * per_layer  # 1 byte per FP8 value
    assert r["bytes_per_token_layer"] == per_layer
    assert r["blocks_imported"] == 2 and r["frame_bytes"] > r["payload_bytes"]
    # the import's engine-thread part and its copy are parts of the whole import
    assert r["import_engine_thread_ms"] > 0 and r["import_copy_ms"] > 0
    assert r["import_engine_thread_ms"] + r["import_copy_ms"] <= r["import_ms"] + 0.02


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit, match="--prompt-len"):
        main(["x", "--prompt-len", "1"])
    with pytest.raises(SystemExit, match="--transport"):
        main(["x", "--transport", "pigeon"])


def test_a_path_that_is_no_artifact_is_named_without_a_traceback(tmp_path):
    with pytest.raises(SystemExit, match="kv_handoff: .*nothing-here.*not a built-in model"):
        main([str(tmp_path / "nothing-here"), "--reps", "1"])
