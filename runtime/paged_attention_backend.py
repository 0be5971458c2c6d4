"""The engine's attention backend: K/V in a paged KVCache, attention through block tables.

Per layer and step: store the new tokens' K/V into their slots, then attend over each
sequence's whole context through its block table; both through kernels/dispatch.py
(Triton kernels on CUDA, the torch paths of kernels/kv_store.py and
kernels/paged_attention.py elsewhere). The step's layout comes in `PagedAttentionMetadata`,
built once per step by the model runner from the block manager's tables and shared by all
layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import dispatch
from ..kernels.paged_plan import PagedStepPlan
from .attention import AttentionMetadata, AttentionSpec
from .kv_cache import KVCache


@dataclass
class PagedAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus where the step's tokens live in the paged cache.

    slot_mapping: [T] int64, slot (block_id * block_size + offset) of each new token; -1
                  skips storing it.
    block_tables: [B, max_blocks] int32, sequence b's physical blocks in logical order
                  (entries past the blocks its context needs are ignored).
    seq_lens:     [B] int64, context_lens + query lengths (derived when not given).
    groups:       where the KV cache has several layer groups (runtime/kv_groups.py), one
                  metadata per group, this one first; `for_group` picks a layer's.
    """

    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    groups: tuple = field(default=(), repr=False, compare=False)
    _plans: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.slot_mapping is None or self.block_tables is None:
            raise ValueError("PagedAttentionMetadata needs slot_mapping and block_tables.")
        query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        if self.seq_lens is None:
            self.seq_lens = self.context_lens.to(torch.int64) + query_lens
        elif not torch.equal(self.seq_lens.to(torch.int64),
                             self.context_lens.to(torch.int64) + query_lens):
            raise ValueError(f"seq_lens {self.seq_lens.tolist()} must equal context_lens + query "
                             f"lengths {(self.context_lens + query_lens).tolist()}.")

    def for_group(self, group: int) -> "PagedAttentionMetadata":
        """The metadata of KV group `group` (the block tables its layers read)."""
        if not self.groups:
            if group != 0:
                raise ValueError(f"this step's metadata has one KV group, not {group + 1}.")
            return self
        return self.groups[group]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]], block_size: int,
              seq_ids: tuple[int, ...] = (), *,
              group_tables: tuple[list[list[int]], ...] = ()) -> "PagedAttentionMetadata":
        """Slot mapping and padded tables from per-sequence block id lists.
        `group_tables`: the per-sequence tables of KV groups 1.. (like `block_tables`)."""
        base = AttentionMetadata.from_lengths(query_lens, context_lens, seq_ids)  # shared
        metas = [cls._build_one(base, query_lens, context_lens, tables, block_size)
                 for tables in (block_tables, *group_tables)]
        if group_tables:
            metas[0].groups = tuple(metas)
        return metas[0]

    @classmethod
    def _build_one(cls, base: AttentionMetadata, query_lens: list[int],
                   context_lens: list[int], block_tables: list[list[int]],
                   block_size: int) -> "PagedAttentionMetadata":
        """One KV group's slot mapping and padded tables over the step's common layout."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry "
                             "per sequence.")
        slots = []
        for n, ctx, table in zip(query_lens, context_lens, block_tables):
            if (ctx + n + block_size - 1) // block_size > len(table):
                raise ValueError(f"a sequence of {ctx + n} tokens needs more than its "
                                 f"{len(table)} blocks of {block_size}.")
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(ctx, ctx + n)]
        width = max([len(t) for t in block_tables] + [1])
        bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, table in enumerate(block_tables):
            bt[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        return cls(query_start_loc=base.query_start_loc, context_lens=base.context_lens,
                   seq_ids=base.seq_ids, slot_mapping=torch.tensor(slots, dtype=torch.int64),
                   block_tables=bt)

    def plan(self, num_tokens: int, num_blocks: int, block_size: int) -> PagedStepPlan:
        """The step's layout checked once for all layers (torch kernels)."""
        key = (num_tokens, num_blocks, block_size)
        if key not in self._plans:
            self._plans[key] = PagedStepPlan.build(
                num_tokens, num_blocks, block_size, self.slot_mapping, self.block_tables,
                self.query_start_loc, self.seq_lens)
        return self._plans[key]


@dataclass(frozen=True)
class StaticDecodeGroup:
    """One KV group's part of a static decode step (device tensors, fixed addresses)."""

    slot_mapping: torch.Tensor  # [B] int32, -1 for padding rows (store skipped)
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32, context incl. the new token (padding rows: 1)


