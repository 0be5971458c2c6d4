"""The paged KV cache's memory: preallocated K and V pools, one pair per layer slice of a block.

Each pool is `[num_blocks, block_size, num_kv_heads, head_dim]`. Where all layers attend to
the whole context there is one pair per layer; where sliding-window and full layers mix,
layers are grouped by window (runtime/kv_groups.py) and the layers at the same slot of
different groups share a pair, each group using the block ids the block manager gave it.
FP8 pools hold one byte per element (allocated as uint8, used through a float8_e4m3fn
view of the same memory) and come with the artifact's static per-layer ([1]) or per-head
([Hkv]) fp32 k/v scales; bf16 pools hold K/V as the model computed them and have no
scales. A latent cache (`values_in_keys`, MLA: runtime/layers/mla_attention.py) has one
pool per layer slice: each token's cached vector is the key, and its first values are
the value, so a layer's "V pool" is its K pool and k and v share one scale. Which block belongs to which sequence is decided elsewhere (the block manager);
this class only owns memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..kernels.fp8 import FP8_DTYPE
from .kv_groups import KVGroups

_DTYPES = {"fp8": (FP8_DTYPE, 1), "bf16": (torch.bfloat16, 2)}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "fp8"  # "fp8" | "bf16"
    # per layer: its attention window, None = full attention (all None when not given);
    # layers of different windows get block tables of their own (KVGroups)
    layer_windows: tuple[int | None, ...] | None = None
    values_in_keys: bool = False  # MLA latent: one pool, read as both K and V

    @property
    def pools_per_slot(self) -> int:
        return 1 if self.values_in_keys else 2

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVCacheSpec.dtype must be one of {sorted(_DTYPES)}, "
                             f"got {self.dtype!r}.")
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"KVCacheSpec.layer_windows has {len(self.layer_windows)} "
                             f"entries for {self.num_layers} layers.")

    @property
    def groups(self) -> KVGroups:
        if self.layer_windows is None:
            return KVGroups.single(self.num_layers)
        return KVGroups.of(tuple(self.layer_windows))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]

    @property
    def element_size(self) -> int:
        return _DTYPES[self.dtype][1]

    @property
    def bytes_per_token(self) -> int:
        """K and V (or the latent) of one token over all layers."""
        return self.pools_per_slot * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """One block id: K and V of `block_size` tokens for `groups.slots` layers."""
        return (self.pools_per_slot * self.groups.slots * self.num_kv_heads * self.head_dim * self.element_size
                * self.block_size)

    def num_blocks_for(self, budget_bytes: int) -> int:
        """How many whole blocks fit in `budget_bytes` of KV memory."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}.")
        return int(budget_bytes) // self.bytes_per_block


class LayerKV(NamedTuple):
    """One layer's pools and scales, as store_kv and paged_attention take them."""

    k_pool: torch.Tensor  # [num_blocks, block_size, Hkv, D] float8_e4m3fn or bf16
    v_pool: torch.Tensor
    k_scale: torch.Tensor | None  # fp32 [1] or [Hkv]; None for bf16 pools
    v_scale: torch.Tensor | None

    # Bit-exact copies between the pools and tensors elsewhere (KV transfer), through
    # integer views: float8 tensors have no indexing kernels everywhere. `index` is
    # advanced indexing into [num_blocks, block_size]: block ids (a 1-D tensor: whole
    # blocks, moved as rows of the widest integer that divides a block's bytes, ~6x faster
    # than byte-wise indexing), or a block and its slots. A latent cache has one pool
    # (v_pool is k_pool): its values are its keys.
    def read(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V at `index` on the CPU, in the pools' dtypes (a latent cache:
        its one tensor, twice)."""
        k = _read(self.k_pool, index)
        return (k, k) if self.v_pool is self.k_pool else (k, _read(self.v_pool, index))

    def write(self, index, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V (shaped as the pools at `index`, in their dtypes) at `index`; a
        latent cache writes only `k`."""
        pairs = ((self.k_pool, k),) if self.v_pool is self.k_pool else (
            (self.k_pool, k), (self.v_pool, v))
        for pool, src in pairs:
            src = src.to(pool.device)
            if _whole_blocks(pool, index):
                _block_rows(pool).index_copy_(0, index.to(pool.device),
                                              _block_rows(src.contiguous()))
            else:
                pool.view(torch.uint8)[index] = src.view(torch.uint8)


def _whole_blocks(pool: torch.Tensor, index) -> bool:
    return isinstance(index, torch.Tensor) and index.dim() == 1 and pool.is_contiguous()


def _block_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous [n, block_size, ...] of any dtype as [n, block bytes / w] of the widest
    integer type (w = 8, 4, 2 or 1 bytes) that divides a block's bytes."""
    rows = t.view(torch.uint8).reshape(t.shape[0], -1)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if rows.shape[1] % dtype.itemsize == 0:
            return rows.view(dtype)
    return rows


