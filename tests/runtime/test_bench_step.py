"""The step benchmark's argument checks and its timers (which must undo themselves)."""

import pytest

from qserve.kernels import dispatch
from qserve.runtime.benchmark.step import main, timed


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


def test_prefill_needs_text_for_distinct_prompts():
    """Each timed prefill (and the warm-up) gets its own slice of the held-out text, so no
    prefix-cache hit can shorten one; too little text is refused before anything runs."""
    from types import SimpleNamespace

    from qserve.evals.golden_text import load_heldout_text
    from qserve.runtime.benchmark import step as bench_step

    calls = []
    text_tokens = len("\n\n".join(load_heldout_text()).split())
    fake = SimpleNamespace(
        lm=SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda s: s.split())),
        generate=lambda prompts, params: calls.append(prompts))
    with pytest.raises(SystemExit, match="lower --prefill or --reps"):
        bench_step._bench_prefill(fake, text_tokens // 3, 3)
    assert not calls
    bench_step._bench_prefill(fake, 100, 3)
    assert len(calls) == 4 and all(len(p[0]) == 100 for p in calls)
    assert len({tuple(p[0]) for p in calls}) == 4  # four different prompts
