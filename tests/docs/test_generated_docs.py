"""The README and docs/ stay true to the code: the generated pages (the command reference,
the index of generated reports and the README's results table) are not stale, the README's
test command is the one CI runs, and every relative link in the README and docs/ resolves."""

import re
import shutil
from pathlib import Path

import pytest

from qserve.runtime.benchmark import cli_reference, results_index

ROOT = Path(__file__).resolve().parents[2]
TEST_COMMAND = "bash .ci/setup && .venv/bin/python -m pytest tests -q"
SETUP_AND_SERVE = "bash .ci/setup && .venv/bin/qserve serve"


def test_cli_reference_is_current(capsys):
    """docs/reference/cli.md is what the click commands print; a changed --help makes it stale
    (rerun `python -m qserve.runtime.benchmark.cli_reference`)."""
    assert cli_reference.main(["--check", "--out", str(ROOT / "docs/reference/cli.md")]) == 0, \
        capsys.readouterr().err


def test_cli_reference_check_fails_when_stale(tmp_path):
    page = tmp_path / "cli.md"
    assert cli_reference.main(["--check", "--out", str(page)]) == 1  # missing
    assert cli_reference.main(["--out", str(page)]) == 0
    assert cli_reference.main(["--check", "--out", str(page)]) == 0
    text = page.read_text()
    assert "## qserve serve" in text and "--kv-cache-gib" in text and "## qserve gateway export" in text
    page.write_text(text.replace("--kv-cache-gib", "--kv-cache-gb"))
    assert cli_reference.main(["--check", "--out", str(page)]) == 1


def test_results_index_is_current(capsys):
    """docs/generated/index.md and the README's results block list every report in
    docs/generated/ as it is now (rerun `python -m qserve.runtime.benchmark.results_index`)."""
    assert results_index.main(["--check", "--root", str(ROOT)]) == 0, capsys.readouterr().err


def _checkout_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "docs" / "generated", tmp_path / "docs" / "generated")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def _outside_block(text: str) -> str:
    return text[:text.index(results_index.BEGIN)] + text[text.index(results_index.END):]


def test_results_index_goes_stale_with_a_new_report(tmp_path):
    root = _checkout_copy(tmp_path)
    (root / "docs/generated/spec.md").write_text(
        "# spec: generated results\n\nMeasures speculative decoding. Written by `python -m "
        "qserve.runtime.benchmark.record spec ...`, one\nsection per CPU class.\n\n"
        "<!-- begin amx --threads 2 -->\n## spec --threads 2 on amx\n\n"
        "`python -m qserve.runtime.benchmark.record spec --threads 2`: 2030-01-02 03:04 UTC, "
        "Some Xeon (amx, 2 CPUs), qserve abc1234\n\n```\nout\n```\n<!-- end amx --threads 2 -->\n")
    assert results_index.main(["--check", "--root", str(root)]) == 1
    assert results_index.main(["--root", str(root)]) == 0
    assert results_index.main(["--check", "--root", str(root)]) == 0
    index = (root / "docs/generated/index.md").read_text()
    row = next(line for line in index.splitlines() if line.startswith("| [spec.md]"))
    assert "Some Xeon (amx, 2 CPUs)" in row and "2030-01-02 03:04 UTC" in row
    assert "abc1234" in row and "speculative decoding" in row
    readme = (root / "README.md").read_text()
    assert "[spec.md](docs/generated/spec.md)" in readme
    # the rest of the README is untouched
    assert _outside_block(readme) == _outside_block((ROOT / "README.md").read_text())
    # a removed report goes stale too
    (root / "docs/generated/spec.md").unlink()
    assert results_index.main(["--check", "--root", str(root)]) == 1


def test_readme_is_a_short_manual_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    indented = {line.strip() for line in readme.splitlines() if line.startswith("    ")}
    assert SETUP_AND_SERVE in indented and TEST_COMMAND in indented


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_home_directory(page):
    """Reports and guides speak of `~/.cache/qserve/...`, never of one machine's home
    (benchmark/record.py writes the home as ~)."""
    text = page.read_text()
    assert not re.search(r"/root/|/home/[A-Za-z]", text), page.relative_to(ROOT)
