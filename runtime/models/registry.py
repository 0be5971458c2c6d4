"""Architecture registry: HF `architectures[0]` -> model class.

A model class registers itself with `@register_model("LlamaForCausalLM", ...)`. Lookups
import the model modules listed in MODEL_MODULES first, so the registry is complete no
matter which module a caller imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, TypeVar

from ..formats.errors import CheckpointError, UnsupportedArchitectureError
from .config import ModelConfig

# Modules under runtime/models whose import registers architectures.
MODEL_MODULES = ("llama", "gemma3", "deepseek")

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound=type)


def register_model(*architectures: str) -> Callable[[T], T]:
    """Class decorator: the class implements these HF architecture names."""

    def decorate(cls: T) -> T:
        for name in architectures:
            old = _REGISTRY.get(name)
            if old is not None and old.__qualname__ != cls.__qualname__:  # a reload may re-register
                raise ValueError(f"architecture {name!r} is already registered to {old}")
            _REGISTRY[name] = cls
        return cls

    return decorate


def _load_model_modules() -> None:
    for module in MODEL_MODULES:
        importlib.import_module(f"{__package__}.{module}")


def supported_architectures() -> list[str]:
    _load_model_modules()
    return sorted(_REGISTRY)


def get_model_class(architecture: str, source: str = "config.json") -> type:
    """The class registered for `architecture`, else UnsupportedArchitectureError."""
    _load_model_modules()
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {architecture!r} is not supported. Supported "
            f"architectures: {', '.join(sorted(_REGISTRY))}."
        ) from None


def architecture_of(raw: Mapping[str, Any], source: str = "config.json") -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise CheckpointError(
            f"{source}: missing required key 'architectures' (a list naming the model class, "
            "e.g. [\"LlamaForCausalLM\"])."
        )
    return archs[0]


def config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Normalise a config.json dict with the traits of its architecture."""
    cls = get_model_class(architecture_of(raw, source), source)
    return ModelConfig.from_hf(raw, cls.traits, source)
