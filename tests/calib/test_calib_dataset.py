"""Calibration data: reading sources, packing, seeded sampling, digest, and every error."""

import json

import datasets
import pytest
import torch

from qserve.calib.dataset import (DEFAULT_CORPUS, CalibrationSet, draw_samples,
                                  load_calibration_set, load_texts, pack_documents)
from qserve.calib.errors import CalibrationError


def byte_tokenize(text: str) -> list[int]:
    """Toy tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


DOCS = ["abcdefgh", "ijklmnop", "qrstuvwx", "yz012345"]  # 8 bytes each


# ---------------------------------------------------------------- packing and sampling

def test_pack_exact_layout():
    lists = [byte_tokenize("ab"), [], byte_tokenize("c"), byte_tokenize("de")]
    assert pack_documents(lists, separator=0).tolist() == [97, 98, 0, 99, 0, 100, 101]
    assert pack_documents(lists).tolist() == [97, 98, 99, 100, 101]
    assert pack_documents([]).dtype == torch.int64 and pack_documents([]).numel() == 0


def test_samples_are_distinct_aligned_windows_reproducible_by_seed(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
    stream = pack_documents([byte_tokenize(d) for d in DOCS], separator=1)  # 35 tokens
    windows = stream[:30].reshape(5, 6).tolist()  # floor(35 / 6) = 5 windows from token 0
    a = load_calibration_set(src, byte_tokenize, num_samples=4, seq_len=6, seed=0, separator=1)
    b = load_calibration_set(src, byte_tokenize, num_samples=4, seq_len=6, seed=0, separator=1)
    c = load_calibration_set(src, byte_tokenize, num_samples=4, seq_len=6, seed=1, separator=1)
    assert isinstance(a, CalibrationSet)
    assert a.samples.shape == (4, 6) and a.samples.dtype == torch.int64
    assert a.num_tokens_available == 35 and a.source == str(src)
    rows = a.samples.tolist()
    assert all(r in windows for r in rows) and len({tuple(r) for r in rows}) == 4
    assert torch.equal(a.samples, b.samples) and a.digest == b.digest
    assert not torch.equal(a.samples, c.samples) and a.digest != c.digest
    assert len(a.digest) == 64
    everything = load_calibration_set(src, byte_tokenize, num_samples=5, seq_len=6,
                                      separator=1)
    assert sorted(everything.samples.tolist()) == sorted(windows)


def test_digest_covers_parameters_as_well_as_tokens(tmp_path):
    src = _jsonl(tmp_path / "one.jsonl", [{"text": "x" * 64}])  # one doc: no separator used
    a = load_calibration_set(src, byte_tokenize, num_samples=2, seq_len=8, separator=None)
    b = load_calibration_set(src, byte_tokenize, num_samples=2, seq_len=8, separator=7)
    assert torch.equal(a.samples, b.samples) and a.digest != b.digest


def test_draw_samples_exact_for_a_known_seed():
    stream = torch.arange(20)
    gen = torch.Generator().manual_seed(3)
    order = torch.randperm(5, generator=gen)[:3].tolist()
    got = draw_samples(stream, num_samples=3, seq_len=4, seed=3)
    assert got.tolist() == [list(range(4 * w, 4 * w + 4)) for w in order]


def test_draws_of_other_lengths_never_overlap_the_avoided_spans(tmp_path):
    """Held-out rows of one length, training rows of another: no training window shares a
    token offset with a held-out one; `up_to` takes what is left, the spans say where."""
    path = tmp_path / "c.jsonl"
    _jsonl(path, [{"text": "abcdefghij" * 20}])  # 200 byte tokens
    held = load_calibration_set(path, byte_tokenize, num_samples=4, seq_len=10, seed=1)
    assert [e - s for s, e in held.spans] == [10] * 4
    for s, row in zip(held.starts, held.samples):
        assert row.tolist() == byte_tokenize(("abcdefghij" * 20)[s:s + 10])
    long = load_calibration_set(path, byte_tokenize, num_samples=100, seq_len=40, seed=0,
                                avoid=held.spans, up_to=True)
    assert 1 <= long.num_samples <= 5 - 1  # 5 windows of 40; each held row sits in one
    taken = {t for s, e in long.spans for t in range(s, e)}
    assert not taken & {t for s, e in held.spans for t in range(s, e)}
    plain = load_calibration_set(path, byte_tokenize, num_samples=3, seq_len=40, seed=0)
    assert plain.digest != long.digest
    with pytest.raises(CalibrationError, match="windows of it not in the held-out spans"):
        load_calibration_set(path, byte_tokenize, num_samples=5, seq_len=40, seed=0,
                             avoid=held.spans)


# ---------------------------------------------------------------- sources

def test_default_corpus():
    texts = load_texts(None)
    assert len(texts) > 10 and all(isinstance(t, str) and t for t in texts)
    cal = load_calibration_set(None, byte_tokenize, num_samples=8, seq_len=64, separator=0)
    want = sum(len(t.encode("utf-8")) for t in texts) + len(texts) - 1
    assert cal.num_tokens_available == want and cal.source == str(DEFAULT_CORPUS)


def test_json_parquet_saved_dir_and_custom_field(tmp_path):
    rows = [{"body": d, "n": i} for i, d in enumerate(DOCS)]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    assert load_texts(tmp_path / "list.json", text_field="body") == DOCS
    assert load_texts(_jsonl(tmp_path / "a.jsonl", rows), text_field="body") == DOCS
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    assert load_texts(tmp_path / "a.parquet", text_field="body") == DOCS
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_texts(tmp_path / "saved", text_field="body") == DOCS
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(
        str(tmp_path / "dict"))
    assert load_texts(tmp_path / "dict", text_field="body") == DOCS


def test_txt_is_one_document_read_verbatim(tmp_path):
    text = "first paragraph\nline two\n\n\nsecond paragraph\n"
    (tmp_path / "a.txt").write_text(text)
    assert load_texts(tmp_path / "a.txt") == [text]


# ---------------------------------------------------------------- errors

def test_missing_unsupported_and_unsaved_directory(tmp_path):
    with pytest.raises(CalibrationError, match="does not exist"):
        load_texts(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(CalibrationError, match="unsupported extension '.csv'"):
        load_texts(tmp_path / "data.csv")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CalibrationError, match="save_to_disk"):
        load_texts(tmp_path / "plain")


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.json", "  \n"), ("e.txt", ""),
                                          ("list.json", "[ \n ]"),
                                          ("blank.jsonl", '{"text": ""}\n{"text": ""}\n')])
def test_empty_data(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(CalibrationError, match="empty"):
        load_texts(tmp_path / name)


def test_empty_saved_dataset_and_parquet(tmp_path):
    empty = datasets.Dataset.from_dict(
        {"text": []}, features=datasets.Features({"text": datasets.Value("string")}))
    empty.save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(CalibrationError, match="empty"):
        load_texts(tmp_path / "empty")
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(CalibrationError, match="empty"):
        load_texts(tmp_path / "empty.parquet")


def test_no_text_column_and_not_text(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", [{"content": "x"}])
    with pytest.raises(CalibrationError, match=r"no text column 'text'.*\['content'\].*text_field"):
        load_texts(src)
    nums = _jsonl(tmp_path / "n.jsonl", [{"text": 1}, {"text": 2}])
    with pytest.raises(CalibrationError, match="not text"):
        load_texts(nums)
    nulls = _jsonl(tmp_path / "null.jsonl", [{"text": "ok"}, {"text": None}])
    with pytest.raises(CalibrationError, match="row 1 .* not text"):
        load_texts(nulls)


def test_unreadable_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(CalibrationError, match="could not read"):
        load_texts(tmp_path / "bad.jsonl")


def test_too_few_tokens_says_how_many(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])  # 32 tokens
    with pytest.raises(CalibrationError) as err:
        load_calibration_set(src, byte_tokenize, num_samples=5, seq_len=8)
    msg = str(err.value)
    assert "has 32 tokens" in msg and "need 40" in msg
    assert "fewer samples (at most 4" in msg and "shorter seq_len" in msg


@pytest.mark.parametrize("kwargs", [{"num_samples": 0}, {"num_samples": -1},
                                    {"num_samples": 1.5}, {"num_samples": True},
                                    {"seq_len": 0}, {"seq_len": "8"}])
def test_invalid_sizes(kwargs):
    with pytest.raises(CalibrationError, match="must be a positive integer"):
        load_calibration_set(None, byte_tokenize, **kwargs)


def test_bad_tokenizer_output():
    with pytest.raises(CalibrationError, match="tokenize"):
        load_calibration_set(None, lambda s: s.split()[:3], num_samples=1, seq_len=4)
