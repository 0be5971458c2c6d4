"""Where a built-in model's FP8 artifact lives, and when the cached one is used."""

from qserve.quantize.builtin_artifact import artifact_path, cached_builtin_artifact
from qserve.runtime.formats.manifest import MANIFEST_FILE


def test_cached_artifact_is_used_only_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    path = artifact_path("smollm2-135m")
    assert path == tmp_path / "artifacts" / "smollm2-135m-fp8"
    assert cached_builtin_artifact("smollm2-135m") == "smollm2-135m"  # none made yet
    path.mkdir(parents=True)
    (path / MANIFEST_FILE).write_text("{}")
    assert cached_builtin_artifact("smollm2-135m") == str(path)
    assert cached_builtin_artifact("/some/checkpoint") == "/some/checkpoint"  # not built-in
