"""Export (prefill side): copy a computed prompt's cached full KV blocks out of the pool.

Run the prompt first (e.g. a request with max_tokens=1 that finished): its full blocks
stay in the prefix cache after the request ends, until they are evicted. Call
`export_prefix` on the engine's own thread, between steps (the block manager is not
thread-safe, and a step may evict or overwrite unreferenced blocks).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .kv_transfer import KVLayout, KVTransfer


def export_prefix(engine, token_ids: Sequence[int]) -> KVTransfer:
    """A KVTransfer of the longest run of leading full blocks of `token_ids` that are in
    `engine`'s prefix cache in every KV group (all full blocks once the prompt was
    computed and none was evicted; none, an empty transfer, for an unseen prompt).
    Changes nothing in the engine (reads the pool and the cache only)."""
    blocks, cache = engine.blocks, engine.kv_cache
    layout = KVLayout.of(cache)
    per_group = blocks.cached_prefix_blocks(token_ids)
    n = min(len(g) for g in per_group)
    ids = [torch.tensor([b for b, _ in g[:n]], dtype=torch.long) for g in per_group]
    k, v = [], []
    for layer, kv in enumerate(cache.layers):
        group_ids = ids[layout.layer_group[layer]].to(kv.k_pool.device)
        # [n, block_size, Hkv, D] in the pool's dtype; gathered through uint8 views (float8
        # tensors have no indexing kernels everywhere), so the copy is bit-exact
        k.append(kv.k_pool.view(torch.uint8)[group_ids].view(kv.k_pool.dtype).cpu())
        v.append(k[-1] if kv.v_pool is kv.k_pool  # a latent cache: one tensor
                 else kv.v_pool.view(torch.uint8)[group_ids].view(kv.v_pool.dtype).cpu())
    ks = vs = None
    if layout.kv_dtype == "fp8":
        ks = tuple(kv.k_scale.detach().cpu().clone() for kv in cache.layers)
        vs = tuple(kv.v_scale.detach().cpu().clone() for kv in cache.layers)
    return KVTransfer(blocks.namespace, layout, tuple(int(t) for t in token_ids[:n * layout.block_size]),
                      tuple(tuple(h for _, h in g[:n]) for g in per_group),
                      tuple(k), tuple(v), ks, vs)
