"""A model ready to run: weights in memory, its tokenizer, and where it came from.

Either a source checkpoint (built-in name, HF directory, .gguf) run in bf16/fp32, or a
qserve FP8 artifact: FP8 linears (static activation scales) and, when the artifact has
k/v scales, attention that sees K/V as an FP8 cache would hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .formats.artifact_reader import is_artifact, open_artifact
from .formats.checkpoint import Checkpoint, open_checkpoint
from .formats.sources import resolve_source
from .fp8_kv_attention import Fp8KVAttention
from .models.loader import load_model
from .models.quantized_loader import load_quantized_model
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str  # what the user asked for
    path: Path  # the directory the weights came from
    checkpoint: Checkpoint
    model: torch.nn.Module
    tokenizer: Tokenizer
    dtype: torch.dtype
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    is_artifact: bool = False

    def attention(self, inner):
        """Wrap a backend without its own FP8 cache so K/V match the artifact's FP8 KV."""
        return Fp8KVAttention(inner, self.kv_scales) if self.kv_scales else inner


# compute dtypes the CPU model paths run, by the names vLLM and torch give them
DTYPE_NAMES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A compute dtype from a torch.dtype or its name ("float32", "bfloat16", "auto" = the
    checkpoints' bf16, as vLLM's `dtype=` takes them); anything else is a ValueError."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPE_NAMES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    names = ", ".join(repr(n) for n in DTYPE_NAMES)
    raise ValueError(f"dtype {dtype!r} is not supported: give one of {names}, or "
                     f"torch.float32 / torch.bfloat16.")


def load(spec: str, dtype: str | torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load an artifact, a built-in name, an HF directory or a .gguf file, computing in
    `dtype` (a torch.dtype or its name, see resolve_dtype)."""
    dtype = resolve_dtype(dtype)
    if is_artifact(spec):
        art = open_artifact(spec)
        qm = load_quantized_model(art, dtype)
        tok = Tokenizer.from_dir(art.path, art.checkpoint.generation_config)
        return LoadedModel(spec, art.path, art.checkpoint, qm.model, tok, dtype,
                           qm.kv_scales, True)
    source = resolve_source(spec)
    ckpt = open_checkpoint(source.checkpoint_dir)
    model = load_model(ckpt, dtype=dtype)
    model.eval()
    tok = Tokenizer.from_dir(source.checkpoint_dir, ckpt.generation_config)
    return LoadedModel(spec, source.checkpoint_dir, ckpt, model, tok, dtype)
