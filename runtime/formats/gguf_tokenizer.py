"""Rebuild HF tokenizer files from a GGUF file's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`), the
kind of model (`tokenizer.ggml.model`: "gpt2" = byte-level BPE, "llama" = SentencePiece
BPE), merges or scores, a type per token (normal/control/user-defined/byte), the special
ids, and the chat template. From those we build a `tokenizers.Tokenizer` and the JSON
files an HF checkpoint directory has:

    tokenizer.json          the `tokenizers` model, normalizer, pre-tokenizer, decoder
    tokenizer_config.json   special tokens, add_bos/eos, chat_template, model_max_length
    generation_config.json  bos / eos (every end-of-generation id) / pad

Rules (kept equal to llama.cpp's own tokenizer, and checked against transformers' GGUF
tokenizer in tests/quantize/test_gguf.py):
- byte-level BPE: tokens spelled in GPT-2's byte alphabet, merges from the file, the
  split regex chosen by `tokenizer.ggml.pre` (`PRE_TOKENIZERS`);
- SentencePiece BPE: spaces become "▁" (plus a leading one when `add_space_prefix`),
  unknown characters fall back to <0xNN> byte tokens, and merges are recovered from the
  vocabulary: every split of a token into two tokens is a merge, ranked by the merged
  token's score (Gemma: by its position in the file, since its scores are not in merge
  order);
- control tokens become special added tokens; user-defined ones plain added tokens, both
  matched whole in the raw text, as llama.cpp does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

from .errors import CheckpointError
from .gguf_reader import GGUFFile

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁"

# Control tokens llama.cpp treats as end of generation, besides the eos id itself.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes that print as themselves keep
    their character; the rest are moved to code points 256 and up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# --- pre-tokenizers for byte-level BPE, keyed by tokenizer.ggml.pre --------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp's "qwen2": llama 3's split with single digits (\p{N}, not \p{N}{1,3})
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2_pre():
    # ByteLevel's own regex is GPT-2's: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre():
    # llama.cpp: regexes "\p{N}" then GPT-2's, i.e. every digit is its own piece first
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()]
    )


def _llama3_pre():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _qwen2_pre():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS: dict[str, Callable[[], object]] = {
    "gpt-2": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "refact": _digits_then_gpt2_pre,
    "codeshell": _digits_then_gpt2_pre,
    "llama3": _llama3_pre,
    "llama-v3": _llama3_pre,
    "llama-bpe": _llama3_pre,
    "qwen2": _qwen2_pre,
}

# Unicode normalization before pre-tokenization, by tokenizer.ggml.pre, where the model's
# own tokenizer has one: Qwen2's composes text (NFC), as transformers' Qwen2 tokenizer sets
# it (llama.cpp does not normalize, so a decomposed "é" splits differently there).
NORMALIZERS: dict[str, Callable[[], object]] = {
    "qwen2": normalizers.NFC,
}


# --- tokenizer builders, keyed by tokenizer.ggml.model ---------------------------------


@dataclass
class _Vocab:
    tokens: list[str]
    types: list[int]
    vocab: dict[str, int]


def _read_vocab(g: GGUFFile, respell: Callable[[str], str]) -> _Vocab:
    tokens = g.require("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{g.path}: {len(tokens)} tokens but {len(types)} token types in the tokenizer metadata."
        )
    spelled = [respell(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if len(vocab) != len(spelled):
        seen: set[str] = set()
        dup = next(t for t in spelled if t in seen or seen.add(t))
        raise CheckpointError(
            f"{g.path}: the tokenizer vocabulary lists {dup!r} more than once; cannot build "
            "a tokenizer with the file's token ids."
        )
    return _Vocab(spelled, [int(t) for t in types], vocab)


def _add_file_tokens(tok: Tokenizer, original: list[str], v: _Vocab) -> None:
    """Control tokens as special added tokens, then user-defined ones as plain added tokens.

    A user-defined token is added only where its text is a vocabulary entry as written;
    one that was respelled (Gemma's runs of spaces, now runs of "▁") is reached through
    the normalizer and BPE instead.
    """
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, k, o in zip(v.tokens, v.types, original)
        if k == CONTROL and t == o
    ]
    user = [
        AddedToken(o, normalized=False, special=False)
        for t, k, o in zip(v.tokens, v.types, original)
        if k == USER_DEFINED and o in v.vocab
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _byte_level_bpe(g: GGUFFile) -> Tokenizer:
    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def respell(t: str) -> str:
        return t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))

    original = g.require("tokenizer.ggml.tokens")
    v = _read_vocab(g, respell)
    merges = []
    for m in g.require("tokenizer.ggml.merges"):
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{g.path}: malformed BPE merge {m!r} (want 'left right').")
        merges.append((parts[0], parts[1]))
    pre = g.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{g.path}: byte-level BPE pre-tokenizer {pre!r} is not supported. qserve knows: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}."
        )
    tok = Tokenizer(
        models.BPE(
            vocab=v.vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    if pre in NORMALIZERS:
        tok.normalizer = NORMALIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    # control tokens spelled outside the byte alphabet are llama.cpp mislabels; skip them
    _add_file_tokens(tok, original, v)
    return tok


def _sentencepiece_merges(v: _Vocab, rank: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary, best first.

    Every split of a token into two vocabulary tokens is a merge; merges are ordered by
    the merged token's rank (higher first), then by longer left piece; ties keep token
    order, and within a token the order of the pieces' ids.
    """
    vocab = v.vocab
    found = []
    for token, index in vocab.items():
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                local.append((left, right, rank[index]))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [(left, right) for left, right, _ in found]


def _sentencepiece_bpe(g: GGUFFile) -> Tokenizer:
    original = g.require("tokenizer.ggml.tokens")
    gemma = g.architecture.startswith("gemma")

    def respell(t: str) -> str:
        # Gemma files store tokens that are runs of spaces with real spaces; the model
        # sees text with spaces already replaced by "▁"
        if gemma and t and not t.strip(" "):
            return SPIECE_SPACE * len(t)
        return t

    v = _read_vocab(g, respell)
    if gemma:  # Gemma's scores are not in merge order; the file order is
        rank = [-float(i) for i in range(len(v.tokens))]
    else:
        scores = g.require("tokenizer.ggml.scores")
        rank = [float(s) for s in scores]
    unk_id = g.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=v.vocab,
            merges=_sentencepiece_merges(v, rank),
            unk_token=v.tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    add_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    tok.normalizer = normalizers.Sequence(steps) if len(steps) > 1 else steps[0]
    tok.pre_tokenizer = None
    dec = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    _add_file_tokens(tok, original, v)
    return tok


TOKENIZER_BUILDERS: dict[str, Callable[[GGUFFile], Tokenizer]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
}

# tokenizer_config.json "tokenizer_class": the generic class, which loads tokenizer.json
# as written. Model-specific classes (GPT2Tokenizer, ...) may rebuild parts of it from
# their own defaults: transformers 5's GPT2Tokenizer drops the digit split, for one.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


# --- the files ----------------------------------------------------------------------------


@dataclass
class TokenizerFiles:
    """What `write` puts in a checkpoint directory."""

    tokenizer: Tokenizer
    tokenizer_config: dict
    generation_config: dict

    def write(self, directory: Path) -> None:
        directory = Path(directory)
        self.tokenizer.save(str(directory / "tokenizer.json"))
        _write_json(directory / "tokenizer_config.json", self.tokenizer_config)
        _write_json(directory / "generation_config.json", self.generation_config)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _chat_template(g: GGUFFile) -> str | list[dict] | None:
    default = g.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = [
        {"name": key[len(prefix):], "template": g.get(key)}
        for key in g.keys()
        if key.startswith(prefix)
    ]
    if not named:
        return default
    if default is not None:
        named.insert(0, {"name": "default", "template": default})
    return named


def build_tokenizer_files(g: GGUFFile) -> TokenizerFiles:
    """The tokenizer and its config files for an opened GGUF file."""
    kind = g.get("tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{g.path}: no tokenizer in the file (tokenizer.ggml.model missing).")
    builder = TOKENIZER_BUILDERS.get(kind)
    if builder is None:
        raise CheckpointError(
            f"{g.path}: tokenizer model {kind!r} is not supported. qserve rebuilds: "
            f"{', '.join(sorted(TOKENIZER_BUILDERS))} (byte-level BPE and SentencePiece BPE)."
        )
    tok = builder(g)
    tokens = g.require("tokenizer.ggml.tokens")

    def special(key: str) -> tuple[int | None, str | None]:
        i = g.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None, None
        if not 0 <= int(i) < len(tokens):
            raise CheckpointError(f"{g.path}: tokenizer.ggml.{key}={i} is outside the vocabulary.")
        return int(i), tok.id_to_token(int(i))

    bos_id, bos = special("bos_token_id")
    eos_id, eos = special("eos_token_id")
    unk_id, unk = special("unknown_token_id")
    pad_id, pad = special("padding_token_id")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        add_bos = False
    if add_eos and eos is None:
        add_eos = False

    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )

    config: dict = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.arch_get("context_length", 0)) or None,
    }
    if kind == "gpt2":
        config["add_prefix_space"] = False
    template = _chat_template(g)
    if template is not None:
        config["chat_template"] = template

    stop = [eos_id] if eos_id is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        i = g.get(f"tokenizer.ggml.{key}")
        if i is not None and int(i) not in stop:
            stop.append(int(i))
    types = g.get("tokenizer.ggml.token_type") or []
    for text in END_OF_GENERATION_TEXTS:
        i = tok.token_to_id(text)
        if i is not None and i < len(types) and types[i] == CONTROL and i not in stop:
            stop.append(i)
    generation: dict = {}
    if bos_id is not None:
        generation["bos_token_id"] = bos_id
    if stop:
        generation["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    if pad_id is not None:
        generation["pad_token_id"] = pad_id
    return TokenizerFiles(tok, config, generation)
