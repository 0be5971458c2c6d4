"""Quantize-interrupt check: an interrupted `qserve quantize` must leave no artifact.

`qserve quantize` writes into a temp folder beside the output (`.NAME.tmp-PID`) and
renames it only once the artifact is complete and verified. The check interrupts a run
twice while that folder is being filled: once with SIGINT (Ctrl-C, which may clean up)
and once with SIGKILL (which cannot, so the temp folder stays). Criteria: nothing at the
output path after either; the next run to the same output removes the stale temp
folder, completes, and leaves no temp folder behind.

Shards are written as they fill (`--shard-mib 1`), so "the middle of work" means: after
the first shard file appears in the temp folder, plus a delay. The runs quantize with a
recipe without a quality budget (the default recipe unless the config names one): a
budget quantizes into a scratch folder first and fills the temp folder only at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .reliability_result import CheckResult


@dataclass(frozen=True)
class QuantizeConfig:
    source: str = "smollm2-135m"  # a built-in name or an HF checkpoint directory
    work_dir: Path = Path(".")
    threads: int = 2
    num_samples: int = 8
    seq_len: int = 128
    delay_s: float = 1.0  # after the first shard appears, before the signal
    start_timeout: float = 600.0  # for the temp folder and its first shard to appear
    run_timeout: float = 1800.0  # for the completing run
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    recipe: Path | None = None  # None: the default recipe, written beside the output


PLAIN_RECIPE = "# the default recipe, no quality budget\nkv_cache: {enabled: true}\n"


@dataclass
class Interruption:
    signal: str
    exit_code: int | None
    signalled_after_s: float | None  # None: the work never reached a shard
    temp_files_at_signal: int
    output_exists: bool
    temp_left: list[str]  # temp folders beside the output afterwards
    log_tail: str


def temp_dirs(out: Path) -> list[Path]:
    """The writer's temp folders for `out`: `.NAME.tmp-*` beside it."""
    if not out.parent.is_dir():
        return []
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def quantize_command(cfg: QuantizeConfig, out: Path) -> list[str]:
    return [sys.executable, "-m", "qserve.runtime.cli", "quantize", cfg.source, "--out", str(out),
            "--threads", str(cfg.threads), "--shard-mib", "1",
            "--num-samples", str(cfg.num_samples), "--seq-len", str(cfg.seq_len),
            *(("--recipe", str(cfg.recipe)) if cfg.recipe is not None else ()),
            *cfg.extra_args]


def _env(cfg: QuantizeConfig) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                OMP_NUM_THREADS=str(cfg.threads), **cfg.env)


def interrupt_run(cfg: QuantizeConfig, out: Path, sig: signal.Signals, log: Path) -> Interruption:
    """Start a quantize run, signal it once its temp folder holds a shard, wait for it."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(quantize_command(cfg, out), stdout=f, stderr=subprocess.STDOUT,
                                env=_env(cfg))
        tmp = out.with_name(f".{out.name}.tmp-{proc.pid}")
        t0 = time.monotonic()
        at = None
        files = 0
        while proc.poll() is None and time.monotonic() - t0 < cfg.start_timeout:
            if tmp.is_dir() and any(p.suffix == ".safetensors" for p in tmp.iterdir()):
                time.sleep(cfg.delay_s)
                if proc.poll() is None:
                    files = sum(1 for _ in tmp.iterdir()) if tmp.is_dir() else 0
                    proc.send_signal(sig)
                    at = time.monotonic() - t0
                break
            time.sleep(0.05)
        if at is None and proc.poll() is None:
            proc.kill()  # never reached a shard in time: stop it and report that
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    tail = log.read_text(errors="replace")[-800:]
    return Interruption(sig.name, code, None if at is None else round(at, 2), files,
                        out.exists(), [p.name for p in temp_dirs(out)], tail)


def run_quantize_interrupt(cfg: QuantizeConfig, progress=print) -> CheckResult:
    res = CheckResult("quantize-interrupt")
    t0 = time.monotonic()
    root = Path(cfg.work_dir) / "quantize-interrupt"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = root / "artifact"
    if cfg.recipe is None:
        (root / "recipe.yaml").write_text(PLAIN_RECIPE)
        cfg = replace(cfg, recipe=root / "recipe.yaml")
    progress(f"quantize-interrupt: {cfg.source} -> SIGINT")
    first = interrupt_run(cfg, out, signal.SIGINT, root / "sigint.log")
    for stale in temp_dirs(out):  # each interruption starts from a clean folder
        shutil.rmtree(stale, ignore_errors=True)
    progress("quantize-interrupt: SIGKILL")
    second = interrupt_run(cfg, out, signal.SIGKILL, root / "sigkill.log")
    stale_before = [p.name for p in temp_dirs(out)]
    progress("quantize-interrupt: rerun to completion")
    t1 = time.monotonic()
    with open(root / "rerun.log", "wb") as f:
        proc = subprocess.Popen(quantize_command(cfg, out), stdout=f, stderr=subprocess.STDOUT,
                                env=_env(cfg))
        try:
            code = proc.wait(timeout=cfg.run_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    rerun_s = time.monotonic() - t1
    left_after = [p.name for p in temp_dirs(out)]
    complete = (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    res.measurements.update(
        source=cfg.source, sigint=first.__dict__, sigkill=second.__dict__,
        sigint_exit_code=first.exit_code, sigint_left_temp=bool(first.temp_left),
        sigkill_left_temp=bool(stale_before), stale_before_rerun=stale_before,
        rerun_exit_code=code, rerun_s=round(rerun_s, 1), temp_left_after_rerun=left_after,
        rerun_output_complete=complete,
        rerun_log_tail=(root / "rerun.log").read_text(errors="replace")[-800:])
    for it in (first, second):
        reached = it.signalled_after_s is not None
        res.require(f"{it.signal} sent mid-write", reached,
                    f"after {it.signalled_after_s}s, {it.temp_files_at_signal} files in the "
                    f"temp folder" if reached else "the run never wrote a shard in time "
                    f"(exit code {it.exit_code}); log: {it.log_tail[-300:]}")
        res.require(f"nothing at the output after {it.signal}", not it.output_exists,
                    f"{out.name} {'exists' if it.output_exists else 'absent'}; exit code "
                    f"{it.exit_code}; temp folders left: {it.temp_left or 'none'}")
    if first.temp_left:
        res.notes.append(f"SIGINT left a temp folder behind: {first.temp_left}")
    if not stale_before:
        res.notes.append("SIGKILL left no temp folder, so the stale-folder cleanup was not "
                         "exercised")
    res.require("rerun completes", code == 0 and complete,
                f"exit code {code} after {rerun_s:.0f}s; artifact "
                f"{'complete' if complete else 'missing'}")
    res.require("rerun removed the stale temp folder", not left_after,
                f"before: {stale_before or 'none'}; after: {left_after or 'none'}")
    res.duration_s = time.monotonic() - t0
    return res
