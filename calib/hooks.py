"""Collecting calibration statistics from a running model.

- `ActivationRecorder`: forward pre-hooks on linear modules; each module's input goes to
  that module's own observer (static input scales).
- `ObservingAttention`: wraps an attention backend; the K and V each layer passes to it
  (exactly what the cache would store: after k-norm and RoPE) go to that layer's k and v
  observers (FP8 KV scales).

Neither imports the runtime: modules are plain `nn.Module`s with `in_features`, and a
backend is anything with `forward(spec, q, k, v, meta)` where `spec.layer_idx` names the
layer (runtime/attention.py's interface).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

from .errors import CalibrationError
from .observers import Observer


class ActivationRecorder:
    """Feeds the input of each given linear module to an observer made for it.

    modules: {name: nn.Linear (or any module with `in_features`)}.
    observer_factory(name) -> Observer, called once per module when attaching.
    Each call of a module passes its input, reshaped to [tokens, in_features] float32,
    to `observers[name].observe`. Use as a context manager, or call `remove()`.
    """

    def __init__(self, modules: Mapping[str, nn.Module],
                 observer_factory: Callable[[str], Observer]) -> None:
        self.observers: dict[str, Observer] = {}
        self.num_calls: dict[str, int] = {}
        self._handles: list[Any] = []
        try:
            for name, module in modules.items():
                in_features = getattr(module, "in_features", None)
                if not isinstance(in_features, int):
                    raise CalibrationError(
                        f"module {name!r} ({type(module).__name__}) has no integer "
                        "in_features; ActivationRecorder records the inputs of nn.Linear-like "
                        "modules only. Pass linear modules.")
                self.observers[name] = observer_factory(name)
                self.num_calls[name] = 0
                hook = partial(self._record, name, in_features)
                self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        except BaseException:
            self.remove()
            raise

    def _record(self, name: str, in_features: int, module: nn.Module,
                args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            raise CalibrationError(f"module {name!r} was called without a tensor input.")
        if x.shape[-1] != in_features:
            raise CalibrationError(
                f"module {name!r} expects {in_features} input features but got a tensor of "
                f"shape {tuple(x.shape)}.")
        x = x.detach().reshape(-1, in_features).to(torch.float32)  # [tokens, in_features]
        self.observers[name].observe(x)
        self.num_calls[name] += 1
        return None  # the input goes on unchanged

    def remove(self) -> None:
        """Detach every hook (idempotent). Observers keep what they recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "ActivationRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class KVObservers(NamedTuple):
    k: Observer  # fed k: [T, num_kv_heads, head_dim]
    v: Observer  # fed v: [T, num_kv_heads, head_dim]


class ObservingAttention:
    """An attention backend that observes K and V per layer, then delegates to `inner`.

    observers_for_layer: layer_idx -> (k_observer, v_observer), called the first time a
    layer is seen (or a mapping {layer_idx: (k, v)}). Observer granularity decides the
    scale's shape: dim=None -> one scalar per layer; dim=1 -> amax over T and head_dim,
    [num_kv_heads]. The output is `inner.forward(...)`'s, untouched; other attributes
    (e.g. a caching backend's `free`) are forwarded to `inner`.
    """

    def __init__(self, inner: Any,
                 observers_for_layer: Callable[[int], tuple[Observer, Observer]]
                 | Mapping[int, tuple[Observer, Observer]]) -> None:
        self.inner = inner
        self._observers_for_layer = observers_for_layer
        self.observers: dict[int, KVObservers] = {}

    def observers_for(self, layer_idx: int) -> KVObservers:
        obs = self.observers.get(layer_idx)
        if obs is None:
            source = self._observers_for_layer
            if isinstance(source, Mapping):
                if layer_idx not in source:
                    raise CalibrationError(
                        f"no k/v observers were given for attention layer {layer_idx}; "
                        f"observers exist for layers {sorted(source)}. Give one per layer.")
                k_obs, v_obs = source[layer_idx]
            else:
                k_obs, v_obs = source(layer_idx)
            obs = self.observers[layer_idx] = KVObservers(k_obs, v_obs)
        return obs

    def forward(self, spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta
                ) -> torch.Tensor:
        # k, v: [T, num_kv_heads, head_dim], the new tokens as they would enter the cache
        obs = self.observers_for(spec.layer_idx)
        obs.k.observe(k)
        obs.v.observe(v)
        return self.inner.forward(spec, q, k, v, meta)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "_observers_for_layer", "observers"):
            raise AttributeError(name)
        return getattr(self.inner, name)
