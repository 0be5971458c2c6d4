"""The difficulty router: shipped model, decisions, training, and the measurement's arithmetic."""

import hashlib
import json
import math
import re

import pytest

from qserve.runtime.benchmark.difficulty_routing import auc, is_correct, sample_items, sweep
from qserve.runtime.gateway.difficulty import (
    FEATURE_NAMES,
    DifficultyDecision,
    DifficultyModelError,
    DifficultyRouter,
    features_of_messages,
)
from qserve.runtime.gateway.difficulty_train import (
    default_labels_path,
    default_model_path,
    read_labels,
    row_messages,
    split_of,
    train,
    write_model,
)

# held-out rows of the shipped labels file (never trained on) that the shipped model must
# route as labelled at the default threshold
HELDOUT_EASY = ("chat-easy-000", "chat-easy-025", "chat-easy-046", "chat-easy-066",
                "chat-multi-000", "gen-0531", "gen-0603")
HELDOUT_HARD = ("chat-hard-002", "chat-hard-013", "chat-hard-023", "chat-hard-048",
                "gen-0234")


@pytest.fixture(scope="module")
def router() -> DifficultyRouter:
    return DifficultyRouter.load()


@pytest.fixture(scope="module")
def labels() -> dict[str, dict]:
    return {r["id"]: r for r in read_labels(default_labels_path())}


def user(text) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_shipped_model_loads_and_matches_the_code(router):
    doc = json.loads(default_model_path().read_text(encoding="utf-8"))
    assert doc["features"] == list(FEATURE_NAMES)
    assert router.source.endswith("difficulty_model.json")
    assert 0.0 < router.score(user("hello")) < 1.0


@pytest.mark.parametrize("row_id", HELDOUT_EASY)
def test_heldout_easy_rows_score_below_the_default_threshold(router, labels, row_id):
    row = labels[row_id]
    assert row["split"] == "heldout" and row["label"] == 0
    assert router.score(row_messages(row)) < 0.5


@pytest.mark.parametrize("row_id", HELDOUT_HARD)
def test_heldout_hard_rows_score_above_the_default_threshold(router, labels, row_id):
    row = labels[row_id]
    assert row["split"] == "heldout" and row["label"] == 1
    assert router.score(row_messages(row)) >= 0.5


def test_decide_honours_the_threshold(router):
    messages = user("Extract the email address from: 'write to ana@example.org'")
    s = router.score(messages)
    assert router.decide(messages, min(s + 1e-9, 1.0)).target == "small"
    assert router.decide(messages, s).target == "large"  # score < threshold -> small
    assert router.decide(messages, 0.0).target == "large"
    low = router.decide(messages, 1.0)
    assert low == DifficultyDecision("small", s, low.reason)
    assert re.fullmatch(r"score=\d\.\d\d<1\.00 \([a-z ,\-]+\)", low.reason)
    assert re.fullmatch(r"score=\d\.\d\d>=0\.00 \([a-z ,\-]+\)",
                        router.decide(messages, 0.0).reason)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, "0.5", None, True, math.nan])
def test_decide_rejects_a_threshold_outside_0_1(router, threshold):
    with pytest.raises(ValueError, match="threshold"):
        router.decide(user("hi"), threshold)


def test_prompt_and_content_parts_score_as_one_user_message(router):
    parts = [{"type": "text", "text": "Translate to French:"}, {"type": "image_url"},
             {"type": "text", "text": "good morning"}]
    assert router.score(user(parts)) == router.score(user("Translate to French:\ngood morning"))
    assert router.score_prompt("What is 2 + 2?") == router.score(user("What is 2 + 2?"))
    assert router.decide_prompt("What is 2 + 2?", 0.5) == router.decide(user("What is 2 + 2?"),
                                                                        0.5)


def test_features_read_the_last_user_message_and_count_the_context():
    f = dict(zip(FEATURE_NAMES, features_of_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write a Python function that sorts a list."},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Now classify this review as positive or negative."}])))
    assert f["user_turns"] == 2 and f["has_system"] == 1.0
    assert f["verb_classify"] == 1.0 and f["verb_code"] == 0.0
    assert f["log_chars_context"] == pytest.approx(math.log1p(len("Be brief.") + len(
        "Write a Python function that sorts a list.")))
    assert all(v == 0.0 for k, v in zip(FEATURE_NAMES, features_of_messages("not a list")))


TINY = [  # (id, label, prompt): a training set small enough to write out
    ("t0", 0, "Extract the date from: 'due 5 May'"),
    ("t1", 0, "What is the capital of Peru?"),
    ("t2", 0, "Convert 'abc' to uppercase."),
    ("t3", 0, "Classify the sentiment: 'great product'"),
    ("t4", 0, "Repeat the word: cat"),
    ("t5", 1, "Prove that there are infinitely many primes, step by step."),
    ("t6", 1, "Write a Python program that parses JSON logs and reports error rates."),
    ("t7", 1, "Write a detailed 1000-word essay on climate policy."),
    ("t8", 1, "Explain why the derivative of sin is cos, and derive it."),
    ("t9", 0, "Who wrote Hamlet?"),
]


def _tiny_labels(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps({"id": i, "split": "train", "label": y, "prompt": p})
                            + "\n" for i, y, p in reversed(TINY)), encoding="utf-8")
    return path


