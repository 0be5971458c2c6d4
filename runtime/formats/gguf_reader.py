"""Reader for a GGUF file (llama.cpp's single-file checkpoint format).

A GGUF holds typed key/value metadata (hyper-parameters under `<arch>.*`, the tokenizer
under `tokenizer.*`) and tensors, many of them block-quantized (Q4_K, Q8_0, ...). This
module opens one, rebuilds the HF `config.json` dict from its metadata, and yields its
tensors dequantized (by the `gguf` package) under their HF names, in torch order.

    g = open_gguf("model.gguf")          # validates magic, layout, architecture, types
    config = g.hf_config()                # dict for config.json
    for name, t in g.iter_hf_tensors(config):   # [out, in] bf16, HF names
        ...

Every problem with the input is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .errors import CheckpointError
from .gguf_names import TensorLayout, get_layout

GGUF_MAGIC = b"GGUF"

try:  # `gguf` is a declared dependency; keep a readable message if it is missing
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quant_shape_to_byte_shape
except ImportError as _e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "qserve's GGUF reader needs the `gguf` package: pip install 'gguf>=0.10'."
    ) from _e

# Types we dequantize. The ones in the two reference models (F32, Q8_0, Q4_1, Q5_0,
# Q4_K, Q6_K) are checked bit-for-bit against transformers' loader; the others go through
# the same `gguf.dequantize` and are checked on crafted files.
SUPPORTED_TENSOR_TYPES: frozenset[QT] = frozenset(
    {
        QT.F32, QT.F16, QT.BF16,
        QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
        QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
    }
)


def supported_tensor_types() -> list[str]:
    return sorted(t.name for t in SUPPORTED_TENSOR_TYPES)


@dataclass(frozen=True)
class TensorInfo:
    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    type_name: str  # GGML type, e.g. "Q4_K"
    shape: tuple[int, ...]  # torch order: [rows, row_length]
    qtype: int  # GGML type id
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


# --- the header ---------------------------------------------------------------------------
# GGUF v2/v3, little-endian: magic, u32 version, u64 tensor count, u64 kv count, then
# kv pairs (string key, u32 type, value), tensor infos (string name, u32 n_dims, u64 dims
# fastest-first, u32 type, u64 offset), padding to `general.alignment`, tensor data.
# Parsed here rather than with gguf.GGUFReader, which takes ~12 s on a 262k-token
# vocabulary (one memmap slice per element); this takes a fraction of a second.

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _HeaderParser:
    def __init__(self, buf: memoryview, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def _take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Truncated(f"header needs bytes {start}..{start + n} but the file has {self.size}")
        self.pos = start + n
        return start

    def scalar(self, fmt: str):
        start = self._take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self._take(n)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"string at byte {start} is not UTF-8 ({e})") from None

    def value(self, vtype: int):
        if vtype == 6:  # float32: its shortest decimal (1e-06, not 9.99999997e-07)
            return float(str(np.float32(self.scalar("<f"))))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                start = self._take(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=start)
                return [bool(x) for x in arr] if etype == 7 else arr.tolist()
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown array element type {etype}")
        raise ValueError(f"unknown metadata value type {vtype}")


def _parse_header(buf: memoryview, size: int) -> tuple[dict[str, Any], list[tuple], int]:
    """(metadata, [(name, dims fastest-first, type id, relative offset)], data start)."""
    p = _HeaderParser(buf, size)
    p._take(4)  # magic, checked by the caller
    version = p.scalar("<I")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian file)" if swapped in (2, 3) else ""
        raise ValueError(f"GGUF version {version}{hint}; qserve reads little-endian GGUF v2 and v3")
    n_tensors, n_kv = p.scalar("<Q"), p.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.string()
        metadata[key] = p.value(p.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = p.string()
        n_dims = p.scalar("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [p.scalar("<Q") for _ in range(n_dims)]
        infos.append((name, dims, p.scalar("<I"), p.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment={align!r} is not a power of two")
    start = -(-p.pos // align) * align
    return metadata, infos, start


class GGUFFile:
    """An opened, validated GGUF file. Tensor data stays memory-mapped until asked for."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: list[TensorInfo]):
        self.path = path
        self._metadata = metadata
        self._data: np.memmap | None = None
        self.architecture: str = self.require("general.architecture")
        if not isinstance(self.architecture, str):
            raise CheckpointError(f"{path}: general.architecture is not a string.")
        self.layout: TensorLayout = get_layout(self.architecture, path)
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in tensors}
        bad = sorted({t.type_name for t in tensors} - set(supported_tensor_types()))
        if bad:
            which = [t.name for t in tensors if t.type_name in bad][:3]
            raise CheckpointError(
                f"{path}: unsupported GGUF tensor type(s) {', '.join(bad)} (e.g. {', '.join(which)}). "
                f"qserve dequantizes: {', '.join(supported_tensor_types())}. Re-quantize the "
                "model to one of these (llama-quantize), or use an F16/BF16 GGUF."
            )

    # -- metadata ---------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self._metadata

    def keys(self) -> list[str]:
        return list(self._metadata)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool, or list of those)."""
        return self._metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._metadata:
            raise CheckpointError(
                f"{self.path}: GGUF metadata key {key!r} is missing; the file is incomplete or "
                "was not written by llama.cpp's converter."
            )
        return self._metadata[key]

    def array_len(self, key: str) -> int | None:
        value = self._metadata.get(key)
        return len(value) if isinstance(value, list) else None

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def arch_require(self, key: str) -> Any:
        return self.require(f"{self.architecture}.{key}")

    # -- tensors ----------------------------------------------------------------------

    def dequantize(self, name: str) -> torch.Tensor:
        """One tensor, dequantized: float32, torch order (a fresh, writable tensor)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}.")
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        qtype = QT(info.qtype)
        raw = self._data[info.offset : info.offset + info.n_bytes]
        try:
            rows = raw.reshape(quant_shape_to_byte_shape(info.shape, qtype))
            arr = gguf.dequantize(rows, qtype)
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: cannot dequantize tensor {name!r} ({info.type_name}, shape "
                f"{list(info.shape)}): {e}"
            ) from None
        arr = np.asarray(arr, dtype=np.float32).reshape(info.shape)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")  # F32 tensors are mmap views
        return torch.from_numpy(arr)

    def hf_config(self) -> dict:
        """The HF config.json dict this file's metadata describes."""
        builder = CONFIG_BUILDERS.get(self.architecture)
        if builder is None:  # registry mismatch; get_layout already vetted the name
            raise CheckpointError(
                f"{self.path}: no config builder for GGUF architecture {self.architecture!r}."
            )
        return builder(self)

    def iter_hf_tensors(
        self, config: dict, dtype: torch.dtype = torch.bfloat16
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor in `dtype`) for every tensor HF keeps, in file order.

        Raises CheckpointError if a tensor the config implies is missing, or appears twice.
        The layout transform (RoPE un-permutation, Gemma norm -1) runs in float32 before
        the cast, the same order of operations as transformers' GGUF loader.
        """
        expected = self.layout.expected_hf_names(
            config["num_hidden_layers"], config.get("tie_word_embeddings", False)
        )
        names = {}
        for gguf_name in self.tensors:
            hf = self.layout.hf_name(gguf_name)
            if hf is None:
                continue
            if hf in names.values():
                raise CheckpointError(f"{self.path}: two tensors map to HF tensor {hf!r}.")
            names[gguf_name] = hf
        missing = sorted(expected - set(names.values()))
        if missing:
            raise CheckpointError(
                f"{self.path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                f"for a {config['num_hidden_layers']}-layer {self.architecture} model."
            )
        for gguf_name, hf in names.items():
            t = self.dequantize(gguf_name)  # [out, in] float32
            t = self.layout.transform(hf, t, config)
            yield hf, t.to(dtype)


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file. Raises CheckpointError naming the file on bad input."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file. Give the path to a .gguf file.")
    if not p.is_file():
        raise CheckpointError(f"{p}: not a file. Give the path to a .gguf file.")
    size = p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise CheckpointError(
                f"{p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}). qserve "
                "reads .gguf files (GGUF v2/v3) and HF checkpoint directories."
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                metadata, raw_infos, data_start = _parse_header(buf, size)
            except _Truncated as e:
                raise CheckpointError(f"{p}: truncated GGUF file: {e}. Re-download or re-assemble it.") from None
            except (ValueError, struct.error, OverflowError, MemoryError) as e:
                raise CheckpointError(f"{p}: corrupt GGUF header: {e}.") from None
            finally:
                buf.release()
    tensors = []
    for name, dims, type_id, rel in raw_infos:
        try:
            qtype = QT(type_id)
        except ValueError:
            raise CheckpointError(
                f"{p}: tensor {name!r} has unknown GGML type id {type_id}. qserve dequantizes: "
                f"{', '.join(supported_tensor_types())}."
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(dims) if dims else 1
        if dims and dims[0] % block:
            raise CheckpointError(
                f"{p}: tensor {name!r} rows of {dims[0]} do not split into {qtype.name} blocks of {block}."
            )
        n_bytes = n_elements // block * type_size
        offset = data_start + rel
        if offset + n_bytes > size:
            raise CheckpointError(
                f"{p}: truncated GGUF file: tensor {name!r} ends at byte {offset + n_bytes} "
                f"but the file has {size} bytes. Re-download or re-assemble it."
            )
        shape = tuple(int(d) for d in reversed(dims))
        tensors.append(TensorInfo(name, qtype.name, shape, type_id, offset, n_bytes))
    if len({t.name for t in tensors}) != len(tensors):
        raise CheckpointError(f"{p}: corrupt GGUF file: a tensor name appears twice.")
    return GGUFFile(p, metadata, tensors)


# --- metadata -> config.json --------------------------------------------------------------


def _token_ids(g: GGUFFile) -> dict:
    ids = {}
    for hf_key, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ("unk_token_id", "tokenizer.ggml.unknown_token_id"),
    ):
        if g.has(key):
            ids[hf_key] = int(g.get(key))
    return ids


def _vocab_size(g: GGUFFile) -> int:
    n = g.arch_get("vocab_size") or g.array_len("tokenizer.ggml.tokens")
    embd = g.tensors.get("token_embd.weight")
    if embd is not None:
        if n is None:
            n = embd.shape[0]
        elif embd.shape[0] != n:
            raise CheckpointError(
                f"{g.path}: vocabulary has {n} tokens but token_embd.weight has "
                f"{embd.shape[0]} rows."
            )
    if n is None:
        raise CheckpointError(f"{g.path}: cannot tell the vocabulary size (no tokens, no embedding).")
    return int(n)


def _shape_fields(g: GGUFFile) -> dict:
    hidden = int(g.arch_require("embedding_length"))
    heads = int(g.arch_require("attention.head_count"))
    kv_heads = g.arch_get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise CheckpointError(
            f"{g.path}: per-layer KV head counts are not supported for {g.architecture!r}."
        )
    head_dim = g.arch_get("attention.key_length") or g.arch_get("rope.dimension_count")
    return {
        "vocab_size": _vocab_size(g),
        "hidden_size": hidden,
        "intermediate_size": int(g.arch_require("feed_forward_length")),
        "num_hidden_layers": int(g.arch_require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim) if head_dim else hidden // heads,
        "max_position_embeddings": int(g.arch_require("context_length")),
        "rms_norm_eps": float(g.arch_require("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def _rope_scaling(g: GGUFFile) -> dict | None:
    kind = g.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(g.arch_require("rope.scaling.factor"))}
    raise CheckpointError(
        f"{g.path}: RoPE scaling {kind!r} is not supported (qserve reads none and linear)."
    )


def _hf_config(g: GGUFFile, architecture: str, model_type: str, rope_base: float,
               fields: dict) -> dict:
    """config.json: the model's shape, RoPE and token ids from the file, the defaults HF
    configs share, and the architecture's own `fields`."""
    cfg = {"architectures": [architecture], "model_type": model_type}
    cfg.update(_shape_fields(g))
    cfg.update({"rope_theta": float(g.arch_get("rope.freq_base", rope_base)),
                "rope_scaling": _rope_scaling(g), "attention_dropout": 0.0,
                "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"})
    cfg.update(fields)
    cfg.update(_token_ids(g))
    return cfg


