"""The step benchmark's argument checks and its timers (which must undo themselves)."""

import pytest

from qserve.kernels import dispatch
from qserve.runtime.bench_step import main, timed


@pytest.mark.parametrize("argv", [["--batch", "1,x"], ["--tokens", "1"], ["--batch", "0"],
                                  ["--prefill", "-1"]])
def test_bad_arguments_are_refused_before_loading(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert "--batch" in err or "--tokens" in err


def test_timers_wrap_and_restore():
    real = dispatch.store_kv
    totals = {}
    with timed(totals):
        assert dispatch.store_kv is not real
    assert dispatch.store_kv is real
