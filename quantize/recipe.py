"""Quantization recipe: what to quantize and how, read from YAML and validated.

    weights:      {type: fp8 | int8, granularity: channel | tensor, observer: minmax,
                   algorithm: gptq | rtn}
                  # int8: symmetric int8 weights (-127..127, scale amax / 127), every
                  # quantized linear weight-only (W8A16 int, compressed-tensors
                  # "pack-quantized"); no input scales, no smoothing. With
                  # activations.dynamic: W8A8 int8 ("int-quantized"), each input row
                  # quantized to int8 at run time, exact integer sums
    activations:  {observer: minmax, observer_args: {}}      # static per-tensor input scales
                  {dynamic: true}  # or per-token scales at run time (vLLM's CPU build reads it)
    kv_cache:     {enabled: true, granularity: layer | head, observer: minmax}
    smoothing:    {enabled: false, alpha: 0.5, targets: [qkv, gate_up, o, down]}
    ignore:       [lm_head]        # module names kept in bf16; "re:<regex>" matches a pattern
    lm_head:      int8 | fp8 | bf16  # the LM head on its own: int8 or FP8 weights, one scale
                                   # per vocabulary row, weight-only (W8A16), whatever
                                   # weights.type is; bf16 keeps it (= "lm_head" in ignore).
                                   # Unset: as ignore and weights say. Set, ignore's default
                                   # no longer names lm_head.
    weight_only:  []               # linears with FP8 weights and unquantized input (W8A16;
                                   # all of them with weights.type int8)
    budget:       {ppl: 0.0, kl: 0.0}   # > 0: keep what it takes within +ppl word
                                        # perplexity and/or kl nats of next-token KL
    mla:          {rank: 0}        # > 0 or auto: true: convert attention to latent (MLA) first
    calibration:  {num_samples: 32, seq_len: 512, seed: 0}

Every key is checked: an unknown key is rejected with its path named (`weights.granulrity`),
as is a bad value, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from ..runtime.formats.errors import QserveError


class RecipeError(QserveError):
    """The recipe file is unreadable or has an unknown key or a bad value."""


@dataclass(frozen=True)
class WeightScheme:
    type: str = "fp8"  # fp8: E4M3 codes; int8: int codes, weight-only (calib/grids.py)
    granularity: str = "channel"  # channel: one scale per output row; tensor: one scale
    observer: str = "minmax"
    observer_args: dict = field(default_factory=dict)
    algorithm: str = "gptq"  # rtn: round to nearest; gptq: error-compensating rounding
    gptq_block_size: int = 128
    gptq_dampening: float = 0.01


@dataclass(frozen=True)
class ActivationScheme:
    observer: str = "minmax"  # static per-tensor input scale of every quantized linear
    observer_args: dict = field(default_factory=dict)
    # True: no static input scales; each input row is quantized with its own scale at run
    # time (compressed-tensors strategy "token", dynamic), the layout vLLM's CPU build serves
    dynamic: bool = False


@dataclass(frozen=True)
class KVCacheScheme:
    enabled: bool = True
    granularity: str = "layer"  # layer: one k and one v scale per layer; head: per KV head
    observer: str = "minmax"
    observer_args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SmoothingScheme:
    """SmoothQuant-style per-channel factors folded into the producing op (smoothing.py)."""

    enabled: bool = False
    alpha: float = 0.5  # s = max|x|^alpha / max|W|^(1 - alpha); 0 leaves x's range alone
    targets: list = field(default_factory=lambda: ["qkv", "gate_up", "o", "down"])


@dataclass(frozen=True)
class BudgetScheme:
    """The quality budget (quantize/budget.py): both 0 = none; else the largest relative
    increase of word perplexity (ppl, 0.01 = +1%) and/or the largest mean next-token KL
    from the source (kl, nats) on `num_samples` x `seq_len` tokens of the calibration
    corpus (other samples than calibration's), choosing what stays closer to bf16.
    kv_context: the context length at which a bf16 KV cache's extra bytes per decoded
    token are counted."""

    ppl: float = 0.0
    kl: float = 0.0
    num_samples: int = 4
    seq_len: int = 512
    kv_context: int = 1024

    @property
    def enabled(self) -> bool:
        return self.ppl > 0 or self.kl > 0


ROPE_SELECT = ("heads", "pairs")  # MLAScheme.rope_select
HEAD_FORMATS = ("int8", "fp8", "bf16")  # Recipe.lm_head ("" = unset)
QUANTIZED_HEADS = ("int8", "fp8")  # the head formats that quantize it (weight-only, per row)


@dataclass(frozen=True)
class MLAScheme:
    """GQA -> MLA conversion before calibration (quantize/mla_convert.py). rank: the latent
    rank (0: no conversion); auto: the smallest rank within `budget` (relative increase of
    token perplexity on held-out calibration-corpus text, 0.05 = +5%), searched over
    multiples of 16; rope_heads: kv heads' worth of key kept under RoPE (1 writes
    DeepSeek-V3's layout); rope_select: which keys keep it — "heads" the first
    `rope_heads` mixed kv heads whole (RoRoPE), "pairs" as many (frequency pair, mixed
    head) slots, per layer those where dropping RoPE would cost the most over distances
    up to `rope_span` tokens (a qserve-only layout, a RoPE table per layer);
    distill_steps: layer-local distillation steps per layer (the source model's
    attention outputs as targets; 0: none); distill_model_steps: then
    whole-model distillation steps (all converted attention projections at once, towards
    the source's next-token distribution, one row of up to `distill_model_rows` rows of
    `distill_model_seq_len` tokens (at most the model's context) per step, peak learning
    rate `distill_model_lr`; 0: none). The covariances and the layer-local
    distillation read `num_samples` x `seq_len` calibration tokens; rows that the held-out
    measurement uses are never trained on."""

    rank: int = 0
    auto: bool = False
    budget: float = 0.05
    rope_heads: int = 1
    rope_select: str = "heads"
    rope_span: int = 2048
    distill_steps: int = 0
    distill_lr: float = 3e-4
    distill_model_steps: int = 0
    distill_model_lr: float = 3e-5
    distill_model_rows: int = 128
    distill_model_seq_len: int = 512
    num_samples: int = 16
    seq_len: int = 512

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.auto


@dataclass(frozen=True)
class CalibrationParams:
    # 32 x 512 tokens: 64 took 1.8x the time for no better artifact on SmolLM2 (minmax
    # input scales only grow with more text); docs/quantization.md, "Calibration size"
    num_samples: int = 32
    seq_len: int = 512
    seed: int = 0
    text_field: str = "text"


@dataclass(frozen=True)
class Recipe:
    weights: WeightScheme = field(default_factory=WeightScheme)
    activations: ActivationScheme = field(default_factory=ActivationScheme)
    kv_cache: KVCacheScheme = field(default_factory=KVCacheScheme)
    smoothing: SmoothingScheme = field(default_factory=SmoothingScheme)
    budget: BudgetScheme = field(default_factory=BudgetScheme)
    mla: MLAScheme = field(default_factory=MLAScheme)
    ignore: tuple[str, ...] = ("lm_head",)
    # linears whose FP8 weight reads an unquantized input (W8A16): no static input scale
    weight_only: tuple[str, ...] = ()
    calibration: CalibrationParams = field(default_factory=CalibrationParams)
    # the LM head's own format (HEAD_FORMATS): "int8" | "fp8" weight-only with one scale a
    # row, "bf16" (then "lm_head" is in ignore); "": as `ignore` and `weights` say
    lm_head: str = ""

    def is_ignored(self, module_name: str) -> bool:
        return _matches(self.ignore, module_name)

    def _own_head(self, module_name: str) -> bool:
        """module_name is the LM head and the recipe gives it its own 8-bit format."""
        return module_name == "lm_head" and self.lm_head in QUANTIZED_HEADS

    def weight_type(self, module_name: str) -> str:
        """What a quantized linear's weight codes are: "fp8" (E4M3) or "int8"."""
        return self.lm_head if self._own_head(module_name) else self.weights.type

    def weight_granularity(self, module_name: str) -> str:
        """A quantized linear's weight scales: "channel" (one a row) or "tensor"."""
        return "channel" if self._own_head(module_name) else self.weights.granularity

    def is_weight_only(self, module_name: str) -> bool:
        """True for a quantized linear whose input stays in the compute dtype (every one
        with int8 weights unless the inputs are dynamic, and an LM head with its own
        format)."""
        return not self.is_ignored(module_name) and (
            (self.weight_type(module_name) == "int8" and not self.activations.dynamic)
            or self._own_head(module_name) or _matches(self.weight_only, module_name))

    def has_static_input(self, module_name: str) -> bool:
        """True for a quantized linear whose input gets a calibrated static scale."""
        return not self.activations.dynamic and not self.is_weight_only(module_name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ignore"] = list(self.ignore)
        d["weight_only"] = list(self.weight_only)
        if not self.lm_head:  # unset: the manifests written before the key read the same
            del d["lm_head"]
        return d


def _matches(patterns: tuple[str, ...], module_name: str) -> bool:
    """module_name is one of `patterns` (a name, or "re:<regex>" matching it whole)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], module_name):
                return True
        elif module_name == pattern:
            return True
    return False


_SECTIONS = {"weights": WeightScheme, "activations": ActivationScheme,
             "kv_cache": KVCacheScheme, "smoothing": SmoothingScheme,
             "budget": BudgetScheme, "mla": MLAScheme, "calibration": CalibrationParams}
_CHOICES = {("weights", "type"): ("fp8", "int8"),
            ("weights", "granularity"): ("channel", "tensor"),
            ("weights", "algorithm"): ("rtn", "gptq"),
            ("kv_cache", "granularity"): ("layer", "head")}


def _check_type(path: str, value, default):
    want = type(default)
    if want is bool:
        ok = isinstance(value, bool)
    elif want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, want)
    if not ok:
        raise RecipeError(f"recipe: {path} must be {want.__name__}, got {value!r}.")


def _section(name: str, cls, raw) -> object:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe: {name} must be a mapping, got {raw!r}.")
    known = {f.name for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise RecipeError(
                f"recipe: unknown key {name}.{key}; {name} takes {', '.join(sorted(known))}.")
    defaults = cls()
    for key, value in raw.items():
        _check_type(f"{name}.{key}", value, getattr(defaults, key))
        choices = _CHOICES.get((name, key))
        if choices and value not in choices:
            raise RecipeError(f"recipe: {name}.{key} must be one of {', '.join(choices)}, "
                              f"got {value!r}.")
    obj = cls(**raw)
    if isinstance(obj, CalibrationParams):
        for key in ("num_samples", "seq_len"):
            if getattr(obj, key) < 1:
                raise RecipeError(f"recipe: calibration.{key} must be >= 1, got {getattr(obj, key)}.")
    if isinstance(obj, SmoothingScheme):
        _check_smoothing(obj)
    if isinstance(obj, BudgetScheme):
        if not 0 <= obj.ppl < 1:
            raise RecipeError(f"recipe: budget.ppl must be in [0, 1) (0.01 = +1%), got {obj.ppl}.")
        if not 0 <= obj.kl < 10:
            raise RecipeError(f"recipe: budget.kl must be in [0, 10) nats, got {obj.kl}.")
        for key, least in (("num_samples", 1), ("seq_len", 16), ("kv_context", 1)):
            if getattr(obj, key) < least:
                raise RecipeError(f"recipe: budget.{key} must be >= {least}, "
                                  f"got {getattr(obj, key)}.")
    if isinstance(obj, MLAScheme):
        _check_mla(obj)
    if hasattr(obj, "observer"):
        from ..calib.observers import make_observer, observer_names

        if "grid" in obj.observer_args:
            raise RecipeError(f"recipe: {name}.observer_args cannot set grid; the grid follows "
                              "weights.type.")
        if obj.observer not in observer_names():
            raise RecipeError(f"recipe: {name}.observer {obj.observer!r} is not one of "
                              f"{', '.join(observer_names())}.")
        try:
            make_observer(obj.observer, **obj.observer_args)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"recipe: {name}.observer_args: {e}") from None
    return obj


def _check_mla(obj: MLAScheme) -> None:
    if obj.rank < 0:
        raise RecipeError(f"recipe: mla.rank must be >= 0 (0: no conversion), got {obj.rank}.")
    if obj.auto and obj.rank:
        raise RecipeError("recipe: mla.rank and mla.auto exclude each other: give a rank, "
                          "or auto: true with a budget.")
    if not 0 < obj.budget < 10:
        raise RecipeError(f"recipe: mla.budget must be in (0, 10) (0.05 = +5%), got {obj.budget}.")
    if obj.rope_select not in ROPE_SELECT:
        raise RecipeError(f"recipe: mla.rope_select must be one of {', '.join(ROPE_SELECT)}, "
                          f"got {obj.rope_select!r}.")
    for key, least in (("rope_heads", 1), ("rope_span", 1), ("distill_steps", 0),
                       ("distill_model_steps", 0), ("distill_model_rows", 1), ("distill_model_seq_len", 16),
                       ("num_samples", 1), ("seq_len", 16)):
        if getattr(obj, key) < least:
            raise RecipeError(f"recipe: mla.{key} must be >= {least}, got {getattr(obj, key)}.")
    for key in ("distill_lr", "distill_model_lr"):
        if not 0 < getattr(obj, key) < 1:
            raise RecipeError(f"recipe: mla.{key} must be in (0, 1), got {getattr(obj, key)}.")


def _check_smoothing(obj: SmoothingScheme) -> None:
    from .smoothing import SMOOTHING_TARGETS

    if not 0.0 <= obj.alpha <= 1.0:
        raise RecipeError(f"recipe: smoothing.alpha must be in [0, 1], got {obj.alpha}.")
    for t in obj.targets:
        if t not in SMOOTHING_TARGETS:
            raise RecipeError(f"recipe: smoothing.targets has {t!r}; each target must be one "
                              f"of {', '.join(SMOOTHING_TARGETS)}.")
    if len(set(obj.targets)) != len(obj.targets):
        raise RecipeError(f"recipe: smoothing.targets lists a target twice: {obj.targets}.")


def recipe_from_dict(raw: dict | None) -> Recipe:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe: the top level must be a mapping, got {type(raw).__name__}.")
    known = {f.name for f in fields(Recipe)}
    for key in raw:
        if key not in known:
            raise RecipeError(f"recipe: unknown key {key}; the recipe takes "
                              f"{', '.join(sorted(known))}.")
    kwargs = {name: _section(name, cls, raw.get(name)) for name, cls in _SECTIONS.items()}
    head = _head_format(raw)
    ignore = list(_module_patterns(raw, "ignore", [] if head in QUANTIZED_HEADS else ["lm_head"]))
    if head in QUANTIZED_HEADS and _matches(tuple(ignore), "lm_head"):
        raise RecipeError(f"recipe: lm_head is {head} but ignore keeps lm_head in bf16; "
                          "drop it from ignore, or set lm_head: bf16.")
    if head == "bf16" and not _matches(tuple(ignore), "lm_head"):
        ignore.append("lm_head")
    weight_only = _module_patterns(raw, "weight_only", [])
    recipe = Recipe(ignore=tuple(ignore), weight_only=tuple(weight_only), lm_head=head, **kwargs)
    if recipe.weights.type == "int8":
        _check_int8(recipe)
    return recipe


def _head_format(raw: dict) -> str:
    """raw["lm_head"], checked: one of HEAD_FORMATS, or "" when absent."""
    head = raw.get("lm_head", "")
    if head != "" and head not in HEAD_FORMATS:
        raise RecipeError(f"recipe: lm_head must be one of {', '.join(HEAD_FORMATS)}, "
                          f"got {head!r}.")
    return head


def _check_int8(recipe: Recipe) -> None:
    """int8 weights are weight-only (W8A16) unless activations.dynamic makes them W8A8."""
    if recipe.smoothing.enabled and not recipe.activations.dynamic:
        raise RecipeError("recipe: smoothing moves input outliers into the weights for "
                          "quantized inputs; weights.type int8 without activations.dynamic "
                          "leaves inputs unquantized, so it would only make the weights harder "
                          "to round. Set smoothing.enabled false (or activations.dynamic "
                          "true for W8A8 int8).")


def _module_patterns(raw: dict, key: str, default: list[str]) -> list[str]:
    """raw[key]: a list of module names or "re:<regex>" patterns, checked."""
    patterns = raw.get(key, default)
    if not isinstance(patterns, list) or not all(isinstance(x, str) for x in patterns):
        raise RecipeError(f"recipe: {key} must be a list of module names, got {patterns!r}.")
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise RecipeError(f"recipe: {key} pattern {pattern!r} is not a regex: {e}.") from None
    return patterns


PRESETS_DIR = Path(__file__).resolve().parent / "recipes" / "presets"


def presets() -> list[str]:
    """The names of the recipes qserve ships (quantize/recipes/presets/NAME.yaml)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_recipe(path: str | Path | None) -> Recipe:
    """The recipe in `path` (a YAML file, or the name of a shipped preset such as
    "w8a8-int8" where no such file exists), or the default recipe when `path` is None."""
    if path is None:
        return Recipe()
    p = Path(path)
    if not p.exists() and str(path) in presets():
        p = PRESETS_DIR / f"{path}.yaml"
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"{p}: recipe file not found (shipped recipes, by name: "
                          f"{', '.join(presets())}).") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"{p}: not valid YAML ({e}).") from None
    try:
        return recipe_from_dict(raw)
    except RecipeError as e:
        raise RecipeError(f"{p}: {e}") from None