def test_training_is_deterministic_and_separates_its_data(tmp_path):
    labels = _tiny_labels(tmp_path)
    write_model(labels, tmp_path / "a.json")
    write_model(labels, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["training"]["rows"] == 10 and doc["training"]["positives"] == 4
    assert doc["training"]["labels_sha256"] == hashlib.sha256(labels.read_bytes()).hexdigest()
    tiny = DifficultyRouter.load(tmp_path / "a.json")
    scores = {i: tiny.score_prompt(p) for i, _, p in TINY}
    assert max(scores[i] for i, y, _ in TINY if y == 0) < min(scores[i] for i, y, _ in TINY
                                                              if y == 1)


def test_training_skips_heldout_rows_and_needs_both_labels(tmp_path):
    rows = [{"id": i, "split": "train", "label": y, "prompt": p} for i, y, p in TINY]
    with_heldout = rows + [{"id": "h", "split": "heldout", "label": 1, "prompt": "hi"}]
    assert train(with_heldout) == train(rows)
    with pytest.raises(DifficultyModelError, match="both labels"):
        train([r for r in rows if r["label"] == 0])


def test_the_shipped_model_is_trained_from_the_shipped_labels():
    doc = json.loads(default_model_path().read_text(encoding="utf-8"))
    labels = default_labels_path()
    assert doc["training"]["labels_sha256"] == hashlib.sha256(labels.read_bytes()).hexdigest()
    again = train(read_labels(labels))
    assert again.weights == pytest.approx(doc["weights"], rel=1e-6, abs=1e-8)
    assert again.bias == pytest.approx(doc["bias"], rel=1e-6, abs=1e-8)


def test_the_shipped_labels_are_consistent(labels):
    for row in labels.values():
        assert row["split"] == split_of(row["id"])
        if row["source"] == "golden":
            assert row["label_from"] == "model answers"
            assert row["label"] == int(row["large_correct"] and not row["small_correct"])
            assert row["small_correct"] == is_correct(row["small_output"], row["answer"])
        else:
            assert row["source"] == "constructed" and row["label_from"] == "construction"
    splits = {(r["source"], r["split"], r["label"]) for r in labels.values()}
    assert {(s, sp, y) for s in ("golden", "constructed") for sp in ("train", "heldout")
            for y in (0, 1)} <= splits


@pytest.mark.parametrize("write", [
    lambda p: p.write_text("{not json", encoding="utf-8"),
    lambda p: p.write_text(json.dumps({"format": "other"}), encoding="utf-8"),
    lambda p: p.write_text(json.dumps({**json.loads(default_model_path().read_text()),
                                       "version": 99}), encoding="utf-8"),
    lambda p: p.write_text(json.dumps({**json.loads(default_model_path().read_text()),
                                       "features": ["x"]}), encoding="utf-8"),
    lambda p: p.write_text(json.dumps({**json.loads(default_model_path().read_text()),
                                       "weights": [1.0]}), encoding="utf-8"),
    lambda p: None,  # missing
], ids=["not-json", "other-format", "other-version", "other-features", "short-weights",
        "missing"])
def test_a_bad_model_file_is_a_clear_error_naming_it(tmp_path, write):
    path = tmp_path / "broken-model.json"
    write(path)
    with pytest.raises(DifficultyModelError, match="broken-model.json"):
        DifficultyRouter.load(path)


def test_a_bad_labels_row_names_the_file_and_line(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text('{"id": "a", "label": 0, "prompt": "x"}\n{"id": "b", "label": 2}\n')
    with pytest.raises(DifficultyModelError, match=r"labels.jsonl:2"):
        read_labels(path)


def test_golden_answers_are_scored_like_the_golden_eval():
    assert is_correct(" Paris", "Paris") and is_correct("paris.", "Paris")
    assert is_correct(" twenty-one", "twenty-one") and not is_correct(" Lyon", "Paris")


def test_the_golden_sample_is_fixed_and_capped_per_category():
    items = [{"id": f"g{i}", "category": "ab"[i % 2]} for i in range(10)]
    picked = sample_items(items, 2)
    assert len(picked) == 4 and picked == sample_items(list(reversed(items)), 2)
    assert sorted(r["category"] for r in picked) == ["a", "a", "b", "b"]


def test_sweep_arithmetic():
    golden = [{"id": "a", "small_correct": True, "large_correct": True},
              {"id": "b", "small_correct": False, "large_correct": True},
              {"id": "c", "small_correct": True, "large_correct": False},
              {"id": "d", "small_correct": False, "large_correct": False}]
    scores = {"a": 0.1, "b": 0.9, "c": 0.2, "d": 0.3, "e": 0.1, "f": 0.8}
    times = {(m, i): (1.0 if m == "small" else 4.0) for m in ("small", "large") for i in "abcd"}
    constructed = [{"id": "e", "label": 0}, {"id": "f", "label": 1}]
    (p,) = sweep(golden, scores, times, constructed, [0.5], bytes_ratio=0.25)
    assert p.share_small == 0.75 and p.accuracy == 0.75  # a, c right; b by large; d wrong
    assert p.accuracy_random == 0.75 * 0.5 + 0.25 * 0.5
    assert p.time_saved == 1 - (3 * 1.0 + 4.0) / 16.0
    assert p.bytes_saved == 0.75 * 0.75
    assert p.easy_small == 1.0 and p.hard_large == 1.0
    assert auc([0.9, 0.1, 0.5], [1, 0, 0]) == 1.0 and auc([0.5, 0.5], [1, 0]) == 0.5
