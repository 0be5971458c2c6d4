"""A sampling profile of a running server process (py-spy), summarized as hot spots.

py-spy samples the Python stacks of every thread that is on a CPU (idle threads are not
sampled) and writes them collapsed ("frame;frame;... count"). The summary gives each
function's self time (it is the innermost Python frame: the time is spent in it or in
the native code it calls, e.g. a torch op) and inclusive time, as shares of all samples.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import BenchmarkError

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")


@dataclass(frozen=True)
class HotSpot:
    function: str  # "name (package/file.py)"
    self_share: float  # 0..1 of all samples
    inclusive_share: float  # 0..1 of all samples


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m["path"]
    if "torchinductor" in path or re.fullmatch(r"[a-z0-9]{40,}\.py", Path(path).name):
        return f"{m['func']} (torch.compile generated code)"
    for marker in ("site-packages/", "/qserve/", "/runtime/", "/kernels/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker in ("/runtime/", "/kernels/"):
                path = marker.strip("/") + "/" + path
            break
    else:
        path = "/".join(Path(path).parts[-2:])
    return f"{m['func']} ({path})"


def summarize(collapsed: str, top: int = 15) -> tuple[list[HotSpot], int]:
    """Hot spots by self time from py-spy's raw (collapsed) output; and the sample count."""
    self_time: Counter = Counter()
    incl: Counter = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += n
        self_time[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if total == 0:
        return [], 0
    spots = [HotSpot(f, n / total, incl[f] / total) for f, n in self_time.most_common(top)]
    return spots, total


class PySpy:
    """`py-spy record` attached to `pid` until stopped; a context manager."""

    def __init__(self, pid: int, out: Path, rate: int = 50) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).is_file():
            raise BenchmarkError("profiling needs py-spy: pip install py-spy")
        self.cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                    "--output", str(out), "--nonblocking"]
        self.out = out

    def __enter__(self) -> "PySpy":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.out.is_file():
            raise BenchmarkError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
