"""Index the reports in docs/generated/: docs/generated/index.md and the README's results.

    python -m qserve.runtime.benchmark.results_index [--root .] [--check]

Reads every report in docs/generated/ (the sections that `record` writes, JSON reports,
other pages) and writes docs/generated/index.md, one row per section: the report, what it
measures, the machine, date and commit as the report states them. It also rewrites the
block between the README's `<!-- results:begin -->` and `<!-- results:end -->` markers:
one row per report, linking to it. `--check` writes nothing and exits 1 when either is
stale (tests/docs run it). Files are written atomically (a temp file, then os.replace).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from . import BENCHMARKS
from .cli_reference import write_atomic

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
INDEX = "index.md"

# record's line under each section: `COMMAND`: DATE, CPU (CLASS, N CPUs), qserve COMMIT
_STAMP = re.compile(r"^`(?P<cmd>[^`]+)`: (?P<date>\d{4}-\d\d-\d\d[^,]*), (?P<machine>.+), "
                    r"qserve (?P<commit>\S+(?: \+ local changes)?)\s*$", re.M)
_SECTION = re.compile(r"<!-- begin (?P<key>.*?) -->\n(?P<body>.*?)<!-- end (?P=key) -->", re.S)
_MEASURES = re.compile(r"^Measures (?P<what>.+?)\. Written by", re.M | re.S)


@dataclass
class Row:
    file: str
    section: str  # the section's heading, or "" for a whole file
    measures: str
    machine: str
    date: str
    commit: str


def _cell(s: str) -> str:
    return " ".join(s.split()).replace("|", "\\|") or "not stated"


def _md_rows(path: Path) -> list[Row]:
    text = path.read_text(encoding="utf-8")
    m = _MEASURES.search(text)
    if m:
        measures = " ".join(m["what"].split())
    else:  # a page other than record's: its title, or what BENCHMARKS says of its name
        title = re.search(r"^# (.+)$", text, re.M)
        measures = BENCHMARKS.get(path.stem) or (title[1] if title else path.stem)
    rows = []
    for sec in _SECTION.finditer(text):
        head = re.search(r"^## (.+)$", sec["body"], re.M)
        stamp = _STAMP.search(sec["body"])
        rows.append(Row(path.name, head[1] if head else sec["key"], measures,
                        stamp["machine"] if stamp else "", stamp["date"] if stamp else "",
                        stamp["commit"] if stamp else ""))
    if not rows:
        stamp = _STAMP.search(text)
        rows.append(Row(path.name, "", measures, stamp["machine"] if stamp else "",
                        stamp["date"] if stamp else "", stamp["commit"] if stamp else ""))
    return rows


def _json_rows(path: Path) -> list[Row]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        d = {}
    d = d if isinstance(d, dict) else {}
    cmd = str(d.get("command", ""))
    name = re.match(r"python -m qserve\.runtime\.benchmark\.(\w+)", cmd)
    measures = BENCHMARKS.get(name[1], "") if name else ""
    if not measures:  # e.g. gate-noise-avx2.json: the benchmark whose name leads the file's
        stem = path.stem.replace("-", "_")
        measures = next((v for k, v in BENCHMARKS.items() if stem.startswith(k)), path.stem)
    return [Row(path.name, cmd and f"`{cmd}`", measures, str(d.get("machine", "")),
                str(d.get("date", "")), str(d.get("commit", "")))]


def collect(generated: Path) -> list[Row]:
    rows: list[Row] = []
    for p in sorted(generated.iterdir()):
        if p.name == INDEX or p.name.startswith(".") or not p.is_file():
            continue
        if p.suffix == ".md":
            rows += _md_rows(p)
        elif p.suffix == ".json":
            rows += _json_rows(p)
    return rows


def render_index(rows: list[Row]) -> str:
    out = ["# Generated reports", "",
           "<!-- Written by `python -m qserve.runtime.benchmark.results_index`; do not edit by "
           "hand. -->", "",
           "Every report in this folder, one row per section: what it measures and the machine, "
           "date and commit each report states (a report that states none says so). Numbers "
           "hold for the machine and commit they name; rerun the command in a report to "
           "measure yours (`python -m qserve.runtime.benchmark.record NAME ARGS...`).", "",
           "| report | section | measures | machine | date | commit |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| [{r.file}]({r.file}) | {_cell(r.section) if r.section else 'whole file'} "
                   f"| {_cell(r.measures)} | {_cell(r.machine)} | {_cell(r.date)} "
                   f"| {_cell(r.commit)} |")
    return "\n".join(out) + "\n"


def render_readme_block(rows: list[Row]) -> str:
    by_file: dict[str, list[Row]] = {}
    for r in rows:
        by_file.setdefault(r.file, []).append(r)
    out = [BEGIN, "| report | measures | machines | latest date stated |", "|---|---|---|---|"]
    for name, rs in by_file.items():
        dates = sorted(r.date for r in rs if r.date)
        machines = "; ".join(dict.fromkeys(r.machine for r in rs if r.machine))
        out.append(f"| [{name}](docs/generated/{name}) | {_cell(rs[0].measures)} "
                   f"| {_cell(machines)} | {dates[-1] if dates else 'not stated'} |")
    out.append(END)
    return "\n".join(out)


def render_readme(readme: str, rows: list[Row]) -> str:
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return readme[:i] + render_readme_block(rows) + readme[j + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.results_index",
                                 description=__doc__.split("\n\n")[1])
    ap.add_argument("--root", type=Path, default=Path("."),
                    help="the checkout (docs/generated/ and README.md under it)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when the index or the README block is stale")
    args = ap.parse_args(argv)
    generated, readme_path = args.root / "docs" / "generated", args.root / "README.md"
    rows = collect(generated)
    want = {generated / INDEX: render_index(rows),
            readme_path: render_readme(readme_path.read_text(encoding="utf-8"), rows)}
    stale = [p for p, text in want.items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"{p} is stale: run python -m qserve.runtime.benchmark.results_index",
                  file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        write_atomic(p, want[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
