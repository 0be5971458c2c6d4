"""The dispatch benchmark runs each route on the real C kernel and reports all five."""

import pytest

from qserve.kernels import native_fp8_gemv
from qserve.runtime.benchmark import dispatch


@pytest.mark.skipif(native_fp8_gemv._library() is None, reason="no C FP8 linear here")
def test_every_route_calls_the_kernel_and_is_reported(capsys):
    table = dispatch.routes(threads=1)
    assert set(table) == {"step program", "ctypes", "python wrapper", "torch.library",
                          "custom_op"}
    assert table["step program"][1] == dispatch.PROGRAM_CALLS
    for fn, _ in table.values():
        fn()  # each route reaches the kernel without an error
    dispatch.main(["--calls", "20", "--threads", "1", "--layers", "2"])
    out = capsys.readouterr().out
    for name in table:
        assert f"  {name} " in out
    assert "2 layers x 11 calls" in out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        dispatch.main(["--calls", "0"])
