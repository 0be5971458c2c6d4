"""The real English text qserve measures perplexity on, and its calibration twin.

Source: the Python Language Reference as shipped inside CPython (`pydoc_data.topics`,
PSF license): human-written technical prose with code, present offline on every machine
that has Python. Topics are split by a hash of their name into two disjoint sets:
    held-out (perplexity, evals/golden/heldout_text.jsonl)  ~30% of the text
    calibration (calib/data/default_calib.jsonl)           the rest
The files are committed with their sha256 so every machine measures the same text, even
on another Python version; `python -m qserve.evals.golden_text --write ROOT` rebuilds
them from the running Python (the digests then change only if CPython's text did).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..runtime.atomic_file import write_text_atomic

HELDOUT_FILE = Path(__file__).parent / "golden" / "heldout_text.jsonl"


def is_heldout(topic: str) -> bool:
    return hashlib.sha256(topic.encode()).digest()[0] < 40


def load_heldout_text(path: Path = HELDOUT_FILE) -> list[str]:
    """The held-out documents, in file order. Never used for calibration."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def heldout_token_ids(tokenizer) -> list[int]:
    """The held-out documents joined by blank lines, as one token sequence (the benchmarks
    cut their prompts of real text from it)."""
    return tokenizer.encode("\n\n".join(load_heldout_text()))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_split(root: Path) -> dict[str, str]:
    """Write both files under the project root; return {relative path: sha256}."""
    from pydoc_data.topics import topics

    source = f"Python {sys.version.split()[0]} Language Reference (pydoc_data.topics)"
    held, calib = [], []
    for name in sorted(topics):
        row = {"id": name, "source": source, "text": topics[name]}
        (held if is_heldout(name) else calib).append(row)
    out = {
        "evals/golden/heldout_text.jsonl": held,
        "calib/data/default_calib.jsonl": calib,
    }
    digests = {}
    for rel, rows in out.items():
        _write_jsonl(root / rel, rows)
        digests[rel] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
    return digests


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python -m qserve.evals.golden_text --write PROJECT_ROOT")
    for rel, digest in write_split(Path(sys.argv[2])).items():
        print(f"{digest}  {rel}")
