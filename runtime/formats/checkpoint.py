"""Reader for a Hugging Face checkpoint directory.

A checkpoint directory holds:
    config.json                       model hyper-parameters (required)
    model.safetensors                 weights, or
    model-0000X-of-0000N.safetensors  shards listed in model.safetensors.index.json
    tokenizer.json, tokenizer_config.json (chat template), generation_config.json

Tensors are read lazily, one at a time, so a caller can stream a checkpoint that is
larger than memory (the quantizer calibrates block by block).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(data).__name__}.")
    return data


@dataclass
class Checkpoint:
    """An opened HF checkpoint directory. Holds file handles' paths, not tensors."""

    path: Path
    config: dict
    # tensor name -> safetensors file that holds it
    weight_map: dict[str, Path]
    generation_config: dict = field(default_factory=dict)
    tokenizer_config: dict = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        if not archs:
            raise CheckpointError(
                f"{self.path / 'config.json'}: no 'architectures' entry; cannot tell which "
                "model implementation to use."
            )
        return archs[0]

    @property
    def chat_template(self) -> str | None:
        tmpl = self.tokenizer_config.get("chat_template")
        if isinstance(tmpl, list):  # list of {"name", "template"}; take the default one
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if tmpl is None and (self.path / "chat_template.jinja").is_file():
            tmpl = (self.path / "chat_template.jinja").read_text(encoding="utf-8")
        return tmpl

    def tensor_names(self) -> list[str]:
        return sorted(self.weight_map)

    def files(self) -> list[Path]:
        return sorted(set(self.weight_map.values()))

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor in its stored dtype)."""
        try:
            path = self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}.") from None
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:  # safetensors raises several types for corrupt files
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from None

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) file by file, so each file is opened once."""
        for path in self.files():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        if self.weight_map.get(name) == path:
                            yield name, f.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from None


def _scan_safetensors(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({e}). Re-download or re-export it."
        ) from None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF checkpoint directory; raise CheckpointError naming the bad file."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root}: no such file or directory.")
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: not a checkpoint directory. Give a directory with config.json and "
            "*.safetensors, a .gguf file, or a built-in model name (see `qserve models`)."
        )
    config = _read_json(root / "config.json", "config.json")

    weight_map: dict[str, Path] = {}
    index = root / INDEX_FILE
    if index.is_file():
        data = _read_json(index, "safetensors index")
        mapping = data.get("weight_map")
        if not isinstance(mapping, dict) or not mapping:
            raise CheckpointError(f"{index}: 'weight_map' is missing or empty.")
        shards = sorted(set(mapping.values()))
        for shard in shards:
            shard_path = root / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: shard listed in {INDEX_FILE} is missing.")
            present = set(_scan_safetensors(shard_path))
            for name, file in mapping.items():
                if file == shard:
                    if name not in present:
                        raise CheckpointError(
                            f"{shard_path}: tensor {name!r} listed in {INDEX_FILE} is not in it."
                        )
                    weight_map[name] = shard_path
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{root}: no *.safetensors weights found (and no {INDEX_FILE}). "
                "qserve reads safetensors checkpoints and .gguf files."
            )
        for file in files:
            for name in _scan_safetensors(file):
                if name in weight_map:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} also appears in {weight_map[name]}."
                    )
                weight_map[name] = file

    gen = root / "generation_config.json"
    tok = root / "tokenizer_config.json"
    return Checkpoint(
        path=root,
        config=config,
        weight_map=weight_map,
        generation_config=_read_json(gen, "generation_config.json") if gen.is_file() else {},
        tokenizer_config=_read_json(tok, "tokenizer_config.json") if tok.is_file() else {},
    )
