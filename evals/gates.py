"""Eval gates: YAML definitions, and verdicts from per-document metric values.

    tasks: [qserve_heldout, qserve_generation, qserve_choice, qserve_agreement]
    limit: null              # documents per task (null: all); for quick checks only
    gates:
      - {task: qserve_heldout, metric: word_perplexity, max_relative_increase: 0.01}
      - {task: qserve_choice, metric: acc, min_recovery: 0.99}
      - {task: qserve_generation, metric: exact_match, min: 0.2}
      - {task: qserve_agreement, metric: prefix_match}          # reported, no threshold

A gate has at most one threshold (a registry of kinds, below). Relative kinds compare the
artifact with the bf16 reference on the same documents. Every statistic gets a standard
error by the jackknife over documents (paired with the reference where it is relative),
so a report shows whether a margin is larger than the noise of the dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import yaml

from ..runtime.formats.errors import QserveError

GATES_DIR = Path(__file__).parent / "gates"
DEFAULT_GATES = GATES_DIR / "default.yaml"
# the package's gate suites by name (`qserve eval --suite NAME`): the same gates, more items
SUITES = {"default": DEFAULT_GATES, "full": GATES_DIR / "full.yaml"}


class GateError(QserveError, ValueError):
    pass


# -- how a metric aggregates per-document values ----------------------------------------
def _mean(xs: Sequence) -> float:
    return sum(float(x) for x in xs) / len(xs)


def _weighted_perplexity(xs: Sequence) -> float:  # per doc: (loglikelihood, weight)
    return math.exp(-sum(ll for ll, _ in xs) / sum(w for _, w in xs))


def _bits_per_byte(xs: Sequence) -> float:  # per doc: (loglikelihood, bytes)
    return -sum(ll for ll, _ in xs) / (sum(b for _, b in xs) * math.log(2))


AGGREGATIONS: dict[str, Callable[[Sequence], float]] = {
    "word_perplexity": _weighted_perplexity,
    "byte_perplexity": _weighted_perplexity,
    "bits_per_byte": _bits_per_byte,
}
LOWER_IS_BETTER = {"word_perplexity", "byte_perplexity", "bits_per_byte"}


def aggregate(metric: str, values: Sequence) -> float:
    return AGGREGATIONS.get(metric, _mean)(values)


# -- gate kinds -------------------------------------------------------------------------
@dataclass(frozen=True)
class GateKind:
    relative: bool  # needs the reference
    statistic: Callable[[float, float | None], float]  # (value, reference) -> statistic
    describe: str
    sign: int  # +1: passes at or above the threshold, -1: at or below

    def passes(self, statistic: float, threshold: float) -> bool:
        return statistic >= threshold if self.sign > 0 else statistic <= threshold


def _ratio(v: float, r: float | None) -> float:
    return v / r if r else (1.0 if v == r else math.inf)


GATE_KINDS: dict[str, GateKind] = {
    "max_relative_increase": GateKind(True, lambda v, r: _ratio(v, r) - 1.0,
                                      "value / reference - 1 <= {t}", -1),
    "min_recovery": GateKind(True, _ratio, "value / reference >= {t}", 1),
    "min": GateKind(False, lambda v, r: v, "value >= {t}", 1),
    "max": GateKind(False, lambda v, r: v, "value <= {t}", -1),
}


@dataclass(frozen=True)
class Gate:
    task: str
    metric: str
    kind: str | None = None  # None: reported only
    threshold: float | None = None

    @property
    def needs_reference(self) -> bool:
        return self.kind is not None and GATE_KINDS[self.kind].relative


@dataclass
class GateSuite:
    tasks: list[str]
    gates: list[Gate]
    limit: int | None = None
    path: Path | None = None
    raw: dict = field(default_factory=dict)

    @property
    def needs_reference(self) -> bool:
        return any(g.needs_reference for g in self.gates)


_GATE_KEYS = {"task", "metric", *GATE_KINDS}


def gates_path(suite: str | None, gates: str | None) -> str | None:
    """The gates file a command was given: --suite NAME (a package suite) or --gates FILE,
    not both; None: the default suite."""
    if suite and gates:
        raise GateError("--suite and --gates both name gate definitions; give one of them.")
    if suite is None:
        return gates
    if suite not in SUITES:
        raise GateError(f"unknown gate suite {suite!r}; known: {', '.join(SUITES)}.")
    return str(SUITES[suite])


def load_gates(path: str | Path | None = None) -> GateSuite:
    from .task_configs import task_names

    p = Path(path) if path else DEFAULT_GATES
    if not p.is_file():
        raise GateError(f"{p}: no such gates file.")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise GateError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise GateError(f"{p}: expected a mapping with 'tasks' and 'gates'.")
    unknown = set(raw) - {"tasks", "gates", "limit"}
    if unknown:
        raise GateError(f"{p}: unknown key(s) {sorted(unknown)}; allowed: tasks, gates, limit.")
    known = task_names()
    tasks = raw.get("tasks") or []
    if not isinstance(tasks, list) or not tasks:
        raise GateError(f"{p}: 'tasks' must be a non-empty list of task names ({', '.join(known)}).")
    for t in tasks:
        if t not in known:
            raise GateError(f"{p}: unknown task {t!r}; known: {', '.join(known)}.")
    limit = raw.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise GateError(f"{p}: 'limit' must be a positive integer or null, got {limit!r}.")
    gates = []
    for i, g in enumerate(raw.get("gates") or []):
        where = f"{p}: gates[{i}]"
        if not isinstance(g, dict):
            raise GateError(f"{where}: expected a mapping like {{task: ..., metric: ..., min: 0.5}}.")
        bad = set(g) - _GATE_KEYS
        if bad:
            raise GateError(f"{where}: unknown key(s) {sorted(bad)}; allowed: task, metric, "
                            f"and one of {', '.join(GATE_KINDS)}.")
        if g.get("task") not in tasks:
            raise GateError(f"{where}: task {g.get('task')!r} is not in 'tasks'.")
        if not isinstance(g.get("metric"), str):
            raise GateError(f"{where}: 'metric' must be a metric name.")
        kinds = [k for k in GATE_KINDS if k in g]
        if len(kinds) > 1:
            raise GateError(f"{where}: one threshold per gate, got {kinds}.")
        kind = kinds[0] if kinds else None
        threshold = None
        if kind:
            threshold = g[kind]
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
                raise GateError(f"{where}: {kind} must be a number, got {threshold!r}.")
            threshold = float(threshold)
        gates.append(Gate(g["task"], g["metric"], kind, threshold))
    if not gates:
        raise GateError(f"{p}: 'gates' is empty; name at least one metric.")
    return GateSuite(list(tasks), gates, limit, p, raw)


# a verdict is settled when its statistic lies at least this many standard errors from the
# threshold (either side); closer, the same artifact may land on either side
SETTLED_MARGIN = 2.0


# -- verdicts ---------------------------------------------------------------------------
@dataclass
class GateResult:
    gate: Gate
    n: int  # documents
    value: float
    value_stderr: float | None
    reference: float | None
    statistic: float | None  # what the threshold is compared with
    statistic_stderr: float | None
    passed: bool | None  # None: reported only

    @property
    def margin_in_stderr(self) -> float | None:
        """How many standard errors the statistic lies on the passing side of the
        threshold (negative: on the failing side). Within about +-2 the verdict is not
        settled by this dataset: the same artifact may land on either side."""
        g = self.gate
        if g.kind is None or self.statistic is None or not self.statistic_stderr:
            return None
        return GATE_KINDS[g.kind].sign * (self.statistic - g.threshold) / self.statistic_stderr

    def to_dict(self) -> dict:
        g = self.gate
        return {"task": g.task, "metric": g.metric, "n": self.n, "value": self.value,
                "value_stderr": self.value_stderr, "reference": self.reference,
                "gate": g.kind, "threshold": g.threshold, "statistic": self.statistic,
                "statistic_stderr": self.statistic_stderr,
                "margin_in_stderr": self.margin_in_stderr,
                "verdict": {True: "pass", False: "FAIL", None: "reported"}[self.passed]}


def jackknife_stderr(n: int, stat: Callable[[list[int]], float]) -> float | None:
    """Standard error of stat(all indices) by leave-one-out over n documents."""
    if n < 2:
        return None
    idx = list(range(n))
    loo = [stat(idx[:i] + idx[i + 1:]) for i in range(n)]
    if not all(math.isfinite(x) for x in loo):
        return None
    mean = sum(loo) / n
    return math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in loo))


def evaluate_gate(gate: Gate, values: dict[int, object],
                  reference: dict[int, object] | None) -> GateResult:
    """values / reference: doc id -> that document's metric value."""
    if not values:
        raise GateError(f"no documents were scored for {gate.task}/{gate.metric}.")
    ids = sorted(values)
    v = [values[i] for i in ids]
    value = aggregate(gate.metric, v)
    value_se = jackknife_stderr(len(v), lambda sel: aggregate(gate.metric, [v[i] for i in sel]))
    ref_value = stat = stat_se = passed = None
    if reference is not None and all(i in reference for i in ids):
        r = [reference[i] for i in ids]
        ref_value = aggregate(gate.metric, r)
    if gate.kind is not None:
        kind = GATE_KINDS[gate.kind]
        if kind.relative and ref_value is None:
            raise GateError(f"gate {gate.kind} on {gate.task}/{gate.metric} needs reference "
                            "results for the same documents.")
        stat = kind.statistic(value, ref_value)
        if kind.relative:
            r = [reference[i] for i in ids]
            stat_se = jackknife_stderr(len(v), lambda sel: kind.statistic(
                aggregate(gate.metric, [v[i] for i in sel]),
                aggregate(gate.metric, [r[i] for i in sel])))
        else:
            stat_se = value_se
        passed = bool(kind.passes(stat, gate.threshold))
    return GateResult(gate, len(v), value, value_se, ref_value, stat, stat_se, passed)
