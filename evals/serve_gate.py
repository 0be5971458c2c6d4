"""The eval gates as `qserve serve` applies them: run once on a built-in model's cached
artifact, then refuse any artifact without a passing report for its current files."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ..kernels.cache import cache_root
from ..runtime.formats.artifact_reader import is_artifact, open_artifact
from ..runtime.formats.errors import QserveError
from ..runtime.formats.manifest import Manifest
from .gates import SETTLED_MARGIN, load_gates
from .report import gate_status, record_in_manifest, to_markdown, write_report
from .runner import EvalReport, run_eval


def gate_once(path: str, say: Callable[[str], None]) -> None:
    """Run the default eval gates on the artifact at `path` if its manifest has no eval
    report yet (first use), recording the verdict in its manifest."""
    if Manifest.read(Path(path)).eval is not None:
        return
    say(f"qserve: running the default eval gates on {path} once (about 2 minutes on 2 AMX "
        "cores for SmolLM2, whose reference results ship with qserve; up to 20 on "
        "2 AVX2-only cores)")
    run_gates(path, say)


def run_gates(path: str, say: Callable[[str], None], gates: str | None = None) -> EvalReport:
    """Run the eval gates (`gates` file, default: the package's) on the artifact at
    `path` in-process, write the report under the cache, record the verdict in the
    artifact's manifest and `say` the report; returns it."""
    t0 = time.perf_counter()
    report = run_eval(path, load_gates(gates),
                      progress=lambda m: say(f"[{time.perf_counter() - t0:6.1f}s] {m}"))
    js, _ = write_report(report, cache_root() / "evals" / "reports" /
                         f"{Path(path).name}-{report.artifact['digest'][:12]}")
    record_in_manifest(report, js)
    say(to_markdown(report))
    return report


def check_gates(spec: str, allow_ungated: bool, say: Callable[[str], None]) -> None:
    """QserveError for an artifact without a report that lets it serve (report.gate_status:
    no report, a report for other files, or a settled FAIL), unless allow_ungated (then a
    warning). A verdict the datasets do not settle, a pass or a fail within SETTLED_MARGIN
    standard errors of a threshold, serves with a warning. A bf16 source checkpoint
    passes: nothing was quantized."""
    if not is_artifact(spec):
        return
    st = gate_status(Path(spec), open_artifact(spec).digest)
    if st.may_serve and st.failed:
        say(f"qserve: warning: {spec}: {st.why} (within {SETTLED_MARGIN:g} standard errors "
            f"of the threshold: these datasets do not settle the verdict); serving it. "
            f"`qserve eval {spec} --suite full` measures on more items")
    elif st.may_serve and st.unsettled:
        say(f"qserve: warning: {spec}: {st.why}, but {', '.join(st.unsettled)} within "
            f"{SETTLED_MARGIN:g} standard errors of the threshold: these datasets do not "
            "settle the verdict")
    elif st.may_serve:
        say(f"qserve: {spec}: {st.why}")
    elif allow_ungated:
        say(f"qserve: warning: serving {spec} although {st.why} (--allow-ungated)")
    else:
        raise QserveError(f"{spec}: {st.why}. Run `qserve eval {spec}` (exit 0 means every "
                          "gate passed), or pass --allow-ungated to serve it anyway.")
