"""HF checkpoint directory reader: good layouts load, bad ones name the bad file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.errors import CheckpointError
from qserve.runtime.formats.sources import resolve_source


def _write_config(root, **extra):
    cfg = {"architectures": ["LlamaForCausalLM"], **extra}
    (root / "config.json").write_text(json.dumps(cfg))


def test_single_file(tmp_path):
    _write_config(tmp_path)
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(4)}, tmp_path / "model.safetensors")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{x}}"}))
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.architecture == "LlamaForCausalLM"
    assert ckpt.tensor_names() == ["a", "b"]
    assert torch.equal(ckpt.tensor("a"), torch.ones(2, 3))
    assert dict(ckpt.iter_tensors()).keys() == {"a", "b"}
    assert ckpt.generation_config == {"eos_token_id": [2, 3]}
    assert ckpt.chat_template == "{{x}}"


def test_sharded_with_index(tmp_path):
    _write_config(tmp_path)
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.full((3,), 7.0)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = open_checkpoint(tmp_path)
    assert [p.name for p in ckpt.files()] == ["model-00001-of-00002.safetensors",
                                              "model-00002-of-00002.safetensors"]
    assert torch.equal(ckpt.tensor("b"), torch.full((3,), 7.0))


def test_missing_config(tmp_path):
    save_file({"a": torch.ones(1)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        open_checkpoint(tmp_path)


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: config\.json is not valid JSON"):
        open_checkpoint(tmp_path)


def test_no_weights(tmp_path):
    _write_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        open_checkpoint(tmp_path)


def test_corrupt_safetensors(tmp_path):
    _write_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        open_checkpoint(tmp_path)


def test_missing_shard(tmp_path):
    _write_config(tmp_path)
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: shard listed"):
        open_checkpoint(tmp_path)


def test_index_names_absent_tensor(tmp_path):
    _write_config(tmp_path)
    save_file({"a": torch.ones(2)}, tmp_path / "s1.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"s1\.safetensors: tensor 'ghost'"):
        open_checkpoint(tmp_path)


def test_no_architectures(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.ones(1)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no 'architectures' entry"):
        open_checkpoint(tmp_path).architecture


def test_source_not_found(tmp_path):
    with pytest.raises(CheckpointError, match="not a built-in model"):
        resolve_source(str(tmp_path / "nope"))


def test_source_wrong_file_type(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"weights\.bin: not a \.gguf file"):
        resolve_source(str(f))
