"""Stop strings across deltas, minimal hold-back, stop tokens, EOS and length."""

import pytest

from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.stop_checker import StopChecker, StopUpdate

EOS = 2


def feed(checker, deltas, token_ids=None):
    token_ids = token_ids or [100 + i for i in range(len(deltas))]
    return [checker.update(t, d) for t, d in zip(token_ids, deltas)]


def test_stop_string_split_over_three_deltas():
    c = StopChecker(stop_strings=["<END>"])
    out = feed(c, ["Hello <", "EN", "D> and more"])
    assert out == [StopUpdate("Hello ", None, None), StopUpdate("", None, None),
                   StopUpdate("", "stop", "<END>")]
    assert c.text == "Hello " and c.finished and c.stop_reason == "<END>"
    with pytest.raises(RuntimeError, match="already finished"):
        c.update(5, "x")


def test_partial_match_that_is_not_a_stop_is_released():
    c = StopChecker(stop_strings=["<END>"])
    out = feed(c, ["a <E", "N", "d", "!"])
    assert [u.text for u in out] == ["a ", "", "<ENd", "!"]
    assert c.held_text == "" and c.text == "a <ENd!" and not c.finished


def test_holds_back_only_the_minimal_suffix():
    c = StopChecker(stop_strings=["abc", "xyz"])
    assert c.update(1, "123ab").text == "123"
    assert c.held_text == "ab"
    assert c.update(2, "x").text == "ab"  # "ab" released, "x" may start "xyz"
    assert c.held_text == "x"
    assert c.update(3, "aab").text == "xa"  # "ab" could still become "abc"
    assert c.update(4, "c tail") == StopUpdate("", "stop", "abc")
    assert c.text == "123abxa"


def test_overlapping_prefixes_keep_the_longest_possible_start():
    c = StopChecker(stop_strings=["aab"])
    assert c.update(1, "xa").text == "x"
    assert c.update(2, "a").text == ""  # held "aa"
    assert c.update(3, "a").text == "a"  # "aaa": the last two may still start "aab"
    assert c.update(4, "b") == StopUpdate("", "stop", "aab")
    assert c.text == "xa"


def test_earliest_stop_string_wins_and_text_after_it_is_dropped():
    c = StopChecker(stop_strings=["world", "lo"])
    assert c.update(1, "hello world") == StopUpdate("hel", "stop", "lo")
    c = StopChecker(stop_strings=["STOP"])
    assert c.update(1, "one STOP two STOP") == StopUpdate("one ", "stop", "STOP")


def test_stop_token_and_eos_release_held_text_but_not_their_own():
    c = StopChecker(stop_strings=["###"], stop_token_ids=[7], eos_token_ids=[EOS])
    assert c.update(1, "ok #").text == "ok "
    assert c.update(7, "<stop-token-text>") == StopUpdate("#", "stop", 7)
    c = StopChecker(stop_strings=["###"], eos_token_ids=[EOS])
    assert c.update(1, "x#").text == "x"
    assert c.update(EOS, "") == StopUpdate("#", "stop", None)


def test_ignore_eos_still_honours_stop_tokens_and_length():
    c = StopChecker(stop_token_ids=[7], eos_token_ids=[EOS], ignore_eos=True, max_tokens=10)
    assert c.update(EOS, "e") == StopUpdate("e", None, None)
    assert c.update(7, "s") == StopUpdate("", "stop", 7)


def test_length_releases_held_text_and_stop_beats_length():
    c = StopChecker(stop_strings=["END"], max_tokens=2)
    assert c.update(1, "a").text == "a"
    assert c.update(2, "bEN") == StopUpdate("bEN", "length", None)
    assert c.text == "abEN"
    c = StopChecker(stop_strings=["END"], max_tokens=2)
    c.update(1, "a")
    assert c.update(2, "bEND") == StopUpdate("b", "stop", "END")


def test_flush_and_from_params():
    params = SamplingParams(stop=["\n\n"], stop_token_ids=[9], max_tokens=5, ignore_eos=False)
    c = StopChecker.from_params(params, eos_token_ids=[EOS])
    assert c.update(1, "line\n").text == "line"
    assert c.flush() == "\n"
    assert c.text == "line\n" and c.max_tokens == 5 and c.eos_token_ids == {EOS}
    assert StopChecker.from_params(SamplingParams(ignore_eos=True), [EOS]).eos_token_ids == set()


def test_no_stop_strings_streams_everything():
    c = StopChecker(eos_token_ids=[EOS])
    assert [u.text for u in feed(c, ["a", "", "bc"])] == ["a", "", "bc"]
    assert c.update(EOS, "") == StopUpdate("", "stop", None)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="non-empty strings"):
        StopChecker(stop_strings=[""])
    with pytest.raises(ValueError, match="max_tokens"):
        StopChecker(max_tokens=0)
