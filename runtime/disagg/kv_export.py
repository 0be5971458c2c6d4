"""Export (prefill side): copy a computed prompt's KV out of the pool.

`export_prefix`: the prompt's full blocks found in the prefix cache (run the prompt
first, e.g. a request with max_tokens=1 that finished: its full blocks stay cached after
it ends, until they are evicted).
`export_request`: the same, plus the tail, the KV of the prompt's tokens past its last
full block but the last token, read from the blocks of a finished request that was added
with `hold_kv=True` (a partial block is not cached: once freed it may be overwritten).
The decode engine then computes only the prompt's last token.

Call both on the engine's own thread, between steps (the block manager is not
thread-safe, and a step may evict or overwrite unreferenced blocks).
"""

from __future__ import annotations

import dataclasses
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
    # per layer [n, block_size, Hkv, D]
    k, v = zip(*(kv.read(ids[layout.layer_group[layer]].to(kv.k_pool.device))
                 for layer, kv in enumerate(cache.layers)))
    ks = vs = None
    if layout.kv_dtype == "fp8":
        ks = tuple(kv.k_scale.detach().cpu().clone() for kv in cache.layers)
        vs = tuple(kv.v_scale.detach().cpu().clone() for kv in cache.layers)
    return KVTransfer(blocks.namespace, layout, tuple(int(t) for t in token_ids[:n * layout.block_size]),
                      tuple(tuple(h for _, h in g[:n]) for g in per_group),
                      tuple(k), tuple(v), ks, vs)


def export_request(engine, request_id: str, token_ids: Sequence[int]) -> KVTransfer:
    """A KVTransfer of `token_ids` (the prompt of the finished, held request
    `request_id`): its full blocks up to the last prompt token, and the tail after them
    when every one of those blocks is still cached. Changes nothing (release the held
    blocks with `engine.release_kv`)."""
    bs = engine.blocks.block_size
    full = (len(token_ids) - 1) // bs  # blocks before the last token's
    transfer = export_prefix(engine, token_ids[:full * bs])
    t = len(token_ids) - 1 - full * bs
    if transfer.num_blocks < full or t == 0:
        return transfer  # (blocks evicted: the decode side computes the rest)
    cache, tables = engine.kv_cache, engine.blocks.block_tables(request_id)
    rows = torch.arange(t)
    # per layer [t, Hkv, D]: the first t slots of the block after the full ones
    tail_k, tail_v = zip(*(kv.read((tables[cache.group_of(layer)][full], rows))
                           for layer, kv in enumerate(cache.layers)))
    return dataclasses.replace(transfer, tail_token_ids=tuple(int(x) for x in
                                                              token_ids[full * bs:-1]),
                               tail_k=tuple(tail_k), tail_v=tuple(tail_v))

