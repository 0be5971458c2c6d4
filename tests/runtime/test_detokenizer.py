"""Incremental detokenizer: streamed deltas add up to the full text, never broken UTF-8."""

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from qserve.runtime.detokenizer import IncrementalDetokenizer
from qserve.runtime.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "naïve café — 東京は晴れ 😀👍🏽 done",
    "  leading spaces\n\tand tabs\n\n",
    "emoji at the end 🧪",
]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE with few merges, so multi-byte characters span several tokens."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    hf.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return Tokenizer(hf=hf, eos_token="<eos>", eos_token_ids=(hf.token_to_id("<eos>"),),
                     special_ids=frozenset({hf.token_to_id("<eos>")}))


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text)
    assert len(ids) > len(text.split())  # characters really are split over tokens
    detok = IncrementalDetokenizer(byte_tokenizer)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == byte_tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_char_waits_for_all_bytes(byte_tokenizer):
    ids = byte_tokenizer.encode("😀")
    assert len(ids) == 4  # one token per UTF-8 byte
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert [detok.add(t) for t in ids] == ["", "", "", "😀"]


def test_after_prompt_emits_only_new_text(byte_tokenizer):
    prompt = byte_tokenizer.encode("the fox")
    out = byte_tokenizer.encode(" jumps 😀")
    detok = IncrementalDetokenizer.after_prompt(byte_tokenizer, prompt)
    text = "".join(detok.add(t) for t in out) + detok.flush()
    assert text == " jumps 😀"


def test_flush_emits_incomplete_tail(byte_tokenizer):
    ids = byte_tokenizer.encode("a😀")[:-1]  # cut the last byte of the emoji
    detok = IncrementalDetokenizer(byte_tokenizer)
    streamed = "".join(detok.add(t) for t in ids)
    assert streamed == "a"
    assert detok.flush() == "\ufffd"  # the end of the stream shows the broken char once


def test_special_tokens_skipped(byte_tokenizer):
    eos = byte_tokenizer.eos_token_ids[0]
    ids = byte_tokenizer.encode("the dog") + [eos]
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert "".join(detok.add(t) for t in ids) + detok.flush() == "the dog"
