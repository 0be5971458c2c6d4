"""Observers: running statistics that turn calibration tensors into static scales (FP8 or int8).

An observer is fed tensors one batch at a time (`observe`, mutates) and answers `amax()`,
the absolute value that will map onto the grid's largest code, and `scale()` =
max(amax / qmax, MIN_SCALE) (see calib/fp8.py). The grid (calib/grids.py) is FP8 E4M3
(qmax 448) unless `grid="int8"` (qmax 127: int8 weight-only linears). Observers are
registered by name; `make_observer("percentile", percentile=99.9)` builds one.

Granularity, chosen by `dim`:
    dim=None  per tensor: everything is reduced, amax() and scale() are 0-d tensors.
    dim=d     per channel along d: every other dim is reduced, amax() is [x.shape[d]].
Typical uses:
    linear input  [tokens, in_features], dim=None -> []            (static input scale)
    weight        [out, in],             dim=0    -> [out]         (per output channel)
    K or V        [T, num_kv_heads, D],  dim=1    -> [num_kv_heads] (per kv head)
`scale()` has amax's shape; reshape it to broadcast (a weight's [out] -> [out, 1]).

Lifecycle: `observe()` any number of times; `amax()` / `scale()` are read-only and
reflect everything observed so far. Before the first non-empty `observe()` they raise
`NotObservedError`. Internally every batch is viewed as |x| laid out [C, M] float32
(C = 1 per tensor): M values per channel per batch.
"""

from __future__ import annotations

from typing import Callable

import torch

from .errors import CalibrationError, NotObservedError
from .fp8 import scale_from_amax
from .grids import weight_grid

OBSERVERS: dict[str, type["Observer"]] = {}


def register_observer(name: str) -> Callable[[type["Observer"]], type["Observer"]]:
    """Class decorator: make an Observer subclass available to `make_observer(name)`."""

    def register(cls: type[Observer]) -> type[Observer]:
        if name in OBSERVERS and OBSERVERS[name] is not cls:
            raise ValueError(f"observer name {name!r} is already registered to "
                             f"{OBSERVERS[name].__name__}")
        OBSERVERS[name] = cls
        cls.name = name
        return cls

    return register


def observer_names() -> list[str]:
    return sorted(OBSERVERS)


def make_observer(name: str, **kwargs) -> "Observer":
    """A new observer of the registered kind `name`, built with `kwargs`."""
    cls = OBSERVERS.get(name)
    if cls is None:
        raise CalibrationError(
            f"unknown observer {name!r}; registered observers are: "
            f"{', '.join(observer_names())}. Use one of these names.")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise CalibrationError(
            f"observer {name!r} does not accept the options {sorted(kwargs)}: {e}") from e


