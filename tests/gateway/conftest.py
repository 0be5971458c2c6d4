"""Gateway test fixtures."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_backend import FakeBackend  # noqa: E402


@pytest.fixture
def two_backends():
    return {"a": FakeBackend("a", model="m", artifact_digest="d-a"),
            "b": FakeBackend("b", model="m", artifact_digest="d-b")}
