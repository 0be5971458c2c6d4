"""One request prefix's KV blocks, as they travel from a prefill engine to a decode engine.

A transfer carries what the receiver needs to place the blocks and to decide whether it
may: the namespace the block hashes are chained under (model identity: another model's
KV must never be served), the layout of the KV pool (block size, layers, kv heads, head
size, KV dtype, KV groups), the token ids of the full blocks covered, the chained block
hashes per KV group, and per layer the K and V bytes of those blocks (with the FP8 scales
the bytes were quantized with, so the receiver can check they are its own). Optionally a
tail: the KV of the prompt tokens after the last full block but its last token (fewer
than a block), which the receiver writes into the request's own block
(runtime/kv_tail.py) instead of computing those tokens.

Wire format (`to_buffer` / `to_bytes` / `from_bytes`, no pickle):

    b"QSKV" | version u32 BE | header length u64 BE | header (UTF-8 JSON) | payload
    payload: layer 0 K, layer 0 V, layer 1 K, ... each [num_blocks, block_size, Hkv, D]
    in the KV dtype, C order; then the tail the same way, each [tail tokens, Hkv, D]
    (a latent cache: K only); the header holds the length and CRC-32.

The payload's CRC-32 catches bytes damaged on the way (as TCP's and Ethernet's checks
do), at 2-3x the speed of SHA-256: on the decode worker every byte of it is computed on
the core that runs the decode steps. Which prefix the blocks hold is the block hashes'
job, and they stay SHA-256 chains over the tokens.

A frame is written with one copy of the KV bytes (`to_buffer`: hashed from the tensors,
then copied into one buffer) and read with none beyond the socket's (`from_bytes` of a
writable buffer: the tensors are views of it).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass

import torch

from ..kv_cache import KVCache
from ..kv_tail import KVTail

FORMAT_VERSION = 3   # 3: the payload's CRC-32 (was SHA-256)
_MAGIC = b"QSKV"
_PREFIX = struct.Struct(">4sIQ")  # magic, version, header length
_DTYPES = {"bf16": (torch.bfloat16, 2), "fp8": (torch.float8_e4m3fn, 1)}


class KVTransferError(ValueError):
    """A transfer that is malformed (bad bytes, inconsistent fields)."""


class KVTransferMismatch(KVTransferError):
    """A well-formed transfer this engine must not use (another model, layout or scales,
    or block hashes that do not follow from its tokens)."""


@dataclass(frozen=True)
class KVLayout:
    """How a KV pool lays out one block; two engines can exchange blocks iff equal."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # "bf16" | "fp8"
    windows: tuple[int | None, ...]  # per KV group: attention window, None = full
    layer_group: tuple[int, ...]  # per layer: its KV group (block table)
    layer_slot: tuple[int, ...]  # per layer: its slice of a block id
    # MLA's latent cache: one vector per token and layer, read as key and value; a
    # transfer carries it once (its v tensors are its k tensors)
    values_in_keys: bool = False

    @property
    def pools_per_layer(self) -> int:
        return 1 if self.values_in_keys else 2

    def __post_init__(self):
        if self.kv_dtype not in _DTYPES:
            raise KVTransferError(f"unknown KV dtype {self.kv_dtype!r}; expected one of "
                                  f"{sorted(_DTYPES)}.")
        if len(self.layer_group) != self.num_layers or len(self.layer_slot) != self.num_layers:
            raise KVTransferError(f"layout has {self.num_layers} layers but "
                                  f"{len(self.layer_group)} layer groups and "
                                  f"{len(self.layer_slot)} layer slots.")
        if any(not 0 <= g < len(self.windows) for g in self.layer_group):
            raise KVTransferError(f"layer groups {self.layer_group} name groups outside the "
                                  f"{len(self.windows)} windows {self.windows}.")

    @classmethod
    def of(cls, kv_cache: KVCache) -> "KVLayout":
        spec, groups = kv_cache.spec, kv_cache.groups
        return cls(spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                   spec.dtype, tuple(groups.windows), tuple(groups.layer_group),
                   tuple(groups.layer_slot), spec.values_in_keys)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype][0]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One layer's K (or V) of one block: (block_size, Hkv, D)."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def block_nbytes(self) -> int:
        """One layer's K (or V) of one block, in bytes."""
        return self.block_size * self.num_kv_heads * self.head_dim * _DTYPES[self.kv_dtype][1]

    def differences(self, other: "KVLayout") -> list[str]:
        """'field: mine vs theirs' for each field that differs (empty: compatible)."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass(frozen=True, eq=False)
class KVTransfer:
    namespace: str  # what the block hashes are chained under (artifact identity)
    layout: KVLayout
    token_ids: tuple[int, ...]  # the full blocks' tokens: num_blocks * block_size ids
    block_hashes: tuple[tuple[bytes, ...], ...]  # per KV group, per block: chained sha256
    k: tuple[torch.Tensor, ...]  # per layer [num_blocks, block_size, Hkv, D], KV dtype, cpu
    v: tuple[torch.Tensor, ...]
    k_scales: tuple[torch.Tensor, ...] | None = None  # per layer fp32 [1] or [Hkv]; fp8 only
    v_scales: tuple[torch.Tensor, ...] | None = None
    # the prompt's tokens after the full blocks whose KV travels too (< block_size), and
    # per layer their K and V [t, Hkv, D] (empty tuples: no tail)
    tail_token_ids: tuple[int, ...] = ()
    tail_k: tuple[torch.Tensor, ...] = ()
    tail_v: tuple[torch.Tensor, ...] = ()

    def __post_init__(self):
        lay = self.layout
        if not self.namespace:
            raise KVTransferError("a KV transfer needs the namespace its hashes are chained "
                                  "under (e.g. the artifact digest).")
        n = len(self.token_ids) // lay.block_size
        if len(self.token_ids) != n * lay.block_size:
            raise KVTransferError(f"a KV transfer covers full blocks only: "
                                  f"{len(self.token_ids)} tokens is not a multiple of the "
                                  f"block size {lay.block_size}.")
        if len(self.block_hashes) != lay.num_groups or any(
                len(h) != n for h in self.block_hashes):
            raise KVTransferError(f"expected {n} block hashes for each of {lay.num_groups} KV "
                                  f"groups, got {[len(h) for h in self.block_hashes]}.")
        shape = (n, *lay.block_shape)
        for name, tensors in (("k", self.k), ("v", self.v)):
            if len(tensors) != lay.num_layers:
                raise KVTransferError(f"expected {name} for {lay.num_layers} layers, got "
                                      f"{len(tensors)}.")
            for i, t in enumerate(tensors):
                if tuple(t.shape) != shape or t.dtype != lay.torch_dtype:
                    raise KVTransferError(f"layer {i} {name}: expected {shape} "
                                          f"{lay.torch_dtype}, got {tuple(t.shape)} {t.dtype}.")
        has_scales = (self.k_scales is not None, self.v_scales is not None)
        if has_scales != ((lay.kv_dtype == "fp8"),) * 2:
            raise KVTransferError(f"{lay.kv_dtype} KV needs k and v scales iff it is fp8; "
                                  f"got k_scales={has_scales[0]}, v_scales={has_scales[1]}.")
        for scales in (self.k_scales, self.v_scales):
            if scales is not None and len(scales) != lay.num_layers:
                raise KVTransferError(f"expected scales for {lay.num_layers} layers, got "
                                      f"{len(scales)}.")
        t = len(self.tail_token_ids)
        if t >= lay.block_size:
            raise KVTransferError(f"a KV tail is shorter than a block ({lay.block_size} "
                                  f"tokens); got {t}.")
        tail_shape = (t, lay.num_kv_heads, lay.head_dim)
        for name, tensors in (("tail k", self.tail_k), ("tail v", self.tail_v)):
            if len(tensors) != (lay.num_layers if t else 0):
                raise KVTransferError(f"expected {name} for {lay.num_layers if t else 0} "
                                      f"layers ({t} tail tokens), got {len(tensors)}.")
            for i, x in enumerate(tensors):
                if tuple(x.shape) != tail_shape or x.dtype != lay.torch_dtype:
                    raise KVTransferError(f"layer {i} {name}: expected {tail_shape} "
                                          f"{lay.torch_dtype}, got {tuple(x.shape)} {x.dtype}.")

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.layout.block_size

    @property
    def num_tokens(self) -> int:
        """Prompt tokens whose KV this transfer carries: full blocks and tail."""
        return len(self.token_ids) + len(self.tail_token_ids)

    @property
    def payload_nbytes(self) -> int:
        lay = self.layout
        per_token = lay.block_nbytes() // lay.block_size
        return (lay.pools_per_layer * lay.num_layers
                * (self.num_blocks * lay.block_size + len(self.tail_token_ids)) * per_token)

    def tail(self) -> KVTail | None:
        """The tail as the engine takes it (`add_request(kv_tail=...)`), or None."""
        if not self.tail_token_ids:
            return None
        return KVTail(len(self.token_ids), self.tail_token_ids, self.tail_k, self.tail_v)

    # ------------------------------------------------------------------ wire format
    def to_bytes(self) -> bytes:
        return bytes(self.to_buffer())

    def to_buffer(self) -> bytearray:
        """The wire frame in one new buffer (the KV bytes copied once)."""
        one = self.layout.values_in_keys
        parts = [_raw(t) for k, v in (*zip(self.k, self.v), *zip(self.tail_k, self.tail_v))
                 for t in ((k,) if one else (k, v))]  # uint8 [n] each, in payload order
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        size = sum(part.nbytes for part in parts)
        scales = None
        if self.k_scales is not None:
            scales = {"k": [s.to(torch.float32).reshape(-1).tolist() for s in self.k_scales],
                      "v": [s.to(torch.float32).reshape(-1).tolist() for s in self.v_scales]}
        header = json.dumps({
            "namespace": self.namespace,
            "layout": asdict(self.layout),
            "token_ids": list(self.token_ids),
            "tail_token_ids": list(self.tail_token_ids),
            "block_hashes": [[h.hex() for h in group] for group in self.block_hashes],
            "scales": scales,  # float32 values, exact through JSON's doubles
            "payload_bytes": size,
            "payload_crc32": crc,
        }).encode("utf-8")
        start = _PREFIX.size + len(header)
        frame = bytearray(start + size)
        view = memoryview(frame)
        view[:start] = _PREFIX.pack(_MAGIC, FORMAT_VERSION, len(header)) + header
        for part in parts:
            view[start:start + part.nbytes] = part
            start += part.nbytes
        return frame

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "KVTransfer":
        """The transfer in a frame; its tensors are views of `data` where it is writable
        (a bytearray: no copy), else of a copy."""
        data = memoryview(data)
        if len(data) < _PREFIX.size:
            raise KVTransferError(f"{len(data)} bytes is too short for a KV transfer.")
        magic, version, header_len = _PREFIX.unpack(data[:_PREFIX.size])
        if magic != _MAGIC:
            raise KVTransferError(f"not a KV transfer (magic {bytes(magic)!r}, expected "
                                  f"{_MAGIC!r}).")
        if version != FORMAT_VERSION:
            raise KVTransferMismatch(f"KV transfer format version {version}; this build reads "
                                     f"version {FORMAT_VERSION}: run the same qserve version "
                                     f"on both sides.")
        start = _PREFIX.size + header_len
        if len(data) < start:
            raise KVTransferError(f"KV transfer truncated inside its {header_len}-byte header.")
        try:
            h = json.loads(bytes(data[_PREFIX.size:start]).decode("utf-8"))
            lay = h["layout"]
            layout = KVLayout(**{**lay, "windows": tuple(lay["windows"]),
                                 "layer_group": tuple(lay["layer_group"]),
                                 "layer_slot": tuple(lay["layer_slot"])})
            hashes = tuple(tuple(bytes.fromhex(x) for x in g) for g in h["block_hashes"])
            tail_ids = tuple(int(t) for t in h["tail_token_ids"])
        except (ValueError, KeyError, TypeError) as e:
            raise KVTransferError(f"KV transfer header is malformed: {e}") from e
        payload = data[start:] if not data.readonly else memoryview(bytearray(data[start:]))
        if len(payload) != h["payload_bytes"]:
            raise KVTransferError(f"KV transfer payload is {len(payload)} bytes, its header "
                                  f"says {h['payload_bytes']} (truncated?).")
        if zlib.crc32(payload) != h["payload_crc32"]:
            raise KVTransferError("KV transfer payload does not match its CRC-32: corrupted "
                                  "in transit; send it again.")
        n, t = len(h["token_ids"]) // layout.block_size, len(tail_ids)
        shape, size = (n, *layout.block_shape), n * layout.block_nbytes()
        tail_shape = (t, layout.num_kv_heads, layout.head_dim)
        tail_size = t * layout.block_nbytes() // layout.block_size
        per, count = layout.pools_per_layer, layout.pools_per_layer * layout.num_layers
        if len(payload) != count * (size + tail_size):
            raise KVTransferError(f"KV transfer payload is {len(payload)} bytes; {n} blocks "
                                  f"and {t} tail tokens of this layout need "
                                  f"{count * (size + tail_size)}.")
        tensors = [_tensor(payload, j * size, size, layout.torch_dtype, shape)
                   for j in range(count)]
        tails = [_tensor(payload, count * size + j * tail_size, tail_size, layout.torch_dtype,
                         tail_shape) for j in range(count if t else 0)]
        if per == 1:  # the latent: each layer's one tensor is its key and its value
            tensors = [x for x in tensors for _ in (0, 1)]
            tails = [x for x in tails for _ in (0, 1)]
        scales = h["scales"]
        ks = vs = None
        if scales is not None:
            ks = tuple(torch.tensor(s, dtype=torch.float32) for s in scales["k"])
            vs = tuple(torch.tensor(s, dtype=torch.float32) for s in scales["v"])
        return cls(h["namespace"], layout, tuple(int(x) for x in h["token_ids"]), hashes,
                   tuple(tensors[0::2]), tuple(tensors[1::2]), ks, vs,
                   tail_ids, tuple(tails[0::2]), tuple(tails[1::2]))


def _raw(t: torch.Tensor):
    """A tensor's bytes in C order, uint8 [n] as numpy (bf16 and float8 through a uint8
    view; no copy of a contiguous CPU tensor)."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()


def _tensor(buf: memoryview, offset: int, nbytes: int, dtype: torch.dtype,
            shape: tuple[int, ...]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).reshape(shape)
