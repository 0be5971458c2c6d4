"""Run a benchmark and record its output in docs/ as a generated report.

    python -m qserve.runtime.benchmark.record NAME [ARGS...]
    e.g. python -m qserve.runtime.benchmark.record step --batch 1,16 --threads 2

Runs `python -m qserve.runtime.benchmark.NAME ARGS...` in a child process and, if it exits
0, writes its output to docs/generated/NAME.md (`--docs DIR` moves the folder) under a
section for this CPU class and these arguments, with the command that reproduces it, the
date, the CPU model and class and the qserve commit: a rerun on the same machine class
replaces its own section, other machines' sections stay. The file is written
atomically; a failed benchmark writes nothing and exits with its status.
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ...kernels.cpu_class import describe
from ..capabilities import cpu_model
from . import BENCHMARKS
from .report import upsert_section

HEADER = """# {name}: generated results

Measures {about}. Written by `python -m qserve.runtime.benchmark.record {name} ...`, one
section per CPU class and set of arguments; timings vary between runs on a shared machine,
so compare sections run side by side.
"""


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _commit() -> str:
    """The checkout's commit, marked when files differ from it; "unknown" outside git."""
    rev = _git("rev-parse", "--short", "HEAD")
    if not rev:
        return "unknown"
    return rev + (" + local changes" if _git("status", "--porcelain", "--untracked-files=no")
                  else "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    docs = Path("docs")
    if argv[:1] == ["--docs"] and len(argv) > 1:
        docs, argv = Path(argv[1]), argv[2:]
    if not argv or argv[0] not in BENCHMARKS or argv[0] == "record":
        names = ", ".join(n for n in BENCHMARKS if n != "record")
        print(f"usage: python -m qserve.runtime.benchmark.record [--docs DIR] NAME [ARGS...]; "
              f"NAME is one of: {names}", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    cmd = [sys.executable, "-m", f"qserve.runtime.benchmark.{name}", *args]
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        print(f"{name} exited with status {run.returncode}: nothing recorded.", file=sys.stderr)
        return run.returncode
    home = str(Path.home()).rstrip("/")

    def tilde(text: str) -> str:  # no user's home in docs (a home of "/" is no one's)
        return text.replace(home + "/", "~/") if home else text

    output = tilde(run.stdout.rstrip())
    shown = tilde(" ".join(["python -m qserve.runtime.benchmark.record", name,
                            *map(shlex.quote, args)]))  # ~ unquoted: it expands
    args = [tilde(a) for a in args]  # nor in the heading and the section's key
    klass = describe()  # under QSERVE_CPU_CLASS: "avx2 (emulated ... on an avx512-bf16 CPU)"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = (f"## {' '.join([name, *args])} on {klass}\n\n"
            f"`{shown}`: {now}, {cpu_model()} ({klass}, {os.cpu_count()} CPUs), "
            f"qserve {_commit()}\n\n```\n{output}\n```\n")
    path = upsert_section(docs / "generated" / f"{name}.md", f"{klass} {' '.join(args)}", body,
                          HEADER.format(name=name, about=BENCHMARKS[name]))
    print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