def _read(pool: torch.Tensor, index) -> torch.Tensor:
    """A copy of `pool` at `index` (see LayerKV), on the CPU, in the pool's dtype."""
    if not _whole_blocks(pool, index):
        return pool.view(torch.uint8)[index].view(pool.dtype).cpu()
    rows = _block_rows(pool).index_select(0, index.to(pool.device))
    # [n, block_size, Hkv, D] in the pool's dtype
    return rows.view(torch.uint8).view(pool.dtype).view(-1, *pool.shape[1:]).cpu()


def _scale(value, layer: int, which: str, num_kv_heads: int) -> torch.Tensor:
    t = torch.as_tensor(value).detach().to(torch.float32).reshape(-1).clone()
    if t.numel() not in (1, num_kv_heads):
        raise ValueError(f"layer {layer}: {which}_scale has {t.numel()} elements; expected 1 "
                         f"(per layer) or {num_kv_heads} (per kv head).")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"layer {layer}: {which}_scale must be finite and > 0, got {t.tolist()}.")
    return t


class KVCache:
    """Preallocated K/V pools for every layer. Allocation happens once, in __init__."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """kv_scales: layer -> (k_scale, v_scale), e.g. LoadedModel.kv_scales from an
        artifact; required for every layer of an FP8 cache, not allowed for bf16."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}; is the KV "
                             f"memory budget smaller than one block ({spec.bytes_per_block} B)?")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        kv_scales = kv_scales or {}
        if spec.dtype == "fp8":
            missing = [i for i in range(spec.num_layers) if i not in kv_scales]
            if missing:
                raise ValueError(f"an FP8 KV cache needs k/v scales for every layer; missing "
                                 f"layers {missing}. Use an artifact with a kv_cache_scheme, "
                                 f"or kv dtype 'bf16'.")
        elif kv_scales:
            raise ValueError("kv_scales apply to an FP8 KV cache only; a bf16 cache has none.")

        def alloc() -> torch.Tensor:
            if spec.dtype == "fp8":  # 1 byte/element: uint8 memory, used as float8_e4m3fn
                return torch.zeros(shape, dtype=torch.uint8, device=device).view(FP8_DTYPE)
            return torch.zeros(shape, dtype=spec.torch_dtype, device=device)

        self.groups = spec.groups
        pools = []
        for _ in range(self.groups.slots):
            k = alloc()
            pools.append((k, k if spec.values_in_keys else alloc()))
        self._pools = pools
        self.layers: list[LayerKV] = []
        for i in range(spec.num_layers):
            ks = vs = None
            if spec.dtype == "fp8":
                ks = _scale(kv_scales[i][0], i, "k", spec.num_kv_heads).to(device)
                vs = _scale(kv_scales[i][1], i, "v", spec.num_kv_heads).to(device)
                if spec.values_in_keys:  # one stored vector: the key's scale reads it
                    if not torch.equal(ks, vs):
                        raise ValueError(f"layer {i}: a latent KV cache stores one vector per "
                                         f"token, so k_scale {ks.tolist()} and v_scale "
                                         f"{vs.tolist()} must be equal.")
                    vs = ks
            self.layers.append(LayerKV(*self._pools[self.groups.layer_slot[i]], ks, vs))

    @classmethod
    def for_budget(cls, spec: KVCacheSpec, budget_bytes: int, kv_scales=None,
                   device: torch.device | str = "cpu") -> "KVCache":
        return cls(spec, spec.num_blocks_for(budget_bytes), kv_scales, device)

    def layer(self, layer_idx: int) -> LayerKV:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer {layer_idx} out of range: the cache has "
                             f"{len(self.layers)} layers.")
        return self.layers[layer_idx]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def device(self) -> torch.device:
        """Where the pools live."""
        return self._pools[0][0].device

    @property
    def blocks_per_group(self) -> int:
        """Blocks each KV group's tables could get if the pool were shared out evenly: the
        size of a single-group pool holding as many tokens (e.g. a draft model's cache)."""
        return max(1, self.num_blocks // self.groups.num_groups)

    def group_of(self, layer_idx: int) -> int:
        """The KV group (block table) layer `layer_idx` reads and writes."""
        return self.groups.layer_group[layer_idx]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every pool (a forked sample's own copy of a
        partly filled block; BlockManager.fork). Bit-exact, through integer views."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
        for k, v in self._pools:
            for pool in ((k,) if v is k else (k, v)):
                rows = _block_rows(pool)  # [num_blocks, block bytes / w] integer view
                rows.index_copy_(0, dst.to(pool.device), rows.index_select(0, src.to(pool.device)))

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + (0 if v is k else v.nbytes) for k, v in self._pools)