def _llama_config(g: GGUFFile) -> dict:
    cfg = _hf_config(g, "LlamaForCausalLM", "llama", 10000.0, {
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    rot = g.arch_get("rope.dimension_count")
    if rot and int(rot) != cfg["head_dim"]:
        raise CheckpointError(
            f"{g.path}: partial rotary embedding (rope.dimension_count={rot}, head_dim="
            f"{cfg['head_dim']}) is not supported for llama."
        )
    return cfg


def _qwen2_config(g: GGUFFile) -> dict:
    return _hf_config(g, "Qwen2ForCausalLM", "qwen2", 1_000_000.0, {
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": int(g.arch_require("block_count"))})


GEMMA3_SLIDING_WINDOW_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3


def _gemma3_config(g: GGUFFile) -> dict:
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    cfg.update(_shape_fields(g))
    n = cfg["num_hidden_layers"]
    pattern = g.arch_get("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: True = sliding-window layer
        if len(pattern) != n:
            raise CheckpointError(f"{g.path}: sliding_window_pattern has {len(pattern)} entries for {n} layers.")
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
        period = None
    else:
        period = int(pattern)
        layer_types = [
            "sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)
        ]
    # llama.cpp scales queries by 1/sqrt(n_embd_head_k), except Gemma 3 27B, which uses
    # 1/sqrt(n_embd / n_head); HF keeps the same number as `query_pre_attn_scalar`.
    if n == 62:
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        scalar = cfg["head_dim"]
    cfg.update(
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": float(g.arch_get("rope.freq_base", 1_000_000.0)),
            # local (sliding) layers' RoPE base; not in the file, fixed by the model family
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": _rope_scaling(g),
            "sliding_window": int(g.arch_require("attention.sliding_window")),
            "layer_types": layer_types,
            "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": g.arch_get("final_logit_softcapping"),
            "attn_logit_softcapping": g.arch_get("attn_logit_softcapping"),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_bidirectional_attention": False,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "bfloat16",
        }
    )
    if period is not None:
        cfg["sliding_window_pattern"] = period
    cfg.update(_token_ids(g))
    return cfg


CONFIG_BUILDERS: dict[str, Callable[[GGUFFile], dict]] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "gemma3": _gemma3_config,
}
