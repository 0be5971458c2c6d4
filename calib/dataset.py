"""Calibration text -> a reproducible set of fixed-length token samples.

    texts = load_texts(source)                        # list of documents (strings)
    stream = pack_documents(map(tokenize, texts), separator)   # [L] int64
    samples = draw_samples(stream, num_samples, seq_len, seed)  # [N, seq_len] int64
`load_calibration_set` does all three and returns a `CalibrationSet` with a digest.

Sources (read through the `datasets` library):
    None              the default corpus, calib/data/default_calib.jsonl
    *.jsonl, *.json   JSON lines or a JSON list of records; documents in `text_field`
    *.parquet         documents in the column `text_field`
    *.txt             the whole file is ONE document, read verbatim (blank lines and all).
                      Splitting on blank lines would cut prose, code and lists into
                      fragments and drop the line breaks between them; put many
                      documents in a .jsonl instead.
    a directory       saved with `Dataset.save_to_disk` (or `DatasetDict`: its "train"
                      split, or its only split); documents in `text_field`

Packing: each document is tokenized on its own; the token lists are concatenated in
file order, with `separator` (e.g. the tokenizer's EOS id) inserted *between*
consecutive documents (not before the first nor after the last); `separator=None`
concatenates them directly. Empty documents are skipped.

Sampling: the packed stream is cut into floor(L / seq_len) non-overlapping windows
starting at token 0 (the remainder at the end is unused); `num_samples` distinct windows
are drawn with `torch.randperm` under a generator seeded with `seed`, in drawn order.
The same text, tokenizer, parameters and torch version give the same samples. Windows
that overlap an `avoid` span (token offsets of the stream, e.g. another draw's held-out
windows, `CalibrationSet.spans`) are left out before the draw.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from .errors import CalibrationError

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "default_calib.jsonl"
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_DIGEST_FORMAT = 1


@dataclass(frozen=True, eq=False)
class CalibrationSet:
    samples: torch.Tensor  # [num_samples, seq_len] int64 token ids
    starts: tuple[int, ...]  # each sample's first token's offset in the packed stream
    digest: str  # sha256 hex over the parameters and the sample token ids
    source: str  # the file or directory read
    num_tokens_available: int  # tokens in the packed stream (separators included)

    @property
    def num_samples(self) -> int:
        return int(self.samples.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.samples.shape[1])

    @property
    def spans(self) -> list[tuple[int, int]]:
        """[start, end) token offsets of the samples in the packed stream."""
        return [(s, s + self.seq_len) for s in self.starts]


def load_calibration_set(
    source: str | os.PathLike | None,
    tokenize: Callable[[str], Sequence[int]],
    *,
    num_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    text_field: str = "text",
    separator: int | None = None,
    avoid: Sequence[tuple[int, int]] = (),
    up_to: bool = False,
) -> CalibrationSet:
    """Read `source`, tokenize, pack and draw `num_samples` windows of `seq_len` tokens
    (with `up_to`, as many as there are when the text holds fewer) that overlap no
    `avoid` span."""
    _check_positive("num_samples", num_samples)
    _check_positive("seq_len", seq_len)
    path = resolve_source(source)
    texts = load_texts(path, text_field=text_field)
    stream = pack_documents((_tokenize(tokenize, t) for t in texts), separator)
    starts = draw_windows(stream, num_samples, seq_len, seed, source=str(path), avoid=avoid,
                          up_to=up_to)
    samples = _cut(stream, starts, seq_len)
    params = {"num_samples": int(num_samples), "seq_len": int(seq_len), "seed": int(seed),
              "separator": None if separator is None else int(separator)}
    if avoid or up_to:  # a plain draw keeps the digest it always had
        params.update(avoid=[list(map(int, a)) for a in avoid], up_to=bool(up_to))
    return CalibrationSet(samples=samples, starts=tuple(starts),
                          digest=calibration_digest(samples, params),
                          source=str(path), num_tokens_available=int(stream.numel()))


def resolve_source(source: str | os.PathLike | None) -> Path:
    """The path to read: the default corpus for None; checks existence and kind."""
    if source is None:
        return DEFAULT_CORPUS
    path = Path(source).expanduser()
    if not path.exists():
        raise CalibrationError(
            f"calibration data {str(path)!r} does not exist. Pass an existing .jsonl, .json, "
            ".txt or .parquet file, a directory saved with Dataset.save_to_disk, or nothing "
            "for the default corpus.")
    if path.is_file() and path.suffix.lower() not in _BUILDERS:
        raise CalibrationError(
            f"calibration data {str(path)!r} has an unsupported extension "
            f"{path.suffix or '(none)'!r}. Supported: {', '.join(_BUILDERS)}, or a directory "
            "saved with Dataset.save_to_disk; convert the file to one of these.")
    return path


def load_texts(source: str | os.PathLike | None, text_field: str = "text") -> list[str]:
    """Documents of `source` (see the module docstring), in order, as Python strings."""
    path = resolve_source(source)
    dataset = _read(path)
    where = f"calibration data {str(path)!r}"
    if dataset.num_rows == 0:
        raise CalibrationError(f"{where} is empty (no rows). Use a file that contains text.")
    if text_field not in dataset.column_names:
        raise CalibrationError(
            f"{where} has no text column {text_field!r}; its columns are "
            f"{dataset.column_names}. Pass the name of the column holding the text "
            "(text_field=...).")
    feature = dataset.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise CalibrationError(
            f"{where}: column {text_field!r} is not text (it holds {feature}). Pass the name "
            "of a column of strings (text_field=...).")
    texts = list(dataset[text_field])  # a lazy Column in datasets >= 4
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CalibrationError(
                f"{where}: row {i} of column {text_field!r} is {text!r}, not text. Remove "
                "the row or fill it with a string.")
    if not any(texts):
        raise CalibrationError(
            f"{where} is empty: all {len(texts)} documents in {text_field!r} are empty "
            "strings. Use a file that contains text.")
    return texts


def pack_documents(token_lists: Iterable[Sequence[int]], separator: int | None = None
                   ) -> torch.Tensor:
    """Concatenate token lists, `separator` between consecutive non-empty ones. [L] int64."""
    parts: list[torch.Tensor] = []
    sep = None if separator is None else torch.tensor([int(separator)], dtype=torch.int64)
    for ids in token_lists:
        if len(ids) == 0:
            continue
        if parts and sep is not None:
            parts.append(sep)
        parts.append(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def draw_samples(stream: torch.Tensor, num_samples: int, seq_len: int, seed: int = 0,
                 source: str = "the calibration data") -> torch.Tensor:
    """`num_samples` distinct non-overlapping seq_len windows of `stream`, seeded. [N, S]."""
    return _cut(stream, draw_windows(stream, num_samples, seq_len, seed, source), seq_len)


def draw_windows(stream: torch.Tensor, num_samples: int, seq_len: int, seed: int = 0,
                 source: str = "the calibration data", avoid: Sequence[tuple[int, int]] = (),
                 up_to: bool = False) -> list[int]:
    """The start offsets of `draw_samples`' windows, in drawn order; windows overlapping
    an `avoid` span [start, end) are left out first; `up_to`: fewer when fewer remain."""
    _check_positive("num_samples", num_samples)
    _check_positive("seq_len", seq_len)
    num_samples, seq_len = int(num_samples), int(seq_len)
    have = int(stream.numel())
    starts = [w * seq_len for w in range(have // seq_len)
              if not any(w * seq_len < e and s < (w + 1) * seq_len for s, e in avoid)]
    if len(starts) < num_samples and not (up_to and starts):
        shown = f"{len(starts)} windows of it not in the held-out spans" if avoid else \
            f"{have} tokens"
        raise CalibrationError(
            f"{source} has {shown}, but {num_samples} samples x {seq_len} tokens need "
            f"{num_samples * seq_len}. Use fewer samples (at most {len(starts)} at this "
            "seq_len) or a shorter seq_len, or give more text.")
    gen = torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(len(starts), generator=gen)[:num_samples]
    return [starts[i] for i in pick.tolist()]


def _cut(stream: torch.Tensor, starts: list[int], seq_len: int) -> torch.Tensor:
    """[N, seq_len] int64: the windows of `stream` at `starts`."""
    if not starts:
        return torch.zeros(0, seq_len, dtype=torch.int64)
    return torch.stack([stream[s:s + seq_len] for s in starts]).clone()


def calibration_digest(samples: torch.Tensor, params: dict) -> str:
    """sha256 hex of a canonical JSON header (params, shape) and the int64 token ids."""
    ids = samples.detach().to("cpu", torch.int64).contiguous()
    header = {"format": _DIGEST_FORMAT, "shape": list(ids.shape), **params}
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(b"\0")
    h.update(ids.numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


def _read(path: Path):
    """A `datasets.Dataset` for path (a supported file or a saved dataset directory)."""
    import datasets

    where = f"calibration data {str(path)!r}"
    if path.is_dir():
        return _read_saved(path, where)
    suffix = path.suffix.lower()
    if _is_empty_file(path, suffix):
        raise CalibrationError(f"{where} is empty. Use a file that contains text.")
    builder = _BUILDERS[suffix]
    extra = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **extra)
    except Exception as e:  # datasets raises many types (arrow, json, generation errors)
        raise CalibrationError(
            f"could not read {where} as {builder}: {type(e).__name__}: {e}. Check that the "
            f"file is valid {builder} and not empty.") from e


def _read_saved(path: Path, where: str):
    """The dataset in a `save_to_disk` directory (a DatasetDict's train or only split)."""
    import datasets

    states = [path / "state.json", *path.glob("*/state.json")]
    if not any(p.is_file() for p in states) and not (path / "dataset_dict.json").is_file():
        raise CalibrationError(
            f"{where} is a directory but not one saved with Dataset.save_to_disk. Pass a "
            "saved dataset directory or a data file.")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        # datasets cannot load a saved dataset with no rows (it has no data files).
        if any(p.is_file() and json.loads(p.read_text()).get("_data_files") == []
               for p in states):
            raise CalibrationError(f"{where} is empty (no rows). Use a dataset that "
                                   "contains text.") from e
        raise CalibrationError(
            f"could not read {where} with datasets.load_from_disk: {type(e).__name__}: {e}. "
            "Save it again with Dataset.save_to_disk.") from e
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            return loaded["train"]
        if len(splits) == 1:
            return loaded[splits[0]]
        raise CalibrationError(
            f"{where} is a DatasetDict with splits {splits} and no 'train' split. Save the "
            "split to use on its own with Dataset.save_to_disk.")
    return loaded


def _is_empty_file(path: Path, suffix: str) -> bool:
    """No rows: an empty or whitespace-only text/JSON file, `[]`, or a 0-row parquet."""
    size = path.stat().st_size
    if size == 0:
        return True
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # a dependency of datasets

        try:
            return pq.ParquetFile(str(path)).metadata.num_rows == 0
        except Exception:  # not parquet: load_dataset reports it
            return False
    if size > (1 << 16):
        return False
    content = path.read_bytes().strip()
    return not content or (suffix == ".json" and re.fullmatch(rb"\[\s*\]", content) is not None)


def _tokenize(tokenize: Callable[[str], Sequence[int]], text: str) -> Sequence[int]:
    ids = tokenize(text)
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError) as e:
        raise CalibrationError(
            f"tokenize() must return a list of int token ids, got {type(ids).__name__} "
            f"({e}). Pass a function like `lambda s: tokenizer.encode(s)`.") from e


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise CalibrationError(f"{name} must be a positive integer, got {value!r}.")
