"""Fixed buffers for a decode step's inputs: filled on the host, one copy to the device.

A decode step (every sequence one new token) needs per sequence its token id, position,
the slot its new K/V goes to and its context length, and per KV group its block table.
`StepBuffers` holds all of it in one int32 buffer of fixed capacity, in pinned host
memory where the device is CUDA, and a twin on the device. `stage` writes a step's rows
(padding the batch up to a captured size), then copies the used prefix to the device in
one non-blocking copy. The device views never move, so a CUDA graph captured over them
replays any later step (runtime/decode_graphs.py).

Device buffer layout (int32), S = capacity (sequences), W = table width (blocks), G = KV
groups:
    [ids S | positions S | per group: slots S, seq_lens S | per group: tables S * W]
Vectors first, tables last: the rows of a batch of b <= S sequences all lie within the
first `vectors + (G - 1) * S * W + b * W` entries, the one copy a step makes.

Padding rows (past the step's sequences): token 0 at position 0, slot -1 (store skipped),
context 1, table of zeros: they read one K/V row of block 0 and their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .paged_attention_backend import StaticDecodeGroup, StaticDecodeMetadata


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a decode step, as the host knows it."""

    token_id: int
    position: int  # of the new token; the context is position + 1 tokens
    tables: tuple[Sequence[int], ...]  # per KV group, the sequence's physical blocks


class StepBuffers:
    def __init__(self, capacity: int, table_width: int, num_groups: int, block_size: int,
                 device: torch.device) -> None:
        if capacity < 1 or table_width < 1 or num_groups < 1:
            raise ValueError(f"step buffers need capacity, table width and groups >= 1, got "
                             f"{capacity}, {table_width}, {num_groups}.")
        self.capacity, self.table_width = capacity, table_width
        self.num_groups, self.block_size = num_groups, block_size
        self.device = device
        s, w, g = capacity, table_width, num_groups
        self._vectors = (2 + 2 * g) * s
        size = self._vectors + g * s * w
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)  # [size] int32
        self.buffer = torch.zeros(size, dtype=torch.int32, device=device)  # [size] int32
        self._host_tables = self.host[self._vectors:].view(g, s, w)  # [G, S, W]
        self.ids = self.buffer[:s]  # [S]
        self.positions = self.buffer[s:2 * s]  # [S]
        self.slots = [self.buffer[(2 + 2 * i) * s:(3 + 2 * i) * s] for i in range(g)]  # [S]
        self.seq_lens = [self.buffer[(3 + 2 * i) * s:(4 + 2 * i) * s] for i in range(g)]
        self.tables = self.buffer[self._vectors:].view(g, s, w)  # [G, S, W]
        # [S + 1] and [S] int32, constant: query rows 0..S and every sequence decodes
        self._query_start_loc = torch.arange(s + 1, dtype=torch.int32, device=device)
        self._decode_seqs = torch.arange(s, dtype=torch.int32, device=device)

    def fits(self, rows: Sequence[DecodeRow]) -> bool:
        """Whether a step of these rows fits the buffers (else it runs eagerly)."""
        return 0 < len(rows) <= self.capacity and all(
            len(t) <= self.table_width for r in rows for t in r.tables)

    def metadata(self, padded: int) -> StaticDecodeMetadata:
        """The attention metadata of a padded batch of `padded` sequences: views of the
        device buffer, the same tensors every step (what a captured graph reads)."""
        groups = tuple(StaticDecodeGroup(
            self.slots[i][:padded], self.tables[i, :padded], self.seq_lens[i][:padded])
            for i in range(self.num_groups))
        return StaticDecodeMetadata.of(groups, self._query_start_loc[:padded + 1],
                                       self._decode_seqs[:padded],
                                       self.table_width * self.block_size)

    def stage(self, rows: Sequence[DecodeRow], padded: int) -> None:
        """Write the rows (then padding up to `padded`) into the host buffer and copy the
        used prefix to the device (one copy, non-blocking from pinned memory). The host
        buffer is written again only at the next step, after this step's tokens came back
        to the host, i.e. after the copy. No rows: padding only (graph capture)."""
        wide = any(len(t) > self.table_width for r in rows for t in r.tables)
        if wide or not (len(rows) <= padded <= self.capacity and padded >= 1):
            raise ValueError(f"a decode step of {len(rows)} sequences padded to {padded} does "
                             f"not fit buffers of {self.capacity} x {self.table_width} blocks.")
        s, bs, b = self.capacity, self.block_size, len(rows)
        host = self.host
        ids = [r.token_id for r in rows] + [0] * (padded - b)
        positions = [r.position for r in rows] + [0] * (padded - b)
        host[:padded] = torch.tensor(ids, dtype=torch.int32)
        host[s:s + padded] = torch.tensor(positions, dtype=torch.int32)
        for g in range(self.num_groups):
            slots = [r.tables[g][r.position // bs] * bs + r.position % bs for r in rows]
            at = (2 + 2 * g) * s
            host[at:at + padded] = torch.tensor(slots + [-1] * (padded - b), dtype=torch.int32)
            host[at + s:at + s + padded] = torch.tensor(
                [r.position + 1 for r in rows] + [1] * (padded - b), dtype=torch.int32)
            tables = self._host_tables[g]
            tables[:padded].zero_()
            for i, r in enumerate(rows):
                if r.tables[g]:
                    tables[i, :len(r.tables[g])] = torch.tensor(r.tables[g], dtype=torch.int32)
        used = self._vectors + ((self.num_groups - 1) * s + padded) * self.table_width
        self.buffer[:used].copy_(host[:used], non_blocking=True)
