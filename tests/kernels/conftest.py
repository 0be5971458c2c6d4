"""Triton kernels run on CPU under the Triton interpreter in these tests.

TRITON_INTERPRET is read when a `@triton.jit` function is defined, so it is set here,
before any test module imports a kernel (kernels/triton_*.py). The torch-path tests
of this folder never import Triton kernels, so the variable changes nothing for them.

Random inputs are fresh each run: the `seed` fixture draws a seed, prints it (pytest
shows it with a failure) and records it in the test report; QSERVE_TEST_SEED=<n>
replays a failing run.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def seed(request) -> int:
    value = int(os.environ.get("QSERVE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    request.node.user_properties.append(("seed", value))
    print(f"seed={value} (replay: QSERVE_TEST_SEED={value})")
    return value
