"""The precision benchmarks' shared command line (runtime/benchmark/budget_probe.py)."""

import pytest

from qserve.runtime.benchmark import activation_precision, lm_head_precision


@pytest.mark.parametrize("bench", [activation_precision, lm_head_precision],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_an_unknown_model_is_refused_with_the_choices(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "nosuch"])
    assert e.value.code == 2
    assert "smollm2-135m" in capsys.readouterr().err
