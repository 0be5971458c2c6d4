"""The bf16 reference's per-document results: shipped for built-in models, else cached.

A gate compares an artifact's per-document results with its bf16 source's on the same
documents. Computing the source's is the other half of a cold `qserve eval`, and on a CPU
without native bf16 matmuls (AVX2) the slower half. For built-in models the package ships
them (SmolLM2: default and full suites; Qwen2.5-Coder: default), recorded once by the
command below, so a cold eval computes only the artifact:

    python -m qserve.evals.reference_values smollm2-135m --suite default --write

A shipped file is found by its key (`shipped_key`): the reference checkpoint's digest, the
golden datasets' digests (with the agreement prompts' reference outputs), the tasks'
configs, the document limit and ADAPTER_VERSION, which runner.py bumps whenever the
engine's outputs change. A change to any of them leaves the file unused (the eval then
computes the reference here, as before) and fails tests/evals/test_reference_values.py,
which names the command that records it again. The per-machine cache key also holds the
qserve version (`cache_key`).

    lookup(ref_digest, suite, datasets, recompute) -> ReferenceValues | None
        shipped file (unless recompute) -> cache -> None (the caller computes and caches)

File: {"format", "key", "reference": {spec, digest}, "suite": {tasks, limit},
"adapter_version", "datasets", "recorded": {qserve, torch, cpu_class, created, seconds},
"values": task -> metric -> doc id -> value}; a value list is a tuple in DocValues.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..kernels.cache import cache_root
from ..runtime.atomic_file import write_json_atomic, write_text_atomic
from ..runtime.formats.errors import QserveError
from ..runtime.formats.manifest import package_versions
from .gates import GateSuite
from .golden_tasks import GOLDEN_DIR
from .task_configs import TASKS_DIR

SHIPPED_DIR = GOLDEN_DIR / "reference"
FORMAT = 1
SOURCES = ("shipped", "cached", "computed")  # where a run's reference results came from

DocValues = dict[str, dict[str, dict[int, object]]]  # task -> metric -> doc id -> value


class ReferenceValuesError(QserveError):
    pass


@dataclass
class ReferenceValues:
    values: DocValues
    source: str  # one of SOURCES
    path: Path | None  # the file read or written
    recorded: dict | None = None  # a shipped file's provenance


def _key(ref_digest: str, suite: GateSuite, datasets: dict[str, str], extra: dict) -> str:
    from .runner import ADAPTER_VERSION

    h = hashlib.sha256()
    h.update(json.dumps({"reference": ref_digest, "datasets": datasets, "limit": suite.limit,
                         "tasks": {t: (TASKS_DIR / f"{t}.yaml").read_text() for t in suite.tasks},
                         "adapter": ADAPTER_VERSION, **extra},
                        sort_keys=True).encode())
    return h.hexdigest()[:24]


def shipped_key(ref_digest: str, suite: GateSuite, datasets: dict[str, str]) -> str:
    """What a shipped file answers for: no package version (ADAPTER_VERSION stands for the
    engine's outputs)."""
    return _key(ref_digest, suite, datasets, {})


def cache_key(ref_digest: str, suite: GateSuite, datasets: dict[str, str]) -> str:
    """The per-machine cache's key: also the qserve version."""
    return _key(ref_digest, suite, datasets, {"qserve": package_versions().get("qserve")})


def shipped_path(ref_digest: str, key: str) -> Path:
    return SHIPPED_DIR / f"values-{ref_digest[:16]}-{key[:16]}.json"


def cache_dir() -> Path:
    """This machine's eval cache (reference results and agreement outputs)."""
    d = cache_root() / "evals"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_path(ref_digest: str, suite: GateSuite, datasets: dict[str, str]) -> Path:
    return cache_dir() / f"reference-{cache_key(ref_digest, suite, datasets)}.json"


def to_json(values: DocValues) -> dict:
    return {t: {m: {str(d): v for d, v in docs.items()} for m, docs in ms.items()}
            for t, ms in values.items()}


def from_json(raw: dict) -> DocValues:
    return {t: {m: {int(d): (tuple(v) if isinstance(v, list) else v) for d, v in docs.items()}
                for m, docs in metrics.items()} for t, metrics in raw.items()}


def read_shipped(path: Path, ref_digest: str, key: str) -> ReferenceValues:
    """A shipped file, checked against the key it was looked up by."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReferenceValuesError(f"{path}: unreadable shipped reference results ({e}); "
                                   "reinstall qserve, or pass --recompute-reference.") from None
    if raw.get("format") != FORMAT or raw.get("key") != key \
            or raw.get("reference", {}).get("digest") != ref_digest:
        raise ReferenceValuesError(f"{path}: its key or reference digest is not the one its "
                                   "name says; reinstall qserve, or pass --recompute-reference.")
    return ReferenceValues(from_json(raw["values"]), "shipped", path, raw.get("recorded"))


def lookup(ref_digest: str, suite: GateSuite, datasets: dict[str, str],
           recompute: bool = False) -> ReferenceValues | None:
    """The reference's results for these gates: shipped (unless `recompute`), else cached
    on this machine, else None."""
    if not recompute:
        key = shipped_key(ref_digest, suite, datasets)
        path = shipped_path(ref_digest, key)
        if path.is_file():
            return read_shipped(path, ref_digest, key)
    path = cache_path(ref_digest, suite, datasets)
    if path.is_file():
        return ReferenceValues(from_json(json.loads(path.read_text())), "cached", path)
    return None


def write_cache(values: DocValues, ref_digest: str, suite: GateSuite,
                datasets: dict[str, str]) -> ReferenceValues:
    path = cache_path(ref_digest, suite, datasets)
    write_text_atomic(path, json.dumps(to_json(values)))
    return ReferenceValues(values, "computed", path)


def write_shipped(values: DocValues, reference: dict, suite: GateSuite,
                  datasets: dict[str, str], seconds: float) -> Path:
    """Record `values` (computed here) as the package's file for this key."""
    from ..kernels.cpu_class import cpu_class, cpu_flags
    from .runner import ADAPTER_VERSION

    key = shipped_key(reference["digest"], suite, datasets)
    path = shipped_path(reference["digest"], key)
    versions = package_versions()
    write_json_atomic(path, {
        "format": FORMAT, "key": key, "reference": reference,
        "suite": {"tasks": list(suite.tasks), "limit": suite.limit},
        "adapter_version": ADAPTER_VERSION, "datasets": datasets,
        "recorded": {"qserve": versions.get("qserve"), "torch": versions.get("torch"),
                     "cpu_class": cpu_class(cpu_flags()), "seconds": round(seconds, 1),
                     "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "values": to_json(values)})
    return path


def main(argv: list[str] | None = None) -> int:
    """Record the bf16 reference's results for a built-in model's artifact into the package
    (computed here, whatever is shipped or cached)."""
    from .gates import SUITES, load_gates
    from .runner import reference_results

    p = argparse.ArgumentParser(prog="python -m qserve.evals.reference_values",
                                description=main.__doc__)
    p.add_argument("artifact", help="an artifact or a built-in model name (its cached "
                                    "artifact, made if missing): its source is the reference")
    p.add_argument("--suite", choices=sorted(SUITES), default="default")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--write", action="store_true",
                   help=f"write the file under {SHIPPED_DIR.relative_to(GOLDEN_DIR.parents[1])}")
    args = p.parse_args(argv)
    if not args.write:
        p.error("nothing to do without --write")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from ..quantize.builtin_artifact import builtin_artifact

    suite = load_gates(SUITES[args.suite])
    t0 = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=sys.stderr)

    try:
        reference, datasets, values = reference_results(
            builtin_artifact(args.artifact, say, say), suite, progress=say)
    except QserveError as e:  # EvalError among them
        print(f"error: {e}", file=sys.stderr)
        return 1
    path = write_shipped(values, reference, suite, datasets, time.perf_counter() - t0)
    print(f"{path}: {sum(len(d) for ms in values.values() for d in ms.values())} values, "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
