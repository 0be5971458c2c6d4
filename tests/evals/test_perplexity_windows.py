"""The strided windows score every token after the first exactly once."""

import pytest

from qserve.evals.perplexity import _windows


@pytest.mark.parametrize("n,window,stride", [(1, 8, 4), (2, 8, 4), (8, 8, 4), (9, 8, 4),
                                             (100, 16, 5), (100, 16, 16), (37, 10, 1)])
def test_every_token_scored_once(n, window, stride):
    ids = list(range(1000, 1000 + n))
    scored = []
    for w in _windows(ids, window, stride):
        assert 1 <= len(w.ids) <= window
        start = ids.index(w.ids[0])
        assert w.ids == ids[start:start + len(w.ids)]
        for p in range(max(w.score_from, 1), len(w.ids)):
            scored.append(start + p)
            if start + p >= window:  # once past the first window, context >= window - stride
                assert p >= window - stride
    assert scored == list(range(1, n))


def test_windows_exact_layout():
    # 10 tokens, window 4, stride 2: windows start at 0, 2, 4, 6; score 1-3, 4-5, 6-7, 8-9
    ws = _windows(list(range(10)), 4, 2)
    assert [(w.ids[0], len(w.ids), w.score_from) for w in ws] == [
        (0, 4, 1), (2, 4, 2), (4, 4, 2), (6, 4, 2)]
