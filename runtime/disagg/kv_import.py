"""Import (decode side): place a KVTransfer's blocks in an engine's prefix cache.

After `import_prefix`, a request whose prompt starts with the transfer's tokens is served
those blocks from the prefix cache, exactly as if this engine had computed them: the
blocks are allocated under a temporary request id through `BlockManager.allocate` (which
registers their chained hashes), the transferred K/V bytes are written into them for
every layer, and the temporary request is freed, so they stay cached with no reference
(evictable, least recently used last) until a request takes them.

Call it on the engine's own thread, between steps (the block manager is not thread-safe;
a step in flight may read or evict blocks). The placement counts as one `allocate` in
the block manager's prefix stats.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from .kv_transfer import KVLayout, KVTransfer, KVTransferMismatch


class NotEnoughKVBlocks(RuntimeError):
    """The engine has too few free blocks to place a transfer; nothing was changed."""


@dataclass(frozen=True)
class ImportResult:
    num_blocks: int  # full blocks in the transfer (each KV group)
    num_skipped: int  # of them already cached here: shared, not written
    num_written: int  # blocks written from the transfer (each KV group)
    num_cached_tokens: int  # leading transfer tokens now in the prefix cache (every group)


def check_transfer(engine, transfer: KVTransfer) -> None:
    """Raise KVTransferMismatch unless `engine` may use `transfer`'s blocks: same namespace,
    same KV layout, same FP8 scales, and block hashes that follow from its tokens under
    this engine's namespace. Changes nothing."""
    blocks, cache = engine.blocks, engine.kv_cache
    if transfer.namespace != blocks.namespace:
        raise KVTransferMismatch(
            f"the transfer's KV belongs to namespace {transfer.namespace!r}, this engine's "
            f"is {blocks.namespace!r} (another artifact, weight dtype or KV dtype): send it to "
            f"an engine serving the same artifact with the same dtypes.")
    diff = KVLayout.of(cache).differences(transfer.layout)
    if diff:
        raise KVTransferMismatch(f"the transfer's KV layout differs from this engine's "
                                 f"(this engine vs transfer): {'; '.join(diff)}. Start both "
                                 f"engines with the same block size and KV dtype.")
    if transfer.layout.kv_dtype == "fp8":
        bad = [i for i, kv in enumerate(cache.layers)
               if not (torch.equal(kv.k_scale.cpu(), transfer.k_scales[i])
                       and torch.equal(kv.v_scale.cpu(), transfer.v_scales[i]))]
        if bad:
            raise KVTransferMismatch(f"the transfer's FP8 KV was quantized with other k/v "
                                     f"scales than this engine's at layers {bad}: both "
                                     f"engines must serve the same calibrated artifact.")
    mine = blocks.block_hashes(transfer.token_ids)
    for g, (expected, got) in enumerate(zip(mine, transfer.block_hashes)):
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                raise KVTransferMismatch(
                    f"block {i} of KV group {g}: the transferred hash {b.hex()[:16]}... is not "
                    f"the hash of its tokens here ({a.hex()[:16]}...): tokens or hashes were "
                    f"altered, or the sender chains hashes differently. Refused.")


def import_prefix(engine, transfer: KVTransfer) -> ImportResult:
    """Place `transfer`'s blocks in `engine`'s prefix cache (see the module docstring).

    Raises KVTransferMismatch (see `check_transfer`), ValueError when the engine has
    prefix caching off (nothing could hit the blocks), or NotEnoughKVBlocks when too few
    blocks are free; in each case nothing is changed. Blocks already cached here are
    shared, not written."""
    if not engine.config.enable_prefix_caching:
        raise ValueError("this engine has prefix caching off, so no request could use "
                         "imported KV blocks: enable prefix caching on the decode engine.")
    check_transfer(engine, transfer)
    blocks, cache = engine.blocks, engine.kv_cache
    n, bs = transfer.num_blocks, transfer.layout.block_size
    tokens = list(transfer.token_ids)
    if min(len(g) for g in blocks.cached_prefix_blocks(tokens)) == n:
        return ImportResult(n, n, 0, n * bs)  # everything is here already (or n == 0)
    rid = f"kv-import-{uuid.uuid4().hex}"
    # one token past the full blocks, never hashed, lets all n blocks hit the cache
    # (allocate keeps a prompt's last token to compute)
    alloc = blocks.allocate(rid, tokens + [0], n * bs)
    if alloc is None:
        raise NotEnoughKVBlocks(
            f"placing {n} KV blocks in each of {blocks.num_groups} KV groups needs more than "
            f"the {blocks.num_free_blocks} free blocks: retry when requests have finished, "
            f"or give the decode engine more KV blocks.")
    try:
        hits = alloc.num_cached_tokens // bs
        tables = blocks.block_tables(rid)
        for layer, kv in enumerate(cache.layers):
            # group's fresh blocks for logical blocks hits..n-1; [n - hits]
            dst = torch.tensor(tables[transfer.layout.layer_group[layer]][hits:n],
                               dtype=torch.long, device=kv.k_pool.device)
            # [n - hits, block_size, Hkv, D] each, bit-exact
            kv.write(dst, transfer.k[layer][hits:], transfer.v[layer][hits:])
    finally:
        blocks.free(rid)
    cached = min(len(g) for g in blocks.cached_prefix_blocks(tokens))
    return ImportResult(n, hits, n - hits, cached * bs)
