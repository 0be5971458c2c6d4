"""The gate-noise benchmark's bookkeeping and a small run on a tiny model (the
measurement itself runs on the real model: docs/eval-gates.md)."""

import json
import sys
from pathlib import Path

import pytest

from qserve.runtime.benchmark import gate_noise


def test_flips_count_items_right_on_one_side_only():
    ref = {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0}
    cand = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    assert gate_noise._flips(ref, cand) == (1, 2)  # (right only in cand, only in ref)


def test_a_task_without_a_gate_or_an_unknown_one_is_refused(capsys):
    assert gate_noise.main(["smollm2-135m", "--tasks", "qserve_agreement"]) == 2
    assert "no default gate" in capsys.readouterr().err
    assert gate_noise.main(["smollm2-135m", "--tasks", "qserve_choice,nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown task(s) nosuch" in err and "qserve_generation" in err


@pytest.mark.parametrize("flag", [["--threads", "0"], ["--candidate-threads", "-1"],
                                  ["--limit", "0"]])
def test_counts_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        gate_noise.main(["smollm2-135m", *flag])
    assert e.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_the_same_numerics_on_both_sides_recover_exactly(tmp_path, capsys):
    """bf16 against bf16 at the same thread count: the same per-item results, so the
    scores are equal and nothing flips."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import write_tiny_llama

    src = write_tiny_llama(tmp_path / "src")
    out = tmp_path / "noise.json"
    assert gate_noise.main([str(src), "--dtype", "bfloat16", "--threads", "1", "--limit", "6",
                            "--tasks", "qserve_choice", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["gates"]
    assert [(r["task"], r["metric"], r["n"]) for r in rows] == [("qserve_choice", "acc", 6)]
    assert rows[0]["candidate"] == rows[0]["reference"]
    assert (rows[0]["gained"], rows[0]["lost"]) == (0, 0)
    assert "| qserve_choice | acc | 6 |" in capsys.readouterr().out
