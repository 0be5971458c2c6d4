"""Train the difficulty router's classifier from the labelled prompts that ship with qserve.

    python -m qserve.runtime.gateway.difficulty_train [--labels FILE] [--out FILE]

Reads `data/difficulty_labels.jsonl` (one labelled prompt a line, see below), fits an
L2-regularised logistic regression on the rows of the "train" split with numpy (Newton's
method on standardised features: no randomness, so the same labels give byte-identical
weights), and writes `data/difficulty_model.json`, which `DifficultyRouter.load()` reads.
Rows of the "heldout" split are never trained on: the routing measurement
(`python -m qserve.runtime.benchmark.difficulty_routing report`) scores them.

A row of the labels file:

    {"id", "split": "train" | "heldout", "source": "golden" | "constructed", "kind",
     "label": 1 (hard: send to the large model) | 0 (easy: the small model will do),
     "label_from": "model answers" | "construction",
     "prompt": str  (a completion request)  or  "messages": [...]  (a chat request),
     golden rows also: "answer", "small_output", "large_output", "small_correct",
     "large_correct"}

A golden row's label comes from real answers (1 where the large model is right and the
small one wrong, so the small model "answers as well as the large one" everywhere else); a
constructed row's label is the kind of task it was written as.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .difficulty import (
    FEATURE_NAMES,
    MODEL_FORMAT,
    MODEL_VERSION,
    DifficultyModelError,
    features_of_messages,
    prompt_messages,
)

HELDOUT_PERCENT = 30  # share of ids (by hash) kept out of training for the measurement
L2 = 1.0  # ridge penalty on the standardised weights (not on the bias)
SEED = 0  # Newton's method draws nothing; recorded so the model file says so
NEWTON_STEPS = 50
TOLERANCE = 1e-10


def split_of(row_id: str) -> str:
    """"heldout" for HELDOUT_PERCENT% of ids, "train" for the rest: fixed by the id alone
    (sha256), so adding rows never moves an existing row between splits."""
    bucket = int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def row_messages(row: dict) -> list[dict]:
    """The chat messages a labels row stands for (a completion prompt is one user message)."""
    return row["messages"] if "messages" in row else prompt_messages(row["prompt"])


def default_labels_path() -> Path:
    """The labels file shipped in the package (data/difficulty_labels.jsonl)."""
    return Path(str(resources.files(__package__) / "data" / "difficulty_labels.jsonl"))


def default_model_path() -> Path:
    """Where the shipped model file lives (data/difficulty_model.json)."""
    return Path(str(resources.files(__package__) / "data" / "difficulty_model.json"))


def read_labels(path: str | Path) -> list[dict]:
    """The rows of a labels file; DifficultyModelError (naming the file and line) for a row
    that is not JSON or lacks "id", "label" or a prompt."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DifficultyModelError(f"{path}: cannot read the labels file ({exc})") from exc
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DifficultyModelError(f"{path}:{n}: not JSON ({exc.msg})") from exc
        if (not isinstance(row, dict) or "id" not in row or row.get("label") not in (0, 1)
                or ("prompt" not in row and "messages" not in row)):
            raise DifficultyModelError(
                f"{path}:{n}: a labels row needs \"id\", \"label\" (0 or 1) and \"prompt\" or "
                "\"messages\"")
        rows.append(row)
    return rows


@dataclass(frozen=True)
class TrainedModel:
    """Standardisation and logistic-regression weights, as written to the model file."""

    mean: list[float]
    scale: list[float]
    weights: list[float]
    bias: float
    rows: int
    positives: int

    def to_json(self, labels_sha256: str) -> dict:
        return {
            "format": MODEL_FORMAT, "version": MODEL_VERSION, "features": list(FEATURE_NAMES),
            "mean": self.mean, "scale": self.scale, "weights": self.weights,
            "bias": self.bias,
            "training": {"rows": self.rows, "positives": self.positives, "l2": L2,
                         "seed": SEED, "method": "logistic regression, Newton, numpy",
                         "labels_sha256": labels_sha256},
        }


def feature_matrix(rows: list[dict]) -> np.ndarray:
    """One row of features (FEATURE_NAMES order) per labelled row."""
    return np.array([features_of_messages(row_messages(r)) for r in rows], dtype=np.float64)


def fit(x: np.ndarray, y: np.ndarray) -> TrainedModel:
    """L2-regularised logistic regression by Newton's method on standardised columns.
    Deterministic: the same x and y give the same weights, bit for bit."""
    if len(y) == 0 or y.min() == y.max():
        raise DifficultyModelError("training needs rows of both labels (0 and 1)")
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale == 0] = 1.0  # a constant column: weight stays 0 under the penalty
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    penalty = np.full(z.shape[1], L2)
    penalty[-1] = 0.0  # the bias is not shrunk
    w = np.zeros(z.shape[1])
    for _ in range(NEWTON_STEPS):
        p = 1.0 / (1.0 + np.exp(-(z @ w)))
        grad = z.T @ (p - y) + penalty * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty)
        step = np.linalg.solve(hess, grad)
        w -= step
        if float(np.abs(step).max()) < TOLERANCE:
            break
    r = lambda a: [round(float(v), 10) for v in a]  # noqa: E731
    return TrainedModel(mean=r(mean), scale=r(scale), weights=r(w[:-1]),
                        bias=round(float(w[-1]), 10), rows=len(y), positives=int(y.sum()))


def train(rows: list[dict]) -> TrainedModel:
    """Fit on the rows of the train split, in id order (the file's order does not matter)."""
    train_rows = sorted((r for r in rows if r.get("split", split_of(r["id"])) == "train"),
                        key=lambda r: r["id"])
    y = np.array([float(r["label"]) for r in train_rows])
    return fit(feature_matrix(train_rows), y)


def write_model(labels: str | Path, out: str | Path) -> dict:
    """Train on `labels`, write the model JSON to `out` (sorted keys, one trailing newline),
    and return what was written."""
    labels = Path(labels)
    model = train(read_labels(labels))
    digest = hashlib.sha256(labels.read_bytes()).hexdigest()
    doc = model.to_json(digest)
    Path(out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.gateway.difficulty_train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default=None, help="labels JSONL (default: the shipped one)")
    ap.add_argument("--out", default=None, help="model JSON (default: the shipped one)")
    args = ap.parse_args(argv)
    labels = Path(args.labels) if args.labels else default_labels_path()
    out = Path(args.out) if args.out else default_model_path()
    try:
        doc = write_model(labels, out)
    except DifficultyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t = doc["training"]
    print(f"trained on {t['rows']} rows ({t['positives']} hard) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