@dataclass
class StaticDecodeMetadata(AttentionMetadata):
    """A decode step (one new token per sequence) whose metadata lives in fixed device
    buffers (runtime/step_buffers.py) and is never read on the host: the layout a CUDA
    graph captures once and replays (runtime/decode_graphs.py). The host checked it when
    it built the rows. `max_context`: the most tokens a block table row can hold, which
    fixes the decode kernel's split count."""

    decode_seqs: torch.Tensor | None = None  # [B] int32: 0..B-1
    kv_groups: tuple[StaticDecodeGroup, ...] = ()
    max_context: int = 0

    @classmethod
    def of(cls, groups: tuple[StaticDecodeGroup, ...], query_start_loc: torch.Tensor,
           decode_seqs: torch.Tensor, max_context: int) -> "StaticDecodeMetadata":
        # context_lens is the host's business here: the kernels read seq_lens
        return cls(query_start_loc=query_start_loc, context_lens=groups[0].seq_lens,
                   seq_ids=(), decode_seqs=decode_seqs, kv_groups=groups,
                   max_context=max_context)

    def for_group(self, group: int) -> StaticDecodeGroup:
        if not 0 <= group < len(self.kv_groups):
            raise ValueError(f"this step's metadata has {len(self.kv_groups)} KV groups, not "
                             f"{group + 1}.")
        return self.kv_groups[group]


class PagedAttentionBackend:
    """AttentionBackend over a KVCache. forward() mutates the cache (stores the new K/V)."""

    def __init__(self, kv_cache: KVCache, decode_impl: str | None = None,
                 kernels: str | None = None) -> None:
        self.kv_cache = kv_cache
        self.decode_impl = decode_impl  # None: the kernels' default (native, else compiled)
        # "torch" | "triton" (the engine's ExecutionBackend.kernels); None: by device
        self.kernels = kernels

    def forward(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, Hq, D], dtype of q
        if isinstance(meta, StaticDecodeMetadata):
            return self._static_decode(spec, q, k, v, meta)
        if not isinstance(meta, PagedAttentionMetadata):
            raise ValueError("PagedAttentionBackend needs PagedAttentionMetadata (slot_mapping, "
                             f"block_tables, seq_lens), got {type(meta).__name__}.")
        cs = self.kv_cache.spec
        if (spec.num_kv_heads, spec.head_dim) != (cs.num_kv_heads, cs.head_dim):
            raise ValueError(f"layer {spec.layer_idx} has {spec.num_kv_heads} kv heads of dim "
                             f"{spec.head_dim}; the KV cache was built for {cs.num_kv_heads} "
                             f"of dim {cs.head_dim}.")
        layer = self.kv_cache.layer(spec.layer_idx)
        meta = meta.for_group(self.kv_cache.group_of(spec.layer_idx))
        plan = None
        kernels = dispatch.backend_for(q.device, self.kernels)
        if kernels == "torch":
            plan = meta.plan(q.shape[0], layer.k_pool.shape[0], layer.k_pool.shape[1])
        dispatch.store_kv(k, v, layer.k_pool, layer.v_pool, meta.slot_mapping, layer.k_scale,
                          layer.v_scale, plan=plan, backend=kernels)
        return dispatch.paged_attention(
            q, layer.k_pool, layer.v_pool, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, layer.k_scale, layer.v_scale, spec.scale, spec.sliding_window,
            spec.logit_softcap, decode_impl=self.decode_impl, plan=plan, backend=kernels)

    def _static_decode(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, meta: StaticDecodeMetadata) -> torch.Tensor:
        """A decode step from fixed device buffers: no host read of its metadata."""
        layer = self.kv_cache.layer(spec.layer_idx)
        group = meta.for_group(self.kv_cache.group_of(spec.layer_idx))
        kernels = dispatch.backend_for(q.device, self.kernels)
        dispatch.kernel("store_kv_static", q.device, kernels)(
            k, v, layer.k_pool, layer.v_pool, group.slot_mapping, layer.k_scale, layer.v_scale)
        return dispatch.kernel("decode_attention_static", q.device, kernels)(
            q, layer.k_pool, layer.v_pool, group.block_tables, group.seq_lens,
            meta.query_start_loc, meta.decode_seqs, layer.k_scale, layer.v_scale, spec.scale,
            spec.sliding_window, spec.logit_softcap, meta.max_context)
