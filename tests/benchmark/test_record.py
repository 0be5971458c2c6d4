"""`python -m qserve.runtime.benchmark.record`: a benchmark's output becomes a section of a
generated report in docs/, replaced on rerun, other sections kept; failures write nothing."""

from qserve.runtime.benchmark import BENCHMARKS, record
from qserve.runtime.benchmark.report import upsert_section


def test_sections_are_replaced_by_key_and_others_kept(tmp_path):
    path = tmp_path / "r.md"
    upsert_section(path, "avx2 --x 1", "one\n", "# head\n")
    upsert_section(path, "amx --x 1", "two\n", "# head\n")
    upsert_section(path, "avx2 --x 1", "three\n", "# head\n")
    text = path.read_text()
    assert text.startswith("# head\n") and "one" not in text
    assert text.index("three") < text.index("two")  # replaced where it was
    assert text.count("<!-- begin") == 2


def test_record_runs_the_benchmark_and_writes_its_output(tmp_path, capsys):
    rc = record.main(["--docs", str(tmp_path), "dispatch", "--calls", "200", "--threads", "1"])
    assert rc == 0
    text = (tmp_path / "generated" / "dispatch.md").read_text()
    assert "`python -m qserve.runtime.benchmark.record dispatch --calls 200 --threads 1`" in text
    assert "ctypes" in text and "torch.library" in text  # the benchmark's own table
    assert BENCHMARKS["dispatch"] in text


def test_no_home_directory_reaches_the_report(tmp_path, monkeypatch, capsys):
    """An argument under the user's home (an artifact's path) is shown as ~/... in the
    section's heading, its key and the command line, as in the output."""
    import subprocess

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    art = f"{home}/.cache/qserve/artifacts/m"
    real = subprocess.run

    def run(cmd, **kw):  # the benchmark's output, faked; git's answers as they are
        if "qserve.runtime.benchmark.step" not in cmd:
            return real(cmd, **kw)
        return subprocess.CompletedProcess(cmd, 0, stdout=f"model {art}: 3 ms\n")

    monkeypatch.setattr(record.subprocess, "run", run)
    assert record.main(["--docs", str(tmp_path / "docs"), "step", art, "--batch", "1"]) == 0
    text = (tmp_path / "docs" / "generated" / "step.md").read_text()
    assert str(home) not in text
    assert "record step ~/.cache/qserve/artifacts/m --batch 1`" in text
    assert "## step ~/.cache/qserve/artifacts/m --batch 1 on" in text
    assert "model ~/.cache/qserve/artifacts/m: 3 ms" in text
    monkeypatch.setenv("HOME", "/")  # a home of "/" leaves every path as it is
    assert record.main(["--docs", str(tmp_path / "docs2"), "step", art, "--batch", "1"]) == 0
    assert f"record step {art} --batch 1`" in (tmp_path / "docs2/generated/step.md").read_text()


def test_unknown_names_and_failed_runs_record_nothing(tmp_path, capsys):
    assert record.main(["--docs", str(tmp_path), "no_such_bench"]) == 2
    assert "one of: cli," in capsys.readouterr().err
    assert record.main(["--docs", str(tmp_path), "dispatch", "--no-such-flag"]) == 2
    assert "nothing recorded" in capsys.readouterr().err
    assert not (tmp_path / "generated").exists()


def test_every_benchmark_entry_point_is_listed():
    """BENCHMARKS says it lists every benchmark: each module of the package that runs as
    `python -m` (a `__main__` guard) is in it, and every name in it is such a module."""
    import re
    from pathlib import Path

    import qserve.runtime.benchmark as package

    folder = Path(package.__file__).parent
    runnable = {p.stem for p in folder.glob("*.py")
                if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)}
    assert runnable == set(BENCHMARKS)
