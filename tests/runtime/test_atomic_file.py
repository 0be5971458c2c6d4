"""runtime/atomic_file.py: a file is the old one or the whole new one, and no temp file
is left behind either way."""

import json
import os

import pytest

from qserve.runtime.atomic_file import write_json_atomic, write_text_atomic


def test_writes_and_replaces_with_no_temp_file_left(tmp_path):
    path = tmp_path / "deep" / "er" / "report.json"  # missing folders are made
    assert write_json_atomic(path, {"a": 1}) == path
    assert json.loads(path.read_text()) == {"a": 1} and path.read_text().endswith("\n")
    write_text_atomic(path, "new ünïcode\n")
    assert path.read_text(encoding="utf-8") == "new ünïcode\n"
    assert os.listdir(path.parent) == ["report.json"]


def test_a_failed_rename_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]


def test_data_json_cannot_hold_fails_before_touching_the_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_json_atomic(path, {"when": object()})
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    write_json_atomic(path, {"when": object()}, default=lambda o: "obj")  # `default` converts
    assert json.loads(path.read_text()) == {"when": "obj"}
