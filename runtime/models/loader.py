"""Build a model for a checkpoint and load its weights by name.

The model is built on the meta device (no memory, no random init), then each parameter
is replaced by the checkpoint tensor of the same name, cast to the requested dtype.
Every expected tensor must be present with the expected shape, and every checkpoint
tensor must be used, except known-ignorable ones (see `param_name` on the model class).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..formats.checkpoint import Checkpoint
from ..formats.errors import CheckpointError
from .registry import get_model_class

_MAX_LISTED = 8  # names listed in an error message before "... and N more"


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def build_on_meta(checkpoint: Checkpoint) -> nn.Module:
    """The model for `checkpoint`'s architecture, built on the meta device (no memory)."""
    config_path = str(checkpoint.path / "config.json")
    cls = get_model_class(checkpoint.architecture, config_path)
    cfg = cls.config_from_hf(checkpoint.config, config_path)
    with torch.device("meta"):
        return cls(cfg)


def fill_parameters(model: nn.Module, checkpoint: Checkpoint,
                    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                    scope: Callable[[str], bool] | None = None) -> None:
    """Set every parameter still on the meta device from the checkpoint tensor of the same
    name, cast to `dtype`. Mutates `model`. Raises CheckpointError (naming the file) for a
    wrong shape, two tensors for one parameter, unused tensors, or missing ones.

    `scope` (our parameter name -> bool) limits which meta parameters must be filled, so a
    model can be loaded one part (e.g. one decoder block) at a time."""
    cls_name = type(model).__name__
    param_dtype = getattr(model, "param_dtype", lambda name, dtype: dtype)
    config_path = str(checkpoint.path / "config.json")
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()
                if p.is_meta and (scope is None or scope(name))}
    loaded: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # our name -> checkpoint name
    unexpected: list[str] = []
    for ck_name, tensor in tensors:
        name = model.param_name(ck_name)
        if name is None:
            continue
        if name not in expected:
            unexpected.append(ck_name)
            continue
        file = checkpoint.weight_map[ck_name]
        if name in loaded:
            raise CheckpointError(
                f"{file}: tensor {ck_name!r} and {source[name]!r} both provide {name!r}."
            )
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{file}: tensor {ck_name!r} has shape {list(tensor.shape)}, expected "
                f"{list(expected[name])} from {config_path} ({cls_name})."
            )
        loaded[name] = tensor.to(param_dtype(name, dtype))
        source[name] = ck_name

    if unexpected:
        raise CheckpointError(
            f"{checkpoint.path}: {len(unexpected)} tensor(s) that {cls_name} does not use: "
            f"{_listing(sorted(unexpected))}. Is config.json's architecture right?"
        )
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise CheckpointError(
            f"{checkpoint.path}: missing {len(missing)} tensor(s) that {cls_name} needs: "
            f"{_listing(missing)}."
        )
    for name, tensor in loaded.items():
        _set_parameter(model, name, tensor)


def finish_model(model: nn.Module) -> nn.Module:
    """Compute config-derived buffers (RoPE frequencies), check nothing is left on the meta
    device, and switch to eval mode."""
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device="cpu")
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:  # a model class bug, not a user error
        raise RuntimeError(f"{type(model).__name__}: tensors left on the meta device: {leftover}")
    return model.eval()


def load_model(checkpoint: Checkpoint, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model for `checkpoint`'s architecture with its weights, in eval mode, on CPU.

    Raises UnsupportedArchitectureError for an architecture without an implementation and
    CheckpointError for a config or tensor set that does not fit it (naming the file).
    """
    model = build_on_meta(checkpoint)
    fill_parameters(model, checkpoint, checkpoint.iter_tensors(), dtype)
    model.tie_weights()
    return finish_model(model)