class Observer:
    """Base class. Subclasses implement `_update(rows, batch_amax)` and `_amax()`."""

    name = "observer"

    def __init__(self, dim: int | None = None, grid: str = "fp8") -> None:
        self.dim = dim
        self.grid = weight_grid(grid)  # what the scale maps onto
        self.qmax = self.grid.qmax
        self.num_batches = 0  # non-empty batches observed
        self.num_values = 0  # values observed per channel
        self._num_channels: int | None = None
        self._cached: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        """Mutates: fold x (any float dtype) into the statistics. An empty x is ignored."""
        if not torch.is_floating_point(x):
            raise CalibrationError(f"{self.name} observer expects a floating-point tensor, "
                                   f"got {x.dtype}.")
        if x.numel() == 0:
            return
        rows = self._rows(x.detach())  # [C, M] float32, |x|
        batch_amax = rows.amax(dim=1)  # [C]
        if not bool(torch.isfinite(batch_amax).all()):
            raise CalibrationError(
                f"{self.name} observer saw non-finite values (inf or NaN) in a tensor of shape "
                f"{tuple(x.shape)}: the model produces inf/NaN on the calibration data. "
                "Check the checkpoint and run calibration in float32 or bfloat16.")
        self._update(rows, batch_amax)
        self.num_batches += 1
        self.num_values += rows.shape[1]
        self._cached = None

    def amax(self) -> torch.Tensor:
        """Read-only: [] per tensor or [C] per channel, float32."""
        if self.num_batches == 0:
            raise NotObservedError(
                f"the {self.name!r} observer has seen no data: amax()/scale() was called "
                "before observe(). Run calibration batches through the module first; a "
                "module that never runs on the calibration data cannot be calibrated.")
        if self._cached is None:
            self._cached = self._amax().to(torch.float32)
        amax = self._cached.clone()
        return amax[0] if self.dim is None else amax

    def scale(self) -> torch.Tensor:
        """Read-only: amax() / qmax (floored at MIN_SCALE), float32, amax()'s shape."""
        return scale_from_amax(self.amax(), self.qmax)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """|x| as [C, M] float32: channels first, everything else flattened."""
        x = x.to(torch.float32).abs()
        if self.dim is None:
            return x.reshape(1, -1)
        if not -x.dim() <= self.dim < x.dim():
            raise CalibrationError(
                f"{self.name} observer is per-channel along dim {self.dim}, but the tensor has "
                f"shape {tuple(x.shape)}. Use a dim inside the tensor, or dim=None.")
        channels = x.shape[self.dim]
        if self._num_channels is None:
            self._num_channels = channels
        elif channels != self._num_channels:
            raise CalibrationError(
                f"{self.name} observer first saw {self._num_channels} channels along dim "
                f"{self.dim}, now {channels} (shape {tuple(x.shape)}). Use one observer per "
                "tensor of a fixed shape.")
        return x.movedim(self.dim, 0).reshape(channels, -1)

    def _update(self, rows: torch.Tensor, batch_amax: torch.Tensor) -> None:
        raise NotImplementedError

    def _amax(self) -> torch.Tensor:  # [C]
        raise NotImplementedError


@register_observer("minmax")
class MinMaxObserver(Observer):
    """Static absolute max over everything observed. The default."""

    def __init__(self, dim: int | None = None, grid: str = "fp8") -> None:
        super().__init__(dim, grid)
        self._max: torch.Tensor | None = None  # [C] float32

    def _update(self, rows, batch_amax):
        self._max = batch_amax if self._max is None else torch.maximum(self._max, batch_amax)

    def _amax(self):
        return self._max


@register_observer("moving_average")
class MovingAverageObserver(Observer):
    """Exponential moving average of each batch's absolute max.

    First batch: ema = amax_1. Then ema = momentum * ema + (1 - momentum) * amax_t.
    """

    def __init__(self, dim: int | None = None, grid: str = "fp8",
                 momentum: float = 0.9) -> None:
        super().__init__(dim, grid)
        if not 0.0 <= momentum < 1.0:
            raise CalibrationError(f"moving_average momentum must be in [0, 1), got {momentum}.")
        self.momentum = float(momentum)
        self._ema: torch.Tensor | None = None  # [C] float32

    def _update(self, rows, batch_amax):
        if self._ema is None:
            self._ema = batch_amax
        else:
            self._ema = self.momentum * self._ema + (1.0 - self.momentum) * batch_amax

    def _amax(self):
        return self._ema


