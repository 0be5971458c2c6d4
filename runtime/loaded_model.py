"""A model ready to run: weights in memory, its tokenizer, and where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..quantize.checkpoint import Checkpoint, open_checkpoint
from ..quantize.sources import resolve_source
from .models.loader import load_model
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str  # what the user asked for
    path: Path  # the HF-format directory the weights came from
    checkpoint: Checkpoint
    model: torch.nn.Module
    tokenizer: Tokenizer
    dtype: torch.dtype


def load(spec: str, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load a built-in name, an HF directory or a .gguf file (converted once, cached)."""
    source = resolve_source(spec)
    ckpt = open_checkpoint(source.checkpoint_dir)
    model = load_model(ckpt, dtype=dtype)
    model.eval()
    tok = Tokenizer.from_dir(source.checkpoint_dir, ckpt.generation_config)
    return LoadedModel(spec, source.checkpoint_dir, ckpt, model, tok, dtype)
