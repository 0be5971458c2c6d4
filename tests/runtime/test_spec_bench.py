"""The speculation benchmark's arguments and prompt sets (the benchmark itself is a command)."""

import pytest
from click.testing import CliRunner

from qserve.runtime.benchmark.workloads import default_corpus
from qserve.runtime.benchmark.spec import PROMPTS, _k_values, main


class ByteTokenizer:
    """Each UTF-8 byte a token: enough to check which text the windows come from."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_k_values():
    assert _k_values("4") == [4]
    assert _k_values("1, 2,3") == [1, 2, 3]


@pytest.mark.parametrize("text", ["", "0", "2,x", "33", "1,,-1"])
def test_bad_k_is_refused_before_loading(text):
    result = CliRunner().invoke(main, ["--k", text, "no-such-model"])
    assert result.exit_code == 2
    assert "--k" in result.output and "comma-separated" in result.output


def test_unknown_prompt_set_is_refused():
    result = CliRunner().invoke(main, ["--prompts", "poems", "no-such-model"])
    assert result.exit_code == 2 and "golden" in result.output and "text" in result.output


def test_text_prompts_are_seeded_windows_of_the_held_out_text():
    tok = ByteTokenizer()
    corpus = tok.encode("\n\n".join(default_corpus()))
    prompts = PROMPTS["text"](tok, 5, 40)
    assert len(prompts) == 5 and all(len(p) == 40 for p in prompts)
    starts = set()
    for p in prompts:  # each a contiguous slice of the corpus
        start = next(i for i in range(len(corpus) - 39) if corpus[i:i + 40] == p)
        starts.add(start)
    assert len(starts) == 5  # distinct windows
    assert PROMPTS["text"](tok, 5, 40) == prompts  # the same for the same seed


def test_golden_prompts_take_the_first_n():
    prompts = PROMPTS["golden"](ByteTokenizer(), 3, 999)
    assert len(prompts) == 3
    assert bytes(prompts[0]).decode() == "The history of the printing press"


def test_budget_setting_reaches_the_config():
    from qserve.runtime.benchmark.spec import _spec

    assert _spec("ngram", 4).adaptive is True
    assert _spec("ngram", 4, adaptive=False).adaptive is False
    assert _spec("off", 4) is None