@register_observer("percentile")
class PercentileObserver(Observer):
    """amax = the `percentile`-th percentile of |x|, from a fixed-bin histogram.

    Per channel: `bins` equal-width bins over [0, range]. `range` starts at the first
    batch's max and, when a later batch exceeds it, doubles as often as needed; the old
    counts then merge exactly (2**k old bins into one new). Memory: C * bins int64
    counts, whatever the number of values. The percentile is interpolated linearly inside
    its bin, so it is exact to within one bin width (range / bins, with range < 2 * max
    after growth); it is never above the observed max.
    """

    def __init__(self, dim: int | None = None, grid: str = "fp8",
                 percentile: float = 99.99, bins: int = 2048) -> None:
        super().__init__(dim, grid)
        if not 0.0 < percentile <= 100.0:
            raise CalibrationError(f"percentile must be in (0, 100], got {percentile}.")
        if bins < 1:
            raise CalibrationError(f"percentile observer needs bins >= 1, got {bins}.")
        self.percentile = float(percentile)
        self.bins = int(bins)
        self._hist: torch.Tensor | None = None  # [C, bins] int64 counts
        self._range: torch.Tensor | None = None  # [C] float64, upper edge of the last bin
        self._max: torch.Tensor | None = None  # [C] float32, exact running max

    def bin_width(self) -> torch.Tensor:
        """[] or [C] float64: the current resolution of the histogram."""
        width = self._range / self.bins
        return width[0] if self.dim is None else width

    def _update(self, rows, batch_amax):
        c = rows.shape[0]
        amax64 = batch_amax.to(torch.float64)
        if self._hist is None:
            tiny = torch.finfo(torch.float32).tiny
            self._range = amax64.clamp(min=tiny)
            self._hist = torch.zeros(c, self.bins, dtype=torch.int64, device=rows.device)
            self._max = batch_amax
        else:
            self._grow(amax64)
            self._max = torch.maximum(self._max, batch_amax)
        rng = self._range.to(torch.float32)[:, None]  # [C, 1], >= every value in rows
        idx = (rows / rng * self.bins).long().clamp_(max=self.bins - 1)  # [C, M]
        idx += (torch.arange(c, device=rows.device) * self.bins)[:, None]
        self._hist += torch.bincount(idx.reshape(-1), minlength=c * self.bins).reshape(c, -1)

    def _grow(self, amax64: torch.Tensor) -> None:
        """Double the range of every channel whose new max exceeds it; merge old bins."""
        ratio = (amax64 / self._range).clamp(min=1.0)
        k = torch.ceil(torch.log2(ratio)).long()  # [C] doublings
        k += (self._range * torch.exp2(k.double()) < amax64).long()  # log2 rounding
        if not bool((k > 0).any()):
            return
        self._range = self._range * torch.exp2(k.double())
        shift = k.clamp(max=62)[:, None]  # [C, 1]
        new_bin = torch.arange(self.bins, device=k.device)[None, :] >> shift  # [C, bins]
        merged = torch.zeros_like(self._hist)
        merged.scatter_add_(1, new_bin, self._hist)
        self._hist = merged

    def _amax(self):
        hist = self._hist.to(torch.float64)  # [C, bins]
        cum = hist.cumsum(dim=1)
        target = cum[:, -1:] * (self.percentile / 100.0)  # [C, 1]
        b = torch.searchsorted(cum, target).clamp(max=self.bins - 1)  # [C, 1]
        before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
        count = hist.gather(1, b).clamp(min=1.0)
        frac = ((target - before) / count).clamp(0.0, 1.0)
        value = ((b.double() + frac) * (self._range[:, None] / self.bins))[:, 0]  # [C]
        return torch.minimum(value.to(torch.float32), self._max)


