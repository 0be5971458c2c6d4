"""Eval reports: JSON and markdown files (atomic), and the record in the artifact manifest.

The manifest's `eval` entry is what `qserve serve` checks: it names the artifact digest
the report was made for, whether every gate passed, which failed and which are not
settled by the datasets, the gates file and the report's sha256, so a later change to the
artifact's files invalidates it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..runtime.atomic_file import write_json_atomic, write_text_atomic
from ..runtime.formats.manifest import Manifest
from .gates import SETTLED_MARGIN
from .runner import EvalReport


def _fmt(x, digits=4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)


def format_margin(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:+.1f}" + (" (unsettled)" if abs(x) < SETTLED_MARGIN else "")


_REFERENCE_RESULTS = {"shipped": "; its results shipped with qserve",
                      "cached": "; its results cached on this machine",
                      "computed": "; its results computed in this run"}


def to_markdown(report: EvalReport) -> str:
    d = report.to_dict()
    lines = [f"# qserve eval: {'PASS' if d['passed'] else 'FAIL'}", "",
             f"- artifact: `{d['artifact']['path']}` (digest `{d['artifact']['digest'][:16]}`)",
             f"- reference (bf16): `{d['reference']['spec']}` (sha256 "
             f"`{d['reference']['digest'][:16]}`)"
             + _REFERENCE_RESULTS.get(d["reference"].get("results"), ""),
             f"- mode: {d['mode']}" + (f" ({d['endpoint']})" if d["endpoint"] else ""),
             f"- gates: `{d['gates_file']['path']}` (sha256 `{d['gates_file']['sha256'][:16]}`)"
             + (f", limit {d['limit']} documents per task" if d["limit"] else ""),
             f"- {d['created']}, {d['seconds']} s; "
             + ", ".join(f"{k} {v}" for k, v in d["versions"].items()), "",
             "| task | metric | n | value | ± se | reference | gate | statistic | ± se | "
             "margin / se | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in d["metrics"]:
        gate = f"{m['gate']} {m['threshold']}" if m["gate"] else "-"
        lines.append(f"| {m['task']} | {m['metric']} | {m['n']} | {_fmt(m['value'])} | "
                     f"{_fmt(m['value_stderr'], 2)} | {_fmt(m['reference'])} | {gate} | "
                     f"{_fmt(m['statistic'])} | {_fmt(m['statistic_stderr'], 2)} | "
                     f"{format_margin(m['margin_in_stderr'])} | {m['verdict']} |")
    lines += ["", "margin / se: standard errors between the statistic and its threshold, on "
              "the passing side when positive; a verdict within 2 of it is not settled by "
              "these datasets.", "", "Datasets (sha256):", ""]
    lines += [f"- `{name}` `{digest[:16]}`" for name, digest in d["datasets"].items()]
    return "\n".join(lines) + "\n"


def write_report(report: EvalReport, out_dir: Path) -> tuple[Path, Path]:
    """Write report.json and report.md into out_dir; returns their paths."""
    js = out_dir / "report.json"
    md = out_dir / "report.md"
    write_json_atomic(js, report.to_dict())
    write_text_atomic(md, to_markdown(report))
    return js, md


def record_in_manifest(report: EvalReport, report_json: Path) -> None:
    """Store the verdict in the artifact's qserve.json (atomic rewrite)."""
    root = Path(report.artifact["path"])
    manifest = Manifest.read(root)
    manifest.eval = {
        "passed": report.passed, "unsettled": report.unsettled, "failed": report.failed,
        "artifact_digest": report.artifact["digest"],
        "mode": report.mode, "endpoint": report.endpoint, "created": report.created,
        "gates_file": report.gates_file, "limit": report.limit,
        "report": str(report_json),
        "report_sha256": hashlib.sha256(report_json.read_bytes()).hexdigest(),
        "metrics": {f"{r.gate.task}/{r.gate.metric}": r.value for r in report.results},
    }
    manifest.write(root)


def settled_failures(failed: list[str], unsettled: list[str]) -> list[str]:
    """The failing gates whose margin the datasets settle (beyond SETTLED_MARGIN standard
    errors, or without a standard error): a FAIL with any of them refuses to serve."""
    return [g for g in failed if g not in unsettled]


@dataclass(frozen=True)
class GateStatus:
    """What the manifest's eval record allows `qserve serve` to do with an artifact."""

    may_serve: bool
    why: str  # the verdict in words: "gates passed <date>", "its last gate report failed ..."
    unsettled: list[str]  # gates within SETTLED_MARGIN standard errors of their threshold
    failed: list[str]  # gates that failed (all of them unsettled when may_serve)


def gate_status(root: Path, digest: str) -> GateStatus:
    """The serving verdict from the manifest's eval record for an artifact of `digest`.
    A settled FAIL (a gate failing by more than SETTLED_MARGIN standard errors, or one
    without a standard error) refuses. A FAIL whose failing gates are all within the
    margin may serve, as a PASS with unsettled gates does, and the caller warns: these
    datasets cannot tell such an artifact from one that passes (docs/eval-gates.md: the
    bf16 reference computed in fp32 recovers 0.995 +- 0.005 of its own generation score).
    A record without the failed gates' names (written before they were recorded) refuses
    a FAIL."""
    rec = Manifest.read(root).eval
    if not rec:
        return GateStatus(False, "it has no eval gate report", [], [])
    if rec.get("artifact_digest") != digest:
        return GateStatus(False, "its gate report was made for different files", [], [])
    unsettled = list(rec.get("unsettled") or [])
    if rec.get("passed"):
        return GateStatus(True, "gates passed " + str(rec.get("created", "")), unsettled, [])
    failed = rec.get("failed")
    if failed is None:  # which gates failed is not recorded: refused, naming the unsettled
        why = "its last gate report failed"
        if unsettled:
            why += f" (not settled by these datasets: {', '.join(unsettled)})"
        return GateStatus(False, why, unsettled, [])
    failed = list(failed)
    settled = settled_failures(failed, unsettled)
    if settled:
        return GateStatus(False, f"its last gate report failed ({', '.join(settled)}, "
                          f"settled)", unsettled, failed)
    return GateStatus(True, f"its gate report of {rec.get('created', '')} failed "
                      f"{', '.join(failed)} within the datasets' noise", unsettled, failed)