@register_observer("mse")
class MSEObserver(Observer):
    """amax = alpha * max, alpha chosen to minimize the mean squared qdq error on the grid.

    Candidates: `num_candidates` alphas evenly spaced from 1.0 down to `min_alpha`
    (1.0, no clipping, always included and preferred on ties). The error of a candidate
    is estimated per channel, in bounded memory, from
      - the `num_top` largest |x| seen, kept exactly (the tail decides clipping cost), and
      - a uniform random sample of at most `max_samples` values (bottom-k of random keys
        from a generator seeded with `seed`, so repeatable for the same batches),
        of which the values below the smallest kept top value stand for the rest of the
        population, weighted by (count - num_top) / their number.
    While fewer values than the caps have been seen, the estimate is exact.
    Memory: C * (max_samples * 2 + num_top) float32.
    """

    def __init__(self, dim: int | None = None, grid: str = "fp8", *,
                 num_candidates: int = 51, min_alpha: float = 0.5,
                 max_samples: int = 65536, num_top: int = 256, seed: int = 0) -> None:
        super().__init__(dim, grid)
        if num_candidates < 2:
            raise CalibrationError(f"mse observer needs num_candidates >= 2, got {num_candidates}.")
        if not 0.0 < min_alpha < 1.0:
            raise CalibrationError(f"mse min_alpha must be in (0, 1), got {min_alpha}.")
        if max_samples < 1 or num_top < 1:
            raise CalibrationError("mse observer needs max_samples >= 1 and num_top >= 1, got "
                                   f"{max_samples} and {num_top}.")
        alphas = torch.linspace(1.0, min_alpha, num_candidates, dtype=torch.float64)
        alphas[0] = 1.0
        self.alphas = alphas.to(torch.float32)  # [A], descending
        self.max_samples = int(max_samples)
        self.num_top = int(num_top)
        self.seed = int(seed)
        self._gen: torch.Generator | None = None
        self._max: torch.Tensor | None = None  # [C] float32
        self._top: torch.Tensor | None = None  # [C, <=num_top] float32, largest |x|
        self._sample: torch.Tensor | None = None  # [C, <=max_samples] float32
        self._keys: torch.Tensor | None = None  # [C, <=max_samples] float32 in [0, 1)

    def _update(self, rows, batch_amax):
        c, m = rows.shape
        self._max = batch_amax if self._max is None else torch.maximum(self._max, batch_amax)
        # Largest values: only those above a full row's smallest kept value can get in.
        cand = rows
        if self._top is not None and self._top.shape[1] == self.num_top:
            (cand,) = _columns_with(rows, rows > self._top.amin(dim=1, keepdim=True), True)
        top = cand if self._top is None else torch.cat([self._top, cand], dim=1)
        if top.shape[1] > self.num_top:
            top = top.topk(self.num_top, dim=1).values
        self._top = top
        # Uniform sample: the values with the max_samples smallest random keys.
        if self._gen is None:
            self._gen = torch.Generator(device=rows.device).manual_seed(self.seed)
        keys = torch.rand(c, m, generator=self._gen, device=rows.device)  # [C, M]
        values = rows
        if self._keys is not None and self._keys.shape[1] == self.max_samples:
            # Full: only keys below a row's current largest kept key can get in.
            below = keys < self._keys.amax(dim=1, keepdim=True)
            keys, values = _columns_with(keys, below, False, rows)
            if keys.shape[1] == 0:
                return
        if self._keys is not None:
            keys = torch.cat([self._keys, keys], dim=1)
            values = torch.cat([self._sample, values], dim=1)
        if keys.shape[1] > self.max_samples:
            pick = keys.topk(self.max_samples, dim=1, largest=False).indices
            keys, values = keys.gather(1, pick), values.gather(1, pick)
        self._keys, self._sample = keys, values  # `rows` is ours (made by _rows), never x

    def errors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only: (alphas [A], estimated mean squared qdq error [A, C]) float32."""
        if self.num_batches == 0:
            self.amax()  # raises NotObservedError
        count = self.num_values
        top = self._top  # [C, k]
        if count <= self._sample.shape[1]:  # the sample holds every value: exact
            top = top[:, :0]
            rest, weight = self._sample, torch.ones(top.shape[0], device=top.device)
        else:
            below = self._sample < top.amin(dim=1, keepdim=True)  # [C, S]
            rest = torch.where(below, self._sample, torch.zeros_like(self._sample))
            n = below.sum(dim=1).to(torch.float32)  # [C]
            weight = torch.where(n > 0, (count - top.shape[1]) / n.clamp(min=1.0),
                                 torch.zeros_like(n))
        errs = []
        for alpha in self.alphas.tolist():
            scale = scale_from_amax(alpha * self._max, self.qmax)[:, None]  # [C, 1]
            e_top = (top - self.grid.qdq(top, scale)).square().sum(dim=1)  # [C]
            e_rest = (rest - self.grid.qdq(rest, scale)).square().sum(dim=1)  # zeros add 0
            errs.append((e_top + weight * e_rest) / count)
        return self.alphas.clone(), torch.stack(errs)  # [A], [A, C]

    def _amax(self):
        alphas, errs = self.errors()
        best = errs.argmin(dim=0)  # [C]; first minimum = largest alpha on ties
        return alphas.to(self._max.device)[best] * self._max


def _columns_with(score: torch.Tensor, mask: torch.Tensor, largest: bool,
                  *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Columns of score [C, M] (and of `others`, same shape) holding every masked entry.

    `mask` must select the most extreme scores of each row (a threshold on `score`).
    One row: exactly the masked entries. Several rows: each row's n most extreme entries,
    n = the largest masked count, so every row keeps all of its masked ones.
    """
    if score.shape[0] == 1:
        idx = mask[0].nonzero().squeeze(1)
        return tuple(t[:, idx] for t in (score, *others))
    n = int(mask.sum(dim=1).max())
    if n >= score.shape[1]:
        return (score, *others)
    pick = score.topk(n, dim=1, largest=largest).indices
    return tuple(t.gather(1, pick) for t in (score, *others))
